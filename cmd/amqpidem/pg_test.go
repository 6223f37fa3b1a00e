package main_test

import (
	"context"
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// pgStore returns a pgstore.Store in a schema of the test's own, dropped
// when the test ends, on a pool of conns connections, and its config.
func pgStore(t *testing.T, conns int32) (*pgstore.Store, pgstore.Config) {
	t.Helper()
	pool := pgenv.Pool(t, conns)
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(t)), CleanupInterval: -1}
	if err := pgstore.Migrate(context.Background(), pool, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	s, err := pgstore.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s, cfg
}

// The same commands read and forget the records of the PostgreSQL store.
func TestInspectForgetPostgres(t *testing.T) {
	s, cfg := pgStore(t, 4)
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: amqpidem.StoreKey("ledger", "pay-9"), TTL: time.Minute})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	if err := s.Fail(ctx, res.Lease, "permanent failure: account closed"); err != nil {
		t.Fatal(err)
	}

	cli := func(code int, args ...string) string {
		t.Helper()
		cmd := exec.Command(bin, append(args, "--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema)...)
		out, err := cmd.Output()
		got := 0
		if ee, ok := err.(*exec.ExitError); ok {
			got = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if got != code {
			t.Fatalf("amqpidem %s: exit %d, want %d\n%s", strings.Join(args, " "), got, code, out)
		}
		return string(out)
	}
	var rec struct {
		State, Error, Location string
		Fence                  int64
	}
	out := cli(0, "inspect", "pay-9", "--queue", "ledger", "--json")
	if err := json.Unmarshal([]byte(out), &rec); err != nil || rec.State != "failed" || rec.Fence != res.Lease.Fence ||
		rec.Error != "permanent failure: account closed" || !strings.Contains(rec.Location, cfg.Schema) {
		t.Fatalf("inspect: %v %+v\n%s", err, rec, out)
	}
	cli(0, "forget", "pay-9", "--queue", "ledger")
	cli(3, "inspect", "pay-9", "--queue", "ledger")
}

// The commands read a Redis Cluster's records too (--redis-addrs).
func TestInspectForgetCluster(t *testing.T) {
	cluster := testenv.RedisCluster(t)
	s, err := lock.NewRedisStore(cluster.Client(t), lock.Config{Prefix: "cli-cluster"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: amqpidem.StoreKey("orders", "order-3"), TTL: time.Minute})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	if err := s.Complete(ctx, res.Lease, []byte("done")); err != nil {
		t.Fatal(err)
	}
	flags := []string{"--redis-addrs", strings.Join(cluster.Addrs, ","), "--prefix", "cli-cluster"}
	run := func(args ...string) (string, int) {
		out, err := exec.Command(bin, append(args, flags...)...).CombinedOutput()
		if ee, ok := err.(*exec.ExitError); ok {
			return string(out), ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return string(out), 0
	}
	if out, code := run("inspect", "order-3", "--queue", "orders"); code != 0 || !strings.Contains(out, "completed") {
		t.Fatalf("inspect on the cluster: exit %d\n%s", code, out)
	}
	if out, code := run("forget", "order-3", "--queue", "orders"); code != 0 {
		t.Fatalf("forget on the cluster: exit %d\n%s", code, out)
	}
	if out, code := run("inspect", "order-3", "--queue", "orders"); code != 3 || !strings.Contains(out, "Redis Cluster at") {
		t.Fatalf("inspect after forget: exit %d\n%s", code, out)
	}
}

// Pointed at a table the consumers do not use, the command says which
// flags name theirs: it said "run pgstore.Migrate", which an operator
// must not do to find records that exist elsewhere (issue 42, item 5).
func TestPostgresWrongTableNamesTheFlags(t *testing.T) {
	_, cfg := pgStore(t, 4)
	cmd := exec.Command(bin, "inspect", "pay-9", "--queue", "ledger", "--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema,
		"--pg-table", "not_the_consumers")
	out, err := cmd.CombinedOutput()
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), "--pg-table") || !strings.Contains(string(out), `"not_the_consumers"`) {
		t.Fatalf("inspect against another table: %v\n%s", err, out)
	}
}
