package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// TestOutboxThroughTheBroker runs a Consumer on the real broker and Redis
// whose handler stages one message per operation to a second queue, each
// operation published three times: the second queue gets each staged
// message once, with the MessageId the outbox derived, and the record
// remembers it published. Then a staged message no queue takes is tried
// with each copy and given up after MaxAttempts, kept in the record.
func TestOutboxThroughTheBroker(t *testing.T) {
	e := newEnv(t, nil)
	next := e.queue + ".next"
	if _, err := e.ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(next, false, false, false) })
	rec := &recorder{}
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		to := next
		if string(d.Body) == "nowhere" {
			to = e.queue + ".missing"
		}
		return nil, amqpidem.Stage(ctx, "", to, amqp.Publishing{Body: append([]byte("after "), d.Body...)})
	})
	startConsumer(t, e, amqpidem.ConsumerConfig{Config: amqpidem.Config{
		Observer: rec, MaxAttempts: 2, UnavailableDelay: 50 * time.Millisecond,
	}}, h)

	const ops = 20
	for copyN := range 3 {
		for i := range ops {
			e.publish(amqp.Publishing{MessageId: fmt.Sprintf("op-%d", i), Body: []byte(fmt.Sprintf("op %d", i))})
		}
		_ = copyN
	}
	got := map[string]string{} // MessageId -> body
	deadline := time.Now().Add(30 * time.Second)
	for len(got) < ops && time.Now().Before(deadline) {
		if m, ok := e.get(next, time.Second); ok {
			if prev, dup := got[m.MessageId]; dup {
				t.Fatalf("staged message %s published twice (%q, %q)", m.MessageId, prev, m.Body)
			}
			got[m.MessageId] = string(m.Body)
		}
	}
	if len(got) != ops {
		t.Fatalf("got %d staged messages, want %d", len(got), ops)
	}
	rec.waitFor(t, 10*time.Second, "every copy settled", func(evs []amqpidem.Event) bool { return len(evs) >= 3*ops })
	if m, ok := e.get(next, 500*time.Millisecond); ok {
		t.Fatalf("a staged message came a second time: %s %q", m.MessageId, m.Body)
	}
	for i := range ops {
		key := amqpidem.StoreKey(e.queue, fmt.Sprintf("op-%d", i))
		res, err := e.store.Acquire(context.Background(), lock.Request{Key: key})
		if err != nil || res.Status != lock.Completed {
			t.Fatalf("op-%d: %v %v", i, res.Status, err)
		}
		msgs, err := amqpidem.StoredOutbox(res.Value)
		if err != nil || len(msgs) != 1 || msgs[0].State != amqpidem.OutboxPublished || got[msgs[0].Msg.MessageId] != fmt.Sprintf("after op %d", i) {
			t.Fatalf("op-%d's record: %+v %v", i, msgs, err)
		}
	}

	// No queue takes it: tried with the first copy and its requeued one,
	// then given up and kept.
	e.publish(amqp.Publishing{MessageId: "lost", Body: []byte("nowhere")})
	rec.waitFor(t, 20*time.Second, "the unroutable message given up", func(evs []amqpidem.Event) bool {
		for _, ev := range evs {
			if ev.Key == "lost" && ev.Outbox.Returned == 1 {
				return true
			}
		}
		return false
	})
	res, err := e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, "lost")})
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := amqpidem.StoredOutbox(res.Value)
	if err != nil || len(msgs) != 1 || msgs[0].State != amqpidem.OutboxReturned || msgs[0].Tries != 2 {
		t.Fatalf("the unroutable message's record: %+v %v", msgs, err)
	}
}

// TestOutboxRefusedByTheBroker: staged messages the broker refuses by
// closing the channel (an exchange that does not exist, a user id that is
// not the connection's, an expiration that is not a number) are tried
// with each copy and given up after MaxAttempts, never retried forever.
func TestOutboxRefusedByTheBroker(t *testing.T) {
	e := newEnv(t, nil)
	rec := &recorder{}
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		switch string(d.Body) {
		case "no exchange":
			return nil, amqpidem.Stage(ctx, e.queue+".no-such-exchange", "rk", amqp.Publishing{Body: []byte("x")})
		case "user id":
			return nil, amqpidem.Stage(ctx, "", e.queue, amqp.Publishing{UserId: "someone-else", Body: []byte("x")})
		default:
			return nil, amqpidem.Stage(ctx, "", e.queue, amqp.Publishing{Expiration: "soon", Body: []byte("x")})
		}
	})
	startConsumer(t, e, amqpidem.ConsumerConfig{Config: amqpidem.Config{
		Observer: rec, MaxAttempts: 2, UnavailableDelay: 50 * time.Millisecond,
	}}, h)
	for _, body := range []string{"no exchange", "user id", "expiration"} {
		e.publish(amqp.Publishing{MessageId: body, Body: []byte(body)})
	}
	rec.waitFor(t, 30*time.Second, "the three given up", func(evs []amqpidem.Event) bool {
		n := 0
		for _, ev := range evs {
			if ev.Outbox.Returned == 1 && ev.Outcome == amqpidem.OutboxGivenUp {
				n++
			}
		}
		return n == 3
	})
	// Each says why, with the broker's reason: not "unroutable" read off
	// the returns channel that closed with the channel.
	rec.mu.Lock()
	evs := append([]amqpidem.Event(nil), rec.events...)
	rec.mu.Unlock()
	for _, ev := range evs {
		if ev.Key == "no exchange" && ev.Outbox.Returned == 1 {
			if !errors.Is(ev.Err, amqpidem.ErrNotConfirmed) || !strings.Contains(ev.Err.Error(), "NOT_FOUND") {
				t.Fatalf("a staged message to a missing exchange given up with %v; want the broker's NOT_FOUND", ev.Err)
			}
		}
	}
	for _, key := range []string{"no exchange", "user id", "expiration"} {
		res, err := e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, key)})
		if err != nil {
			t.Fatal(err)
		}
		msgs, err := amqpidem.StoredOutbox(res.Value)
		if err != nil || len(msgs) != 1 || msgs[0].State != amqpidem.OutboxReturned {
			t.Fatalf("%s: %+v %v", key, msgs, err)
		}
	}
}
