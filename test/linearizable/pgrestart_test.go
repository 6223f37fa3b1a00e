//go:build linux

package linearizable_test

import (
	"context"
	"math/rand/v2"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// TestPostgresRestart runs pgstore (record-row leases) on a PostgreSQL of
// the test's own, which it stops in immediate mode (SIGQUIT to the
// postmaster, as pg_ctl -m immediate: no checkpoint, every backend gone,
// recovery from the WAL at the next start) and starts again, a few times
// during the run. Committed transactions must survive; the calls cut off
// are ambiguous.
func TestPostgresRestart(t *testing.T) {
	srv := pgenv.StartServer(t)
	cfg, err := pgxpool.ParseConfig(srv.DSN)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	cfg.ConnConfig.ConnectTimeout = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	pcfg := pgstore.Config{CleanupInterval: -1}
	pcfg.Prefix = testenv.Name(t)
	if err := pgstore.Migrate(ctx, pool, pcfg); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	s, err := pgstore.New(pool, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	w := size(
		linearizable.Workload{Clients: 4, Keys: 8, Ops: 3000, Duration: 8 * time.Second, TTL: 50 * time.Millisecond, Timeout: 300 * time.Millisecond, Seed: seed()},
		linearizable.Workload{Clients: 8, Keys: 16, Ops: 20000, Duration: 60 * time.Second, TTL: 50 * time.Millisecond, Timeout: 300 * time.Millisecond, Seed: seed()},
	)
	p := localClock
	p.Busy = true // as TestPostgres
	run := linearizable.Start(s, w)
	n := faults(run, 10, 2*time.Second, func() {
		srv.Restart(syscall.SIGQUIT, time.Duration(100+rand.IntN(400))*time.Millisecond)
	})
	res := check(t, "pgstore-restart", p, w, run.History())
	t.Logf("pgstore-restart: %d restarts, %d ambiguous operations", n, res.Ambiguous)
	if n == 0 {
		t.Fatal("pgstore-restart: the run ended before a restart")
	}
	wantOK(t, res)
}
