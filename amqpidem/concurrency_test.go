package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// leaseCounter is a store that counts the leases it granted, per key.
type leaseCounter struct {
	lock.Store
	mu     sync.Mutex
	leased map[string]int
}

func (s *leaseCounter) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	res, err := s.Store.Acquire(ctx, req)
	if err == nil && res.Status == lock.Acquired {
		s.mu.Lock()
		if s.leased == nil {
			s.leased = map[string]int{}
		}
		s.leased[req.Key]++
		s.mu.Unlock()
	}
	return res, err
}

func (s *leaseCounter) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.leased)
}

// gauge tracks how many handlers run at once, and the most ever.
type gauge struct {
	now, most, started atomic.Int64
}

func (g *gauge) enter() {
	g.started.Add(1)
	n := g.now.Add(1)
	for {
		m := g.most.Load()
		if n <= m || g.most.CompareAndSwap(m, n) {
			return
		}
	}
}

func (g *gauge) leave() { g.now.Add(-1) }

// blockUntil is a handler, counted by g, that returns when release is
// closed (or its context ends).
func (g *gauge) blockUntil(release <-chan struct{}) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		g.enter()
		defer g.leave()
		select {
		case <-release:
			return nil, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	})
}

func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// With Concurrency below Prefetch, no more than Concurrency deliveries hold
// a lease (and count an attempt) or run a handler at once.
func TestConsumerConcurrencyBoundsLeases(t *testing.T) {
	e := newEnv(t, nil)
	store := &leaseCounter{Store: e.store}
	var g gauge
	release := make(chan struct{})
	rec := &recorder{}
	cfg := amqpidem.ConsumerConfig{Prefetch: 6, Concurrency: 2, Config: amqpidem.Config{Observer: rec}}
	startConsumerWith(t, e, store, cfg, g.blockUntil(release))

	const n = 6
	for i := range n {
		e.publish(amqp.Publishing{MessageId: fmt.Sprintf("k%d", i), Body: []byte("x")})
	}
	eventually(t, 10*time.Second, "two handlers to start", func() bool { return g.started.Load() == 2 })
	time.Sleep(200 * time.Millisecond) // room for a third lease or handler if the bound were broken
	if got := g.started.Load(); got != 2 {
		t.Fatalf("%d handlers started with Concurrency 2 and all slots held", got)
	}
	if got := store.count(); got != 2 {
		t.Fatalf("%d leases taken with Concurrency 2 and all slots held, want 2", got)
	}
	close(release)
	rec.waitFor(t, 10*time.Second, "every message completed", func(evs []amqpidem.Event) bool {
		for i := range n {
			if count(evs, fmt.Sprintf("k%d", i), amqpidem.Completed) != 1 {
				return false
			}
		}
		return true
	})
	if most := g.most.Load(); most != 2 {
		t.Fatalf("at most %d handlers ran at once, want exactly Concurrency 2", most)
	}
	if got := g.started.Load(); got != n {
		t.Fatalf("%d handler runs for %d messages", got, n)
	}
}

