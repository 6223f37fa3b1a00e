//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 18, a broker node that accepts connections and never answers
// (issue 35): the consumers reach RabbitMQ through a gate of the test's
// own on loopback, which either forwards a connection to the broker or
// accepts it and says nothing. While it hangs, consumers are shut down
// (with a deadline), started again, and shut down again while their dial
// hangs; in every other round the gate also cuts the connections it
// forwards, so that running consumers redial into the hang and their
// copies (a third of the operations fail once and are retried) wait for a
// publishing connection that does not come. Then the gate forwards again.
// Nothing may be lost or applied twice, and every Shutdown must return
// within its deadline (plus a second for the settling that follows it):
// shutdown_over_deadline=0. The consumers run in the test process (their
// Dial has a 5 s handshake timeout, as amqp.DefaultDial's) so that their
// Shutdown is timed and their goroutines counted.
func TestChaos18ConsumerDialHang(t *testing.T) {
	e := newEnv(t, envOptions{})
	rounds, perRound := pick(3, 8), pick(60, 200)
	const (
		slots          = 2
		deadline       = 2 * time.Second // each Shutdown's
		slack          = time.Second     // for what follows the deadline: cancelled handlers settle
		handshakeLimit = 5 * time.Second // the workers' dial timeout
	)
	amqpURL, err := url.Parse(e.amqp)
	if err != nil {
		t.Fatal(err)
	}
	gate := newDialGate(t, amqpURL.Host)
	amqpURL.Host = gate.addr()
	baseline := runtime.NumGoroutine()

	type running struct {
		w    *worker.Worker
		name string
		done chan error
	}
	var (
		starts    int
		shutdowns int
		over      int
		longest   time.Duration
	)
	start := func(slot int) *running {
		starts++
		name := fmt.Sprintf("%s-w%d-%d", e.name, slot, starts)
		w, err := worker.New(context.Background(), worker.Config{
			Name: name, AMQPURL: amqpURL.String(), RedisAddr: e.redis.Addr, PGDSN: e.dsn,
			Schema: e.schema, Queue: e.queue, Prefix: e.name,
			EventsPath:      filepath.Join(e.dir, name+".events"),
			LeaseTTL:        5 * time.Second,
			InProgressDelay: 200 * time.Millisecond,
			Backoff:         200 * time.Millisecond,
			MaxAttempts:     100, // shutdowns cost attempts; none may run out
			Concurrency:     8,
		})
		if err != nil {
			t.Fatal(err)
		}
		r := &running{w: w, name: name, done: make(chan error, 1)}
		go func() { r.done <- w.Run(context.Background()) }()
		return r
	}
	stop := func(r *running, why string) {
		shutdowns++
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		t0 := time.Now()
		if err := r.w.Shutdown(ctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: Shutdown: %v", r.name, err)
		}
		select {
		case err := <-r.done:
			if !errors.Is(err, amqpidem.ErrConsumerClosed) {
				t.Errorf("%s: Run returned %v, want ErrConsumerClosed", r.name, err)
			}
		case <-time.After(time.Minute):
			t.Fatalf("%s: Run did not return within a minute of Shutdown", r.name)
		}
		took := time.Since(t0)
		longest = max(longest, took)
		if took > deadline+slack {
			over++
			t.Errorf("%s: Shutdown (%s) took %v, deadline %v", r.name, why, took.Round(time.Millisecond), deadline)
		}
	}
	workers := make([]*running, slots)
	t.Cleanup(func() {
		for _, r := range workers {
			if r != nil {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				_ = r.w.Shutdown(ctx)
				cancel()
			}
		}
	})
	for i := range workers {
		workers[i] = start(i)
	}

	total := 0
	for round := range rounds {
		ops := workload.Storm(fmt.Sprintf("%s-r%d-op", e.name, round), perRound, 2, 30, e.rng)
		for i := range ops {
			if i%3 == 0 {
				ops[i].Plan.FailUntil = 2 // one retry: a copy to publish
			}
		}
		e.publish(ops)
		total += perRound
		time.Sleep(time.Duration(e.rng.IntN(300)) * time.Millisecond)

		cut := round%2 == 1
		gate.hang(cut)
		if cut {
			time.Sleep(300 * time.Millisecond) // the consumers redial, into the hang
		}
		// A consumer shut down while the node hangs, started again (its
		// dial hangs), and shut down again while it does.
		slot := round % slots
		stop(workers[slot], "node hanging")
		held := gate.hungCount()
		workers[slot] = start(slot)
		gate.waitHung(t, held+1)
		time.Sleep(time.Duration(200+e.rng.IntN(600)) * time.Millisecond)
		stop(workers[slot], "while its dial hangs")
		workers[slot] = start(slot)
		time.Sleep(time.Duration(200+e.rng.IntN(600)) * time.Millisecond)
		gate.forward()

		want := total
		e.waitFor(fmt.Sprintf("round %d: %d operations applied", round, want), 3*time.Minute,
			func() bool { return e.applied() >= want }, func() string { return fmt.Sprintf("(applied %d)", e.applied()) })
	}
	e.settle(total, 3*time.Minute, time.Second)
	for i, r := range workers {
		stop(r, "at the end")
		workers[i] = nil
	}
	// Dials of the workers' own Dial are not waited for by Shutdown; they
	// end by their handshake timeout.
	settled := time.Now().Add(handshakeLimit + 10*time.Second)
	for runtime.NumGoroutine() > baseline+2 && time.Now().Before(settled) {
		time.Sleep(100 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > baseline+2 {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Errorf("goroutines after the last Shutdown: got %d, want at most the baseline %d + 2:\n%s", n, baseline, tail(string(buf), 16<<10))
	}
	extra := fmt.Sprintf(" shutdowns=%d shutdown_over_deadline=%d shutdown_max_ms=%d deadline_ms=%d starts=%d hung_dials=%d cut_connections=%d",
		shutdowns, over, longest.Milliseconds(), deadline.Milliseconds(), starts, gate.hungCount(), gate.cutCount())
	e.reportWith("consumer-dial-hang", extra, nil, false)
	if over != 0 {
		t.Errorf("%d of %d Shutdowns returned later than their %v deadline and %v", over, shutdowns, deadline, slack)
	}
	if gate.hungCount() < int64(rounds) {
		t.Errorf("%d dials hung over %d rounds; want at least one a round", gate.hungCount(), rounds)
	}
}

// dialGate is a TCP gate on loopback in front of a broker: it forwards the
// connections it accepts, or, while hanging, accepts them and never
// answers, as a node that is overloaded or half dead does. Connections
// forwarded before keep going unless cut.
type dialGate struct {
	ln       net.Listener
	upstream string

	mu        sync.Mutex
	hanging   bool
	forwarded map[net.Conn]net.Conn // client side to broker side
	held      []net.Conn            // accepted while hanging
	hung      atomic.Int64
	cut       atomic.Int64
	wg        sync.WaitGroup
}

// newDialGate starts a gate to upstream, stopped in t.Cleanup.
func newDialGate(t *testing.T, upstream string) *dialGate {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &dialGate{ln: ln, upstream: upstream, forwarded: map[net.Conn]net.Conn{}}
	g.wg.Add(1)
	go g.accept()
	t.Cleanup(g.close)
	return g
}

func (g *dialGate) addr() string { return g.ln.Addr().String() }

func (g *dialGate) accept() {
	defer g.wg.Done()
	for {
		c, err := g.ln.Accept()
		if err != nil {
			return
		}
		g.mu.Lock()
		if g.hanging {
			g.held = append(g.held, c)
			g.hung.Add(1)
			g.mu.Unlock()
			continue
		}
		g.mu.Unlock()
		up, err := net.DialTimeout("tcp", g.upstream, 5*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		g.mu.Lock()
		g.forwarded[c] = up
		g.mu.Unlock()
		g.wg.Add(2)
		pipe := func(dst, src net.Conn) {
			defer g.wg.Done()
			_, _ = io.Copy(dst, src)
			_ = dst.Close()
			_ = src.Close()
			g.mu.Lock()
			delete(g.forwarded, c)
			g.mu.Unlock()
		}
		go pipe(up, c)
		go pipe(c, up)
	}
}

// hang makes the gate accept new connections and never answer them; with
// cut, the connections it forwards are closed too.
func (g *dialGate) hang(cut bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.hanging = true
	if !cut {
		return
	}
	for c, up := range g.forwarded {
		_ = c.Close()
		_ = up.Close()
		delete(g.forwarded, c)
		g.cut.Add(1)
	}
}

// forward makes the gate forward new connections again. Connections it
// held stay open and silent until their client gives up.
func (g *dialGate) forward() {
	g.mu.Lock()
	g.hanging = false
	g.mu.Unlock()
}

// waitHung waits until n connections have been held since the start.
func (g *dialGate) waitHung(t *testing.T, n int64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for g.hung.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("no dial reached the hanging gate within 30 s (%d held)", g.hung.Load())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (g *dialGate) hungCount() int64 { return g.hung.Load() }
func (g *dialGate) cutCount() int64  { return g.cut.Load() }

// close stops the gate: its listener and every connection, held or
// forwarded.
func (g *dialGate) close() {
	_ = g.ln.Close()
	g.mu.Lock()
	for c, up := range g.forwarded {
		_ = c.Close()
		_ = up.Close()
	}
	for _, c := range g.held {
		_ = c.Close()
	}
	g.mu.Unlock()
	g.wg.Wait()
}
