package amqpidem_test

import (
	"context"
	"os"
	"runtime/metrics"
	"runtime/trace"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// TestConsumerSchedsPerMessage measures, when AMQPIDEM_SCHEDS is set, how
// often the process's goroutines were scheduled (runtime/metrics
// /sched/latencies:seconds, which samples one in 8 of each goroutine's
// schedulings; with AMQPIDEM_SCHEDS_TRACE=file, an execution trace of the
// consuming to count them all) and how many heap objects it allocated per
// message, for a Consumer on lock.MemoryStore whose handlers are all busy
// (Concurrency 4, Prefetch 128, a handler busy for 100µs): the hand-offs between
// the session, the gate and the workers, without Redis in the way. It
// checks nothing; it logs the figures, to compare two versions of the code
// (issue 40).
func TestConsumerSchedsPerMessage(t *testing.T) {
	if os.Getenv("AMQPIDEM_SCHEDS") == "" {
		t.Skip("a measurement: set AMQPIDEM_SCHEDS=1")
	}
	const n = 3000
	e := newEnv(t, nil)
	for i := range n {
		e.publish(amqp.Publishing{MessageId: "m" + strconv.Itoa(i), Body: []byte("x")})
	}
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var settled atomic.Int64
	done := make(chan struct{})
	obs := amqpidem.ObserverFunc(func(_ context.Context, ev amqpidem.Event) {
		if settled.Add(1) == n {
			close(done)
		}
	})
	read := func() (scheds, allocs uint64) {
		s := []metrics.Sample{{Name: "/sched/latencies:seconds"}, {Name: "/gc/heap/allocs:objects"}}
		metrics.Read(s)
		for _, c := range s[0].Value.Float64Histogram().Counts {
			scheds += c
		}
		return scheds, s[1].Value.Uint64()
	}
	if path := os.Getenv("AMQPIDEM_SCHEDS_TRACE"); path != "" {
		// The consuming, traced: go tool trace -d=parsed counts each
		// goroutine's transitions exactly.
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := trace.Start(f); err != nil {
			t.Fatal(err)
		}
		defer trace.Stop()
	}
	s0, a0 := read()
	startConsumerWith(t, e, store, amqpidem.ConsumerConfig{Config: amqpidem.Config{Observer: obs}, Prefetch: 128, Concurrency: 4},
		amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) {
			for t0 := time.Now(); time.Since(t0) < 100*time.Microsecond; {
			} // busy, without a park of its own
			return nil, nil
		}))
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatalf("%d of %d settled", settled.Load(), n)
	}
	s1, a1 := read()
	trace.Stop()
	t.Logf("scheds/msg %.2f allocs/msg %.1f", float64(s1-s0)/n, float64(a1-a0)/n)
}