// Prefetched deliveries still waiting for a slot go back to the queue at
// Shutdown without a lease or an attempt: only the message whose handler
// was cut off used one up.
func TestConsumerShutdownReturnsWaitingDeliveries(t *testing.T) {
	e := newEnv(t, nil)
	store := &leaseCounter{Store: e.store}
	var g gauge
	rec := &recorder{}
	cfg := amqpidem.ConsumerConfig{
		URL: e.url, Prefetch: 5, Concurrency: 1,
		Config: amqpidem.Config{Queue: e.queue, Observer: rec},
	}
	running := make(chan string, 5)
	c, err := amqpidem.NewConsumer(store, cfg, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		g.enter()
		defer g.leave()
		running <- d.MessageId
		<-ctx.Done() // only stops when told to
		return nil, ctx.Err()
	}))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()

	const n = 5
	for i := range n {
		e.publish(amqp.Publishing{MessageId: fmt.Sprintf("k%d", i), Body: []byte("x")})
	}
	var cut string
	select {
	case cut = <-running:
	case <-time.After(10 * time.Second):
		t.Fatal("no handler started")
	}
	time.Sleep(200 * time.Millisecond) // the other four arrive and wait
	if got := store.count(); got != 1 {
		t.Fatalf("%d leases taken with Concurrency 1, want 1", got)
	}

	if cut != "k0" {
		t.Fatalf("the handler started for %s, want k0: slots go in delivery order", cut)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := c.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown with a handler that outlives ctx: got %v, want DeadlineExceeded", err)
	}
	if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
		t.Fatalf("Run: %v", err)
	}
	if got := g.started.Load(); got != 1 {
		t.Fatalf("%d handlers started, want 1 (Concurrency 1)", got)
	}

	back := map[string]bool{}
	for len(back) < n {
		m, ok := e.get(e.queue, 5*time.Second)
		if !ok {
			t.Fatalf("only %d of %d messages are back in the queue: %v", len(back), n, back)
		}
		back[m.MessageId] = true
	}
	for i := range n {
		key := fmt.Sprintf("k%d", i)
		res, err := e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, key)})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("%s after shutdown: %v %v; want its lease given up", key, res.Status, err)
		}
		want := 1 // never ran: no attempt used
		if key == cut {
			want = 2 // ran and was cut off: that attempt counts
		}
		if res.Lease.Attempt != want {
			t.Errorf("%s: next attempt %d, want %d", key, res.Lease.Attempt, want)
		}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for i := range n {
		key := fmt.Sprintf("k%d", i)
		if got := count(rec.events, key, amqpidem.Abandoned); got != 1 {
			t.Errorf("%s: %d Abandoned events, want 1", key, got)
		}
	}
}

// With Concurrency 1 handlers run one after the other in queue order,
// although the leases of the prefetched deliveries are taken all at once
// and come back in any order.
func TestConsumerConcurrencyOneKeepsOrder(t *testing.T) {
	e := newEnv(t, nil)
	const n = 40
	var mu sync.Mutex
	var order []string
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Prefetch: n, Concurrency: 1,
		Config: amqpidem.Config{Observer: rec},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		mu.Lock()
		order = append(order, d.MessageId)
		mu.Unlock()
		return nil, nil
	}))
	for i := range n {
		e.publish(amqp.Publishing{MessageId: fmt.Sprintf("k%02d", i), Body: []byte("x")})
	}
	rec.waitFor(t, 20*time.Second, "every message completed", func(evs []amqpidem.Event) bool {
		return len(evs) >= n
	})
	mu.Lock()
	defer mu.Unlock()
	for i, id := range order {
		if want := fmt.Sprintf("k%02d", i); id != want {
			t.Fatalf("handler %d ran %s, want %s; order: %v", i, id, want, order)
		}
	}
	if len(order) != n {
		t.Fatalf("%d handler runs, want %d", len(order), n)
	}
}

// Messages without a key, run without idempotency by policy, take a slot
// like the others: Concurrency still bounds the handlers.
func TestConsumerConcurrencyBoundsUnkeyedHandlers(t *testing.T) {
	e := newEnv(t, nil)
	var g gauge
	release := make(chan struct{})
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Prefetch: 5, Concurrency: 1,
		Config: amqpidem.Config{Observer: rec, MissingKey: amqpidem.ProcessMissingKey},
	}, g.blockUntil(release))
	const n = 5
	for range n {
		e.publish(amqp.Publishing{Body: []byte("no key")})
	}
	eventually(t, 10*time.Second, "a handler to start", func() bool { return g.started.Load() == 1 })
	time.Sleep(200 * time.Millisecond)
	if got := g.started.Load(); got != 1 {
		t.Fatalf("%d unkeyed handlers started with Concurrency 1", got)
	}
	close(release)
	rec.waitFor(t, 10*time.Second, "every message completed", func(evs []amqpidem.Event) bool {
		done := 0
		for _, ev := range evs {
			if ev.Outcome == amqpidem.Completed {
				done++
			}
		}
		return done == n
	})
	if most := g.most.Load(); most != 1 {
		t.Fatalf("%d unkeyed handlers ran at once, want 1", most)
	}
}
