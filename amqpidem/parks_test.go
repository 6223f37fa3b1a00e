package amqpidem_test

import (
	"context"
	"os"
	"runtime/trace"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// TestTraceConsumers is a measuring tool, not a check: with
// AMQPIDEM_PARKS_TRACE set to a file name F, it writes to F-amqpidem a runtime/trace of a
// Consumer (RedisStore, no-op handler, every key new) consuming
// AMQPIDEM_PARKS_N messages (default 4000) of a quorum queue with make
// bench's prefetch 128 and concurrency 32, then of a bare amqp091 loop (32
// workers, an ack each) consuming as many to F-bare. `go tool trace
// -pprof=sync F-amqpidem` (and -pprof=net, -d=parsed)
// then counts the goroutine blocks per message, by stack: exact figures,
// unlike CPU time. Skipped otherwise.
func TestTraceConsumers(t *testing.T) {
	out := os.Getenv("AMQPIDEM_PARKS_TRACE")
	if out == "" {
		t.Skip("AMQPIDEM_PARKS_TRACE not set")
	}
	n := 4000
	if s := os.Getenv("AMQPIDEM_PARKS_N"); s != "" {
		n, _ = strconv.Atoi(s)
	}
	e := newEnv(t, amqp.Table{"x-queue-type": "quorum"})
	fill := func() {
		for i := range n {
			e.publish(amqp.Publishing{MessageId: e.queue + "-" + strconv.Itoa(i) + "-" + strconv.FormatInt(time.Now().UnixNano(), 36), Body: make([]byte, 128)})
		}
	}
	start := func(name string) func() {
		f, err := os.Create(out + "-" + name)
		if err != nil {
			t.Fatal(err)
		}
		if err := trace.Start(f); err != nil {
			t.Fatal(err)
		}
		return func() {
			trace.Stop()
			_ = f.Close()
		}
	}

	fill()
	var done atomic.Int64
	all := make(chan struct{})
	stop := start("amqpidem")
	region := trace.StartRegion(context.Background(), "amqpidem")
	c := startConsumer(t, e, amqpidem.ConsumerConfig{
		Config: amqpidem.Config{Observer: amqpidem.ObserverFunc(func(_ context.Context, ev amqpidem.Event) {
			if ev.Outcome == amqpidem.Completed && done.Add(1) == int64(n) {
				close(all)
			}
		})},
		Prefetch: 128, Concurrency: 32, QueueArgs: amqp.Table{"x-queue-type": "quorum"},
	}, amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }))
	select {
	case <-all:
	case <-time.After(2 * time.Minute):
		t.Fatalf("%d of %d completed", done.Load(), n)
	}
	region.End()
	if err := c.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}

	stop()
	fill()
	stop = start("bare")
	defer stop()
	region = trace.StartRegion(context.Background(), "bare")
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Qos(128, 0, false); err != nil {
		t.Fatal(err)
	}
	ds, err := ch.Consume(e.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var acked atomic.Int64
	bareDone := make(chan struct{})
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for d := range ds {
				_ = d.Ack(false)
				if acked.Add(1) == int64(n) {
					close(bareDone)
				}
			}
		}()
	}
	select {
	case <-bareDone:
	case <-time.After(2 * time.Minute):
		t.Fatalf("bare: %d of %d acked", acked.Load(), n)
	}
	region.End()
	_ = ch.Close()
	wg.Wait()
}
