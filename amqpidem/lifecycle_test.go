package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

func TestConsumerShutdownInFlight(t *testing.T) {
	e := newEnv(t, nil)
	baseline := runtime.NumGoroutine()
	started := make(chan struct{}, 1)
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		started <- struct{}{}
		<-ctx.Done() // a job that only stops when told to
		return nil, ctx.Err()
	})
	logs := &lockedBuffer{}
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: e.url, Config: amqpidem.Config{
		Queue: e.queue, Logger: slog.New(slog.NewTextHandler(logs, nil)),
	}}, h)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	e.publish(amqp.Publishing{MessageId: "long", Body: []byte("x")})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler never started")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := c.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown with a handler that outlives ctx: got %v, want DeadlineExceeded", err)
	}
	if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
		t.Fatalf("Run: %v", err)
	}
	if err := c.Shutdown(context.Background()); err != nil {
		t.Fatalf("second Shutdown: %v", err)
	}
	// Shutdown says when it starts, with how many handlers run, and how
	// it ended, once (issue 42, item 5: it logged nothing).
	got := logs.String()
	for _, want := range []string{
		`level=INFO msg="amqpidem: shutting down" queue=` + e.queue + ` in_flight=1`,
		`level=INFO msg="amqpidem: shut down" queue=` + e.queue + ` ended="deadline passed, handlers cancelled"`,
	} {
		if n := strings.Count(got, want); n != 1 {
			t.Errorf("log has %d of %q, want 1:\n%s", n, want, got)
		}
	}

	// The message went back to the queue, and its lease was released.
	m, ok := e.get(e.queue, 5*time.Second)
	if !ok || m.MessageId != "long" {
		t.Fatal("the unfinished message is not back in the queue")
	}
	res, err := e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, "long")})
	if err != nil || res.Status != lock.Acquired || res.Lease.Attempt != 2 {
		t.Fatalf("lease after shutdown: %v attempt %d %v; want released", res.Status, res.Lease.Attempt, err)
	}
	waitGoroutines(t, baseline)
}

// waitGoroutines fails unless the goroutine count comes back to baseline
// (a little slack for the runtime and connections closing).
func waitGoroutines(t *testing.T, baseline int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > baseline+2 {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("goroutines: %d, baseline %d\n%s", runtime.NumGoroutine(), baseline, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestConsumerReconnects(t *testing.T) {
	e := newEnv(t, nil)
	var mu sync.Mutex
	var conns []*amqp.Connection
	var ran runs
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Dial: func() (*amqp.Connection, error) {
			c, err := amqp.Dial(e.url)
			if err == nil {
				mu.Lock()
				conns = append(conns, c)
				mu.Unlock()
			}
			return c, err
		},
		Config: amqpidem.Config{Observer: rec},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		ran.add(d.MessageId)
		return nil, nil
	}))
	for round := range 3 {
		id := fmt.Sprint("m", round)
		e.publish(amqp.Publishing{MessageId: id, Body: []byte("x")})
		rec.waitFor(t, 15*time.Second, id+" completed", func(evs []amqpidem.Event) bool { return count(evs, id, amqpidem.Completed) == 1 })
		mu.Lock()
		last := conns[len(conns)-1]
		mu.Unlock()
		last.Close() // the connection dies under the consumer
	}
	mu.Lock()
	n := len(conns)
	mu.Unlock()
	if n < 3 {
		t.Fatalf("connections: %d, want a new one after each close", n)
	}
	for round := range 3 {
		if got := ran.get(fmt.Sprint("m", round)); got != 1 {
			t.Errorf("m%d ran %d times", round, got)
		}
	}
}
