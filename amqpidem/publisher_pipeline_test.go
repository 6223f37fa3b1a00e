package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// publishAll publishes n messages at once on pub, message i with
// MessageId "m-i" to exchange/key of route(i), and returns each one's error.
func publishAll(t *testing.T, pub *amqpidem.Publisher, n int, route func(i int) (string, string)) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			ex, key := route(i)
			errs[i] = pub.Publish(ctx, ex, key, amqp.Publishing{MessageId: fmt.Sprintf("m-%d", i), Body: []byte("x")})
		}()
	}
	close(start)
	wg.Wait()
	return errs
}

// drainIDs reads queue q until it stays empty for a second, and returns
// how many times each MessageId came.
func drainIDs(e *env, q string) map[string]int {
	got := map[string]int{}
	for {
		m, ok := e.get(q, time.Second)
		if !ok {
			return got
		}
		got[m.MessageId]++
	}
}

// TestPublisherReturnsAmongMany publishes 300 messages at once on one
// Publisher, every third to a routing key no queue is bound to: many
// publishes await their confirm on each channel, and each returned
// message must fail its own Publish with ErrUnroutable, every other
// succeed. A return matched by position (the first publish confirmed
// after it takes it) fails routed messages and passes returned ones.
func TestPublisherReturnsAmongMany(t *testing.T) {
	e := newEnv(t, nil)
	pub := amqpidem.NewPublisher(e.conn)
	defer pub.Close()
	const n = 300
	errs := publishAll(t, pub, n, func(i int) (string, string) {
		if i%3 == 0 {
			return "", e.queue + ".unbound"
		}
		return "", e.queue
	})
	for i, err := range errs {
		if want := i%3 == 0; errors.Is(err, amqpidem.ErrUnroutable) != want || (!want && err != nil) {
			t.Errorf("m-%d (unroutable %v): %v", i, want, err)
		}
	}
	got := drainIDs(e, e.queue)
	for i := range n {
		if i%3 != 0 && got[fmt.Sprintf("m-%d", i)] != 1 {
			t.Errorf("m-%d came %d times, want 1", i, got[fmt.Sprintf("m-%d", i)])
		}
	}
}

// TestPublisherChannelClosedAmongMany publishes 300 messages at once on
// one Publisher, a few of them to an exchange that does not exist: the
// broker closes the channel over each of those (404 NOT_FOUND), failing
// every publish in flight on it. Only those few may be refused
// (IsRefused); every other message is confirmed, and its queue has it
// (twice when the broker took it before closing the channel, and it was
// published again).
func TestPublisherChannelClosedAmongMany(t *testing.T) {
	e := newEnv(t, nil)
	pub := amqpidem.NewPublisher(e.conn)
	defer pub.Close()
	const n = 300
	bad := func(i int) bool { return i%50 == 25 }
	errs := publishAll(t, pub, n, func(i int) (string, string) {
		if bad(i) {
			return e.queue + ".no-such-exchange", "rk"
		}
		return "", e.queue
	})
	for i, err := range errs {
		switch {
		case bad(i) && !amqpidem.IsRefused(err):
			t.Errorf("m-%d, to a missing exchange: %v, want a refusal", i, err)
		case !bad(i) && err != nil:
			t.Errorf("m-%d: %v", i, err)
		}
	}
	got := drainIDs(e, e.queue)
	for i := range n {
		if id := fmt.Sprintf("m-%d", i); !bad(i) && got[id] == 0 {
			t.Errorf("%s confirmed, not in the queue", id)
		}
	}
}

// TestOutboxRefusalsAmongMany runs a Consumer with 64 handlers staging
// one message each, concurrently: most to a queue, a few to a routing key
// no queue is bound to (returned) and a few to an exchange that does not
// exist (the channel closed). With MaxAttempts 1, a refusal counted for
// the wrong message gives an innocent one up: each of the many must be
// published with no try counted, each of the few given up after its one.
func TestOutboxRefusalsAmongMany(t *testing.T) {
	e := newEnv(t, nil)
	next := e.queue + ".next"
	if _, err := e.ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(next, false, false, false) })
	const ops = 400
	kind := func(i int) string {
		switch i % 40 {
		case 7:
			return "unroutable"
		case 27:
			return "no exchange"
		}
		return "ok"
	}
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		ex, key := "", next
		switch d.Type {
		case "unroutable":
			key = e.queue + ".unbound"
		case "no exchange":
			ex = e.queue + ".no-such-exchange"
		}
		return nil, amqpidem.Stage(ctx, ex, key, amqp.Publishing{Body: d.Body})
	})
	rec := &recorder{}
	// Published before the consumer starts, so that its first prefetch is
	// full and its handlers stage together.
	for i := range ops {
		e.publish(amqp.Publishing{MessageId: fmt.Sprintf("op-%d", i), Type: kind(i), Body: []byte("x")})
	}
	startConsumer(t, e, amqpidem.ConsumerConfig{Concurrency: 64, Config: amqpidem.Config{
		Observer: rec, MaxAttempts: 1, UnavailableDelay: 50 * time.Millisecond,
	}}, h)
	rec.waitFor(t, 60*time.Second, "every message settled", func(evs []amqpidem.Event) bool {
		settled := map[string]bool{}
		for _, ev := range evs {
			if ev.Outcome == amqpidem.Completed || ev.Outcome == amqpidem.OutboxGivenUp {
				settled[ev.Key] = true
			}
		}
		return len(settled) == ops
	})
	for i := range ops {
		key := amqpidem.StoreKey(e.queue, fmt.Sprintf("op-%d", i))
		res, err := e.store.Acquire(context.Background(), lock.Request{Key: key})
		if err != nil || res.Status != lock.Completed {
			t.Fatalf("op-%d: %v %v", i, res.Status, err)
		}
		msgs, err := amqpidem.StoredOutbox(res.Value)
		if err != nil || len(msgs) != 1 {
			t.Fatalf("op-%d: %+v %v", i, msgs, err)
		}
		m := msgs[0]
		if k := kind(i); k == "ok" && (m.State != amqpidem.OutboxPublished || m.Tries != 0) ||
			k != "ok" && (m.State != amqpidem.OutboxReturned || m.Tries != 1) {
			t.Errorf("op-%d (%s): state %v, tries %d", i, k, m.State, m.Tries)
		}
	}
}
