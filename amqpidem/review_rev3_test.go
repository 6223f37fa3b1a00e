package amqpidem_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// panicCompleteBatch is the Redis store with a CompleteBatch that panics
// (a store's bug), its other calls the store's own.
type panicCompleteBatch struct {
	*lock.RedisStore
	panics atomic.Int32
}

func (s *panicCompleteBatch) CompleteBatch(ctx context.Context, leases []lock.Lease, results [][]byte) []error {
	s.panics.Add(1)
	panic("CompleteBatch bug")
}

// TestWrapBatchCompleteBatchPanic: a store whose CompleteBatch panics
// must not leave the batch's other Handle calls waiting for ever (the
// leader's gr.done never closed) with their leases kept alive: the panic
// is the store's failure to answer, and each message is completed alone
// (Complete), acked as completed, its handler run once.
func TestWrapBatchCompleteBatchPanic(t *testing.T) {
	e := newEnv(t, nil)
	store := &panicCompleteBatch{RedisStore: e.store}
	var mu sync.Mutex
	runs := map[string]int{}
	const size = 3
	w, err := amqpidem.WrapBatch(e.conn, store, amqpidem.Config{Queue: e.queue, MaxAttempts: 1},
		amqpidem.BatchOptions{Size: size, Wait: 2 * time.Second},
		amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			mu.Lock()
			defer mu.Unlock()
			for _, d := range ds {
				runs[d.MessageId]++
			}
			return nil, nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- w.Shutdown(ctx) }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Shutdown: %v", err)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("Shutdown still waiting 15s on, its ctx done for 10s")
		}
	}()
	for i := range size {
		e.publish(amqp.Publishing{MessageId: fmt.Sprintf("p%d", i), Body: []byte("x")})
	}
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Qos(size, 0, false); err != nil {
		t.Fatal(err)
	}
	msgs, err := ch.Consume(e.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	type answer struct {
		id       string
		ev       amqpidem.Event
		panicked any
	}
	answers := make(chan answer, size)
	for range size {
		select {
		case d := <-msgs:
			go func() {
				a := answer{id: d.MessageId}
				// The user's loop recovers a panic of Handle, as a
				// supervisor would.
				defer func() {
					a.panicked = recover()
					answers <- a
				}()
				a.ev = w.Handle(context.Background(), d)
			}()
		case <-time.After(10 * time.Second):
			t.Fatal("no delivery in 10s")
		}
	}
	for range size {
		select {
		case a := <-answers:
			if a.panicked != nil {
				t.Errorf("%s: Handle panicked: %v", a.id, a.panicked)
				continue
			}
			if a.ev.Outcome != amqpidem.Completed {
				t.Errorf("%s: outcome %s (%v), want completed", a.id, a.ev.Outcome, a.ev.Err)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("Handle calls still waiting 15s after CompleteBatch panicked (%d panics)", store.panics.Load())
			return
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range size {
		if k := fmt.Sprintf("p%d", i); runs[k] != 1 {
			t.Errorf("%s ran %d times, want 1", k, runs[k])
		}
	}
}
