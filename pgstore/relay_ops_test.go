package pgstore_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

// TestRelayCleanupBesidePublishing: deleting many expired sent rows does
// not hold back the publish of a message written meanwhile.
func TestRelayCleanupBesidePublishing(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	const expired = 200_000
	if _, err := r.pool.Exec(ctx, `INSERT INTO `+table+` (message_id, message, state, created_at, sent_at)
		SELECT 'old-' || g, '\x00', 's', now() - interval '2 days', now() - interval '2 days'
		FROM generate_series(1, $1) g`, expired); err != nil {
		t.Fatal(err)
	}
	if _, err := r.pool.Exec(ctx, "ANALYZE "+table); err != nil {
		t.Fatal(err)
	}
	startRelay(t, r.ob, pgstore.RelayConfig{PollInterval: 20 * time.Millisecond, Retention: time.Hour,
		CleanupInterval: 50 * time.Millisecond}, nil)
	// Wait until the cleanup is under way, far from done.
	deadline := time.Now().Add(20 * time.Second)
	for n := r.count("s"); n == expired; n = r.count("s") {
		if time.Now().After(deadline) {
			t.Fatal("no expired row deleted after 20 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	start := time.Now()
	r.write(true, r.msg("new"))
	for {
		_, ok, err := r.ch.Get(r.queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			break
		}
		if time.Since(start) > 30*time.Second {
			t.Fatal("not published in 30 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	took := time.Since(start)
	left := r.count("s")
	t.Logf("published in %v; %d of %d expired rows left then", took, left, expired)
	if took > time.Second {
		t.Errorf("a message written during the cleanup took %v to arrive, want well under 1 s", took)
	}
}

// TestRelayMarkRetried: the relay's sessions end between the broker's
// confirms and the mark; the mark is tried again on a live connection,
// and no message is published twice (before, every one was published again
// once its claim ended).
func TestRelayMarkRetried(t *testing.T) {
	r := newOutboxRig(t)
	pool, app := appPool(t, 4)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Four sessions in the pool, all to be ended: a retry must not take
	// a dead one.
	var conns []*pgxpool.Conn
	for range 4 {
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	var want []string
	for i := range 10 {
		want = append(want, r.write(true, r.msg(fmt.Sprint(i)))...)
	}
	const claimTTL = 3 * time.Second
	var once sync.Once
	var ended atomic.Int64
	startRelay(t, ob, pgstore.RelayConfig{ClaimTTL: claimTTL, PublishTimeout: time.Second, Batch: 16, Concurrency: 16,
		PollInterval: 50 * time.Millisecond, RetryBackoff: 50 * time.Millisecond},
		func(rl *pgstore.Relay) {
			pgstore.SetBeforeMark(rl, func() {
				once.Do(func() {
					// Every session of the relay's pool (and its listening
					// one), waiting until they have exited.
					var n int64
					err := r.pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 5000))
						FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n)
					ended.Store(n)
					if err != nil {
						t.Errorf("terminate the relay's sessions: %v", err)
					}
				})
			})
		})
	r.waitCount("s", len(want), 10*time.Second)
	time.Sleep(claimTTL + time.Second) // copies would be published by now
	got := r.take(len(want), 10*time.Second)
	seen := map[string]int{}
	for _, d := range got {
		seen[d.MessageId]++
	}
	for _, id := range want {
		if seen[id] != 1 {
			t.Errorf("message %s arrived %d times, want once", id, seen[id])
		}
	}
	if ended.Load() == 0 {
		t.Error("no session of the relay was ended")
	}
	t.Logf("%d sessions ended before the mark; %d deliveries of %d messages", ended.Load(), len(got), len(want))
}

// TestRelaysOfOneName: two relays given one name on one table hold claims
// of their own (claimed_by differs), so that neither writes a refusal or a
// release over the other's claim, and both publish.
func TestRelaysOfOneName(t *testing.T) {
	r := newOutboxRig(t)
	hold := make(chan struct{})
	var marking sync.WaitGroup
	marking.Add(2)
	cfg := pgstore.RelayConfig{Name: "same", Batch: 1, Concurrency: 1, PollInterval: 50 * time.Millisecond}
	for range 2 {
		var once sync.Once
		startRelay(t, r.ob, cfg, func(rl *pgstore.Relay) {
			pgstore.SetBeforeMark(rl, func() {
				once.Do(func() { marking.Done(); <-hold })
			})
		})
	}
	r.write(true, r.msg("a"), r.msg("b"))
	done := make(chan struct{})
	go func() { marking.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		close(hold)
		t.Fatal("the two relays did not each claim and publish a row within 10s")
	}
	var names []string
	rows, err := r.pool.Query(context.Background(), "SELECT claimed_by FROM "+
		pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()+" WHERE state = 'p' ORDER BY claimed_by")
	if err == nil {
		names, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	close(hold)
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 2 || names[0] == names[1] || !strings.HasPrefix(names[0], "same#") || !strings.HasPrefix(names[1], "same#") {
		t.Fatalf("claims %q: want two claims of their own, both named same#...", names)
	}
	r.waitCount("s", 2, 10*time.Second)
}
