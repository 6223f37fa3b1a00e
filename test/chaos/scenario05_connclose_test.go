//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 5, connections closed by the server: two consumers run in the
// test process (so that their goroutines can be counted) while their AMQP
// connections, and only theirs, are closed with rabbitmqctl
// close_connection again and again, with deliveries in flight. They must
// reconnect, lose nothing, never stall, keep a steady goroutine count, and
// after Shutdown leave no goroutine behind.
func TestChaos05ConnectionsClosed(t *testing.T) {
	e := newEnv(t, envOptions{})
	rounds, perRound := pick(4, 20), pick(100, 300)
	prefix := e.name + "-w"
	baseline := runtime.NumGoroutine()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var workers []*worker.Worker
	runErrs := make(chan error, 2)
	for i := range 2 {
		w, err := worker.New(ctx, worker.Config{
			Name: fmt.Sprintf("%s%d", prefix, i), AMQPURL: e.amqp, RedisAddr: e.redis.Addr, PGDSN: e.dsn,
			Schema: e.schema, Queue: e.queue, Prefix: e.name,
			EventsPath:      filepath.Join(e.dir, fmt.Sprintf("w%d.events", i)),
			LeaseTTL:        5 * time.Second,
			InProgressDelay: 200 * time.Millisecond,
			Concurrency:     8,
		})
		if err != nil {
			t.Fatal(err)
		}
		workers = append(workers, w)
		go func() { runErrs <- w.Run(ctx) }()
	}
	stopped := false
	shutdown := func() {
		if stopped {
			return
		}
		stopped = true
		for _, w := range workers {
			sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
			if err := w.Shutdown(sctx); err != nil {
				t.Errorf("shutdown: %v", err)
			}
			scancel()
		}
		for range workers {
			select {
			case err := <-runErrs:
				if !errors.Is(err, amqpidem.ErrConsumerClosed) {
					t.Errorf("Run returned %v, want ErrConsumerClosed", err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("Run did not return within 30s of Shutdown")
			}
		}
	}
	t.Cleanup(shutdown)

	var samples []int
	closed := 0
	for round := range rounds {
		ops := workload.Storm(fmt.Sprintf("%s-r%d-op", e.name, round), perRound, 3, 30, e.rng)
		e.publish(ops)
		time.Sleep(time.Duration(e.rng.IntN(300)) * time.Millisecond)
		n, err := closeConnections(prefix, "chaos: closed by the test")
		if err != nil {
			t.Fatal(err)
		}
		closed += n
		want := (round + 1) * perRound
		e.waitFor(fmt.Sprintf("round %d: %d operations applied", round, want), 3*time.Minute,
			func() bool { return e.applied() >= want }, func() string { return fmt.Sprintf("(applied %d)", e.applied()) })
		e.waitDrained(3*time.Minute, time.Second)
		samples = append(samples, runtime.NumGoroutine())
	}
	e.settle(rounds*perRound, 3*time.Minute, time.Second)
	shutdown()
	e.report("connclose", nil, false)
	t.Logf("connclose: %d connections closed by the server over %d rounds; goroutines after each round %v; baseline %d",
		closed, rounds, samples, baseline)
	if closed < rounds {
		t.Errorf("closed %d connections over %d rounds; want at least one per round", closed, rounds)
	}
	// Steady: no growth with the number of reconnections.
	if first, last := samples[0], slices.Max(samples[len(samples)/2:]); last > first+20 {
		t.Errorf("goroutines grew with reconnections: %v", samples)
	}
	// And back to the baseline once shut down.
	deadline := time.Now().Add(15 * time.Second)
	for runtime.NumGoroutine() > baseline+2 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > baseline+2 {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Errorf("goroutines after Shutdown: got %d, want at most the baseline %d + 2:\n%s", n, baseline, tail(string(buf), 16<<10))
	}
}
