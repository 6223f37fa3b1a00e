package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// TestWrapBatchOwnLoop: a user's own delivery loop hands each delivery to
// a batch Wrapper from a goroutine of its own; the deliveries gather into
// batches of at most Size, each message runs once and is acked as
// completed (its record completed by CompleteBatch, its staged message
// published), duplicates are settled without reaching the handler, a
// poison message is split out and dead-lettered, and every goroutine
// ends with Shutdown.
func TestWrapBatchOwnLoop(t *testing.T) {
	e := newEnv(t, nil)
	next := e.queue + ".next"
	if _, err := e.ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(next, false, false, false) })
	baseline := runtime.NumGoroutine()
	var mu sync.Mutex
	runs := map[string]int{}
	var sizes []int
	const size = 8
	w, err := amqpidem.WrapBatch(e.conn, e.store, amqpidem.Config{Queue: e.queue, MaxAttempts: 1},
		amqpidem.BatchOptions{Size: size, Wait: 200 * time.Millisecond},
		amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			mu.Lock()
			defer mu.Unlock()
			sizes = append(sizes, len(ds))
			for _, d := range ds {
				if d.MessageId == "poison" {
					return nil, errors.New("poison")
				}
			}
			for _, d := range ds {
				runs[d.MessageId]++
				if err := amqpidem.Stage(amqpidem.DeliveryContext(ctx, d), "", next, amqp.Publishing{Body: []byte(d.MessageId)}); err != nil {
					return nil, err
				}
			}
			return nil, nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	const n = 24
	for i := range n {
		e.publish(amqp.Publishing{MessageId: fmt.Sprintf("w%02d", i), Body: []byte("x")})
		if i == 5 {
			e.publish(amqp.Publishing{MessageId: "poison", Body: []byte("x")})
		}
	}
	e.publish(amqp.Publishing{MessageId: "w03", Body: []byte("x")}) // a duplicate

	// The user's loop: a goroutine per delivery, bounded by the prefetch.
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Qos(2*size, 0, false); err != nil {
		t.Fatal(err)
	}
	msgs, err := ch.Consume(e.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var outMu sync.Mutex
	outcomes := map[string][]amqpidem.Outcome{}
	timeout := time.After(30 * time.Second)
	for got := 0; got < n+2; got++ {
		select {
		case d := <-msgs:
			wg.Add(1)
			go func() {
				defer wg.Done()
				ev := w.Handle(context.Background(), d)
				outMu.Lock()
				outcomes[d.MessageId] = append(outcomes[d.MessageId], ev.Outcome)
				outMu.Unlock()
			}()
		case <-timeout:
			t.Fatalf("%d deliveries in 30s, want %d", got, n+2)
		}
	}
	wg.Wait()
	if err := w.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := ch.Close(); err != nil {
		t.Fatal(err)
	}
	waitGoroutines(t, baseline) // no goroutine of the Wrapper's outlives its Shutdown
	mu.Lock()
	defer mu.Unlock()
	for i := range n {
		k := fmt.Sprintf("w%02d", i)
		want := "[completed]"
		if k == "w03" {
			want = "[completed duplicate]"
		}
		if got := fmt.Sprint(outcomes[k]); got != want && !(k == "w03" && got == "[duplicate completed]") {
			t.Errorf("%s: outcomes %s, want %s", k, got, want)
		}
		if runs[k] != 1 {
			t.Errorf("%s ran %d times, want 1", k, runs[k])
		}
		res, err := e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, k), TTL: time.Second})
		if err != nil || res.Status != lock.Completed {
			t.Errorf("%s: record %v, %v; want completed", k, res.Status, err)
		}
	}
	if got := fmt.Sprint(outcomes["poison"]); got != "[dead_lettered]" {
		t.Errorf("poison: outcomes %s, want [dead_lettered]", got)
	}
	most := 0
	for _, s := range sizes {
		most = max(most, s)
	}
	if most < 2 || most > size {
		t.Errorf("batch sizes %v: want batches of 2 to %d messages", sizes, size)
	}
	published := 0
	for {
		if _, ok := e.get(next, 200*time.Millisecond); !ok {
			break
		}
		published++
	}
	if published != n {
		t.Errorf("%d staged messages published, want %d", published, n)
	}
}

// TestWrapBatchLeaderContextEnds: the context of one Handle call of a
// batch ends while the batch runs (a per-message timeout of the user's
// loop). Its message is taken out and the batch runs again without it,
// under a context that is not the ended one: the other message completes
// rather than failing for a cancellation that was not its own.
func TestWrapBatchLeaderContextEnds(t *testing.T) {
	e := newEnv(t, nil)
	w, err := amqpidem.WrapBatch(e.conn, e.store, amqpidem.Config{Queue: e.queue, MaxAttempts: 5},
		amqpidem.BatchOptions{Size: 2, Wait: time.Second},
		amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			if len(ds) == 2 {
				<-ctx.Done() // the first message's Handle call ends meanwhile
				return nil, ctx.Err()
			}
			return nil, ctx.Err()
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Shutdown(context.Background()) })
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	msgs, err := ch.Consume(e.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for round := range 6 {
		first, second := fmt.Sprintf("a%d", round), fmt.Sprintf("b%d", round)
		e.publish(amqp.Publishing{MessageId: first, Body: []byte("x")})
		e.publish(amqp.Publishing{MessageId: second, Body: []byte("x")})
		d1, d2 := <-msgs, <-msgs
		ctx1, cancel1 := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		var ev2 amqpidem.Event
		wg.Add(2)
		go func() { defer wg.Done(); w.Handle(ctx1, d1) }()
		time.Sleep(20 * time.Millisecond) // d1 joins first: the batch's leader
		go func() { defer wg.Done(); ev2 = w.Handle(context.Background(), d2) }()
		time.Sleep(300 * time.Millisecond)
		cancel1()
		wg.Wait()
		if ev2.Outcome != amqpidem.Completed {
			t.Fatalf("round %d: %s: %v %q (%v), want completed: the batch ran again under the ended context of %s",
				round, second, ev2.Outcome, ev2.Reason, ev2.Err, first)
		}
	}
}
