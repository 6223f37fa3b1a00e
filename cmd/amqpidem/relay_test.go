package main_test

import (
	"context"
	"encoding/json"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// A pgstore.Relay is what promamqpidem's RelayCollector reads. (Asserted
// here: a test of pgstore importing promamqpidem would put Prometheus in
// the go.sum of every module importing pgstore.)
var _ promamqpidem.RelaySource = (*pgstore.Relay)(nil)

// outboxSchema migrates pgstore's tables into a schema of the test's own
// (dropped in t.Cleanup) and returns its Config and Outbox.
func outboxSchema(t *testing.T, pool *pgxpool.Pool) (pgstore.Config, *pgstore.Outbox) {
	t.Helper()
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(t)), CleanupInterval: -1}
	if err := pgstore.Migrate(context.Background(), pool, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	ob, err := pgstore.NewOutbox(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cfg, ob
}

// relay runs a relay until SIGTERM, which it survives with exit code 0;
// relay list, status and redrive show and re-drive what the broker refused.
func TestRelayCommand(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	ctx := context.Background()
	cfg, ob := outboxSchema(t, pool)
	queue := testenv.Name(t)
	conn, err := amqp.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { testenv.DeleteQueues(t, testenv.AMQPURL(t), queue, queue+"-later") })
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{queue, queue + "-later"} {
		if _, err := ob.Write(ctx, tx, pgstore.Message{RoutingKey: key, Publishing: amqp.Publishing{Body: []byte(key)}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	flags := []string{"--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema, "--amqp", testenv.AMQPURL(t)}
	cli := func(code int, args ...string) string {
		t.Helper()
		out, err := exec.Command(bin, append(args, flags...)...).Output()
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
	// runRelay runs the relay until the outbox has no pending row, then
	// stops it with SIGTERM.
	runRelay := func() {
		t.Helper()
		var stderr strings.Builder
		cmd := exec.Command(bin, append([]string{"relay", "--max-attempts", "1"}, flags...)...)
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = cmd.Process.Kill() }()
		deadline := time.Now().Add(20 * time.Second)
		for {
			n, _, err := ob.Backlog(ctx)
			if err == nil && n == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("rows still pending after 20 s; relay's stderr:\n%s", stderr.String())
			}
			time.Sleep(50 * time.Millisecond)
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		if err := cmd.Wait(); err != nil {
			t.Fatalf("relay after SIGTERM: %v\n%s", err, stderr.String())
		}
		if !strings.Contains(stderr.String(), "stopped") {
			t.Errorf("relay's stderr does not say it stopped:\n%s", stderr.String())
		}
	}
	runRelay()
	if d, ok, err := ch.Get(queue, true); err != nil || !ok || string(d.Body) != queue {
		t.Fatalf("the routable message: %q %v %v", d.Body, ok, err)
	}

	var rows []struct {
		ID         int64
		State      string
		RoutingKey string `json:"routing_key"`
		Attempts   int
		LastError  string `json:"last_error"`
	}
	if err := json.Unmarshal([]byte(cli(0, "relay", "list", "--state", "dead", "--json")), &rows); err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1 || rows[0].RoutingKey != queue+"-later" || rows[0].Attempts != 1 || !strings.Contains(rows[0].LastError, "NO_ROUTE") {
		t.Fatalf("dead rows %+v: want the unroutable one, refused once", rows)
	}
	if out := cli(0, "relay", "status"); !strings.Contains(out, "pending: 0") || !strings.Contains(out, "dead: 1") {
		t.Fatalf("status:\n%s", out)
	}
	if out := cli(0, "relay", "list", "--state", "dead"); !strings.Contains(out, "NO_ROUTE") || !strings.Contains(out, "-later") {
		t.Fatalf("list:\n%s", out)
	}
	cli(2, "relay", "list", "--state", "stuck")
	if out, err := exec.Command(bin, "relay", "redrive", "--all").CombinedOutput(); err == nil ||
		err.(*exec.ExitError).ExitCode() != 2 || !strings.Contains(string(out), "--postgres") {
		t.Fatalf("relay redrive without --postgres: %v\n%s", err, out)
	}
	cli(2, "relay", "redrive")
	cli(2, "relay", "redrive", "x1")
	if _, err := ch.QueueDeclare(queue+"-later", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	// The binary's stdin is /dev/null, not a terminal: --all needs --yes.
	if out, err := exec.Command(bin, append([]string{"relay", "redrive", "--all"}, flags...)...).CombinedOutput(); err == nil ||
		err.(*exec.ExitError).ExitCode() != 2 || !strings.Contains(string(out), "add --yes") {
		t.Fatalf("relay redrive --all without --yes: %v\n%s", err, out)
	}
	if out := cli(0, "relay", "status"); !strings.Contains(out, "dead: 1") {
		t.Fatalf("status after a redrive without --yes:\n%s", out)
	}
	if out := cli(0, "relay", "redrive", "--all", "--yes"); !strings.Contains(out, "1 dead row pending again") {
		t.Fatalf("redrive:\n%s", out)
	}
	cli(3, "relay", "redrive", "--all")
	runRelay()
	if d, ok, err := ch.Get(queue+"-later", true); err != nil || !ok || string(d.Body) != queue+"-later" {
		t.Fatalf("the re-driven message: %q %v %v", d.Body, ok, err)
	}
	if out := cli(0, "relay", "status"); !strings.Contains(out, "dead: 0") {
		t.Fatalf("status after the re-drive:\n%s", out)
	}
}
