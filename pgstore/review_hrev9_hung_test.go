package pgstore_test

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// hrev9Gate holds back the bytes a proxy copies while it is paused: the
// server accepts connections and reads what it is sent, but nothing
// reaches the other side (a database that hangs, or a network that drops
// packets without resetting the connection).
type hrev9Gate struct {
	mu   sync.Mutex
	open chan struct{} // closed while the gate is open
}

func newHrev9Gate() *hrev9Gate {
	g := &hrev9Gate{open: make(chan struct{})}
	close(g.open)
	return g
}

func (g *hrev9Gate) pause() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
		g.open = make(chan struct{})
	default:
	}
}

func (g *hrev9Gate) resume() {
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-g.open:
	default:
		close(g.open)
	}
}

func (g *hrev9Gate) wait() {
	g.mu.Lock()
	ch := g.open
	g.mu.Unlock()
	<-ch
}

// copy copies from to to, each chunk only while the gate is open.
func (g *hrev9Gate) copy(from, to net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := from.Read(buf)
		if n > 0 {
			g.wait()
			if _, werr := to.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// hrev9GatedPool returns a pool of at most 4 connections to the test's
// PostgreSQL through a proxy held by the returned gate, closed in
// t.Cleanup (the gate opened first).
func hrev9GatedPool(t *testing.T) (*pgxpool.Pool, *hrev9Gate) {
	t.Helper()
	dsn := pgenv.DSN(t)
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	g := newHrev9Gate()
	px := testenv.StartProxy(t, u.Host, g.copy, g.copy)
	t.Cleanup(g.resume) // before the proxy waits for its copies
	cfg, err := pgxpool.ParseConfig(px.URL(t, dsn))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, g
}

// TestHrev9RelayClaimHungDatabase: the database accepts the relay's
// statements but does not answer (a proxy between them stops copying,
// both ways, with the connections open). The relay must not wait for it
// in silence: within a few ClaimTTLs it says, at warn level, that its
// claim got no answer. Once the database answers again, every row is
// published, once.
func TestHrev9RelayClaimHungDatabase(t *testing.T) {
	r := newOutboxRig(t)
	pool, g := hrev9GatedPool(t)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	var log testenv.SyncBuffer
	const claimTTL = 2 * time.Second
	startRelay(t, ob, pgstore.RelayConfig{ClaimTTL: claimTTL, PublishTimeout: 500 * time.Millisecond, Batch: 8, Concurrency: 8,
		PollInterval: 50 * time.Millisecond, RetryBackoff: 100 * time.Millisecond, MaxBackoff: 500 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	t.Cleanup(g.resume) // before the relay's shutdown
	t.Cleanup(func() { t.Logf("relay log:\n%s", log.String()) })
	var ids []string
	for i := range 3 {
		ids = append(ids, r.write(true, r.msg(fmt.Sprint("before-", i)))...)
	}
	r.waitCount("s", 3, 10*time.Second)

	g.pause()
	mark := len(log.String())
	for i := range 3 {
		ids = append(ids, r.write(true, r.msg(fmt.Sprint("during-", i)))...)
	}
	// The relay's next rounds go to the hung database.
	hung := 3 * claimTTL
	deadline := time.Now().Add(hung)
	for !hrev9ClaimWarned(log.String()[mark:]) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if !hrev9ClaimWarned(log.String()[mark:]) {
		t.Errorf("the database did not answer for %v: the relay logged nothing (it waits in its claim, for good while "+
			"the server's TCP stack is alive)", hung)
	}
	if n := r.count("s"); n != 3 {
		t.Errorf("%d rows sent while the relay's database hung, want 3", n)
	}
	g.resume()
	r.waitCount("s", 6, 20*time.Second)
	r.once(t, ids)
}

// TestHrev9RelayClaimBlockedByLock: another session holds a lock on the
// outbox table that the relay's claim waits for. The relay must say so
// (a warning within a few ClaimTTLs), and once the lock is released,
// publish every row once.
func TestHrev9RelayClaimBlockedByLock(t *testing.T) {
	r := newOutboxRig(t)
	var log testenv.SyncBuffer
	const claimTTL = 2 * time.Second
	startRelay(t, r.ob, pgstore.RelayConfig{ClaimTTL: claimTTL, PublishTimeout: 500 * time.Millisecond, Batch: 8, Concurrency: 8,
		PollInterval: 50 * time.Millisecond, RetryBackoff: 100 * time.Millisecond, MaxBackoff: 500 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	t.Cleanup(func() { t.Logf("relay log:\n%s", log.String()) })
	var ids []string
	ids = append(ids, r.write(true, r.msg("before"))...)
	r.waitCount("s", 1, 10*time.Second)
	time.Sleep(200 * time.Millisecond) // the relay idle, polling

	mark := len(log.String())
	release := r.lockTable("ACCESS EXCLUSIVE")
	// Rows written meanwhile wait for the lock too.
	var writers sync.WaitGroup
	during := make([]string, 3)
	for i := range during {
		writers.Add(1)
		go func() {
			defer writers.Done()
			during[i] = r.write(true, r.msg(fmt.Sprint("during-", i)))[0]
		}()
	}
	hung := 3 * claimTTL
	deadline := time.Now().Add(hung)
	for !hrev9ClaimWarned(log.String()[mark:]) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if !hrev9ClaimWarned(log.String()[mark:]) {
		t.Errorf("the relay's claim waited %v for a lock: the relay logged nothing of it", hung)
	}
	release()
	writers.Wait()
	ids = append(ids, during...)
	r.waitCount("s", 4, 20*time.Second)
	r.once(t, ids)
}

// hrev9ClaimWarned reports whether log holds a warning of the relay about
// its claim.
func hrev9ClaimWarned(log string) bool {
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "level=WARN") && strings.Contains(line, "claim") {
			return true
		}
	}
	return false
}

// TestHrev9RelayShutdownWhileDatabaseHangs: Shutdown, while the relay's
// database takes statements and answers none, returns once its ctx ends
// (with ctx's error), Run has returned, and no goroutine of the relay's own
// is left; the pool's own goroutines (pgxpool lets a ping it started for
// the relay finish, for up to a minute) are logged, not counted.
func TestHrev9RelayShutdownWhileDatabaseHangs(t *testing.T) {
	r := newOutboxRig(t)
	pool, g := hrev9GatedPool(t)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	before := hrev9Goroutines()
	rl, err := pgstore.NewRelay(ob, pgstore.RelayConfig{URL: testenv.AMQPURL(t), PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rl.Run(context.Background()) }()
	t.Cleanup(g.resume)
	r.write(true, r.msg("before"))
	r.waitCount("s", 1, 10*time.Second)
	g.pause()
	r.write(true, r.msg("during"))
	time.Sleep(500 * time.Millisecond) // the relay's claim waits
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	err = rl.Shutdown(ctx)
	took := time.Since(start)
	after := hrev9Goroutines()
	if err == nil || took > 3*time.Second {
		t.Errorf("Shutdown returned %v after %v, want ctx's error after about 1 s", err, took)
	}
	select {
	case <-done:
	default:
		t.Error("Run had not returned when Shutdown did")
	}
	var own, pools []string
	for _, s := range hrev9Settled(t, before, hrev9RelayGoroutines(before, after)) {
		if strings.Contains(s, "pgxpool.") && !strings.Contains(s, "amqpidem/pgstore.") {
			pools = append(pools, s)
			continue
		}
		own = append(own, s)
	}
	if len(own) > 0 {
		t.Errorf("%d goroutines of the relay left after Shutdown:\n%s", len(own), strings.Join(own, "\n\n"))
	}
	t.Logf("Shutdown took %v; %d goroutines of the pool left:\n%s", took, len(pools), strings.Join(pools, "\n\n"))
	g.resume()
	r.waitCount("p", 1, time.Second) // "during" waits for the next relay
}
