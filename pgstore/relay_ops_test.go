package pgstore_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// appPool returns a pool of at most maxConns connections whose sessions
// carry an application_name of their own (returned), for a test to find
// and end them; closed in t.Cleanup.
func appPool(t *testing.T, maxConns int32) (*pgxpool.Pool, string) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pgenv.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	app := testenv.Name(t)
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, app
}

// logTo returns a logger writing text lines into buf.
func logTo(buf *testenv.SyncBuffer) *slog.Logger {
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// startRelay makes a Relay on ob with cfg (URL set), calls prepare (if
// not nil) before running it, and shuts it down in t.Cleanup unless the
// test did. It returns the relay and a function that shuts it down and
// checks Run's and Shutdown's errors.
func startRelay(t *testing.T, ob *pgstore.Outbox, cfg pgstore.RelayConfig, prepare func(*pgstore.Relay)) (*pgstore.Relay, func()) {
	t.Helper()
	cfg.URL = testenv.AMQPURL(t)
	rl, err := pgstore.NewRelay(ob, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if prepare != nil {
		prepare(rl)
	}
	done := make(chan error, 1)
	go func() { done <- rl.Run(context.Background()) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := rl.Shutdown(ctx); err != nil {
				t.Errorf("Shutdown: %v", err)
			}
			if err := <-done; err != nil {
				t.Errorf("Run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return rl, stop
}

// waitLog waits until buf holds want, failing after timeout.
func waitLog(t *testing.T, buf *testenv.SyncBuffer, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !strings.Contains(buf.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("after %v, the log has no %q:\n%s", timeout, want, buf.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRelayPoolOfOneConnection: a relay whose pool has one connection
// publishes, and is woken by the commit's notification (it listens on a
// connection of its own, outside the pool).
func TestRelayPoolOfOneConnection(t *testing.T) {
	r := newOutboxRig(t)
	pool, _ := appPool(t, 1)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	var log testenv.SyncBuffer
	r.write(true, r.msg("before"))
	startRelay(t, ob, pgstore.RelayConfig{PollInterval: time.Hour, Logger: logTo(&log)}, nil)
	t.Cleanup(func() { t.Logf("relay log:\n%s", log.String()) })
	if got := r.take(1, 10*time.Second); string(got[0].Body) != "before" {
		t.Fatalf("got %q", got[0].Body)
	}
	r.write(true, r.msg("woken"))
	if got := r.take(1, 10*time.Second); string(got[0].Body) != "woken" {
		t.Fatalf("got %q", got[0].Body)
	}
	if s := log.String(); strings.Contains(s, "level=WARN") || strings.Contains(s, "level=ERROR") {
		t.Errorf("the relay warned:\n%s", s)
	}
}

// TestRelayPoolBusyIsLogged: while every connection of the relay's pool is
// held elsewhere, the claim gives up waiting for one, says so in the log,
// and the relay publishes once a connection is free again.
func TestRelayPoolBusyIsLogged(t *testing.T) {
	r := newOutboxRig(t)
	pgstore.SetPoolWait(t, 300*time.Millisecond)
	pool, _ := appPool(t, 1)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	held, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var release sync.Once
	t.Cleanup(func() { release.Do(held.Release) }) // before the pool closes
	r.write(true, r.msg("waits"))
	var log testenv.SyncBuffer
	startRelay(t, ob, pgstore.RelayConfig{PollInterval: 50 * time.Millisecond, RetryBackoff: 50 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	waitLog(t, &log, "no connection of the pool free", 5*time.Second)
	release.Do(held.Release)
	if got := r.take(1, 10*time.Second); string(got[0].Body) != "waits" {
		t.Fatalf("got %q", got[0].Body)
	}
}
