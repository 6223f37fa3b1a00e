package amqpidem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// On a quorum queue with a delivery limit, a duplicate that waits for a
// long job is requeued as a new message each time: the broker's delivery
// count never reaches the limit, and the duplicate is acked, not dropped.
func TestQuorumBusyRequeuesDoNotUseDeliveryLimit(t *testing.T) {
	args := amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(2)}
	e := newEnv(t, args)
	var ran runs
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		ran.add(d.MessageId)
		select {
		case <-time.After(2 * time.Second):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return []byte("ok"), nil
	})
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		QueueArgs: args,
		Config:    amqpidem.Config{LeaseTTL: 500 * time.Millisecond, InProgressDelay: 100 * time.Millisecond, Observer: rec},
	}, h)
	e.publish(amqp.Publishing{MessageId: "job", Body: []byte("x")})
	time.Sleep(200 * time.Millisecond)
	e.publish(amqp.Publishing{MessageId: "job", Body: []byte("x")})
	rec.waitFor(t, 15*time.Second, "job completed and duplicate acked", func(evs []amqpidem.Event) bool {
		return count(evs, "job", amqpidem.Completed) == 1 && count(evs, "job", amqpidem.Duplicate) == 1
	})
	rec.mu.Lock()
	busy := count(rec.events, "job", amqpidem.Busy)
	rec.mu.Unlock()
	if busy <= 2 {
		t.Fatalf("busy requeues: %d, want more than the delivery limit (2) to prove the point", busy)
	}
	if got := ran.get("job"); got != 1 {
		t.Fatalf("handler runs: %d, want 1", got)
	}
}

func TestWrapOwnLoopAndReplies(t *testing.T) {
	e := newEnv(t, nil)
	var ran runs
	w, err := amqpidem.Wrap(e.conn, e.store, amqpidem.Config{Queue: e.queue},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			n := ran.add(d.MessageId)
			return []byte(fmt.Sprintf("quote for %s (run %d)", d.Body, n)), nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := w.Shutdown(context.Background()); err != nil {
			t.Error(err)
		}
	})
	replies, err := e.ch.QueueDeclare("", false, true, true, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		e.publish(amqp.Publishing{MessageId: "rpc-1", Body: []byte("sku-9"), ReplyTo: replies.Name, CorrelationId: fmt.Sprint("c", i)})
	}

	// The user's own loop: consume, hand each delivery to the wrapper.
	_, msgs := e.consume()
	var outcomes []amqpidem.Outcome
	for range 3 {
		d := <-msgs
		outcomes = append(outcomes, w.Handle(context.Background(), d).Outcome)
	}
	if fmt.Sprint(outcomes) != "[completed duplicate duplicate]" {
		t.Fatalf("outcomes: %v", outcomes)
	}
	for i := range 3 {
		m, ok := e.get(replies.Name, 5*time.Second)
		if !ok {
			t.Fatalf("reply %d missing", i)
		}
		if string(m.Body) != "quote for sku-9 (run 1)" || m.CorrelationId != fmt.Sprint("c", i) {
			t.Fatalf("reply %d: %q corr %q", i, m.Body, m.CorrelationId)
		}
	}
	if got := ran.get("rpc-1"); got != 1 {
		t.Fatalf("handler runs: %d", got)
	}
}

// Bad input gets a clear outcome and is never silently dropped; bodies and
// properties survive requeue hops byte for byte.
func TestBadInputAndRoundTrips(t *testing.T) {
	e := newEnv(t, nil)
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	var mu sync.Mutex
	seen := map[string][][]byte{}
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Config: amqpidem.Config{
			Key:      amqpidem.Header("op-id"),
			Observer: rec,
			Backoff:  func() backoff.BackOff { return backoff.NewConstantBackOff(50 * time.Millisecond) },
		},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		info, _ := amqpidem.FromContext(ctx)
		mu.Lock()
		seen[info.Key] = append(seen[info.Key], d.Body)
		mu.Unlock()
		if info.Attempt == 1 {
			return nil, errors.New("first attempt fails") // force a hop through a delay queue
		}
		if d.ContentType != "application/octet-stream" || d.Headers["trace"] != "t-1" || d.CorrelationId != "corr" {
			return nil, amqpidem.Permanent(fmt.Errorf("properties lost: %q %v %q", d.ContentType, d.Headers, d.CorrelationId))
		}
		return nil, nil
	}))
	props := func(id any, body []byte) amqp.Publishing {
		return amqp.Publishing{Headers: amqp.Table{"op-id": id, "trace": "t-1"}, ContentType: "application/octet-stream",
			CorrelationId: "corr", Body: body}
	}
	e.publish(props("big", big))
	e.publish(props("empty", nil))
	e.publish(props(int32(7), []byte("number key")))
	e.publish(amqp.Publishing{Body: []byte("no header")})
	e.publish(props("{braces}\x00\xff", []byte("binary key")))

	rec.waitFor(t, 15*time.Second, "all settled", func(evs []amqpidem.Event) bool {
		return count(evs, "big", amqpidem.Completed) == 1 && count(evs, "empty", amqpidem.Completed) == 1 &&
			count(evs, "{braces}\x00\xff", amqpidem.Completed) == 1 && count(evs, "", amqpidem.DeadLettered) == 2
	})
	mu.Lock()
	defer mu.Unlock()
	if b := seen["big"]; len(b) != 2 || !bytes.Equal(b[1], big) {
		t.Fatalf("1 MiB body after a requeue hop: %d runs, equal=%v", len(b), len(b) == 2 && bytes.Equal(b[1], big))
	}
	for i := range 2 {
		m, ok := e.get(e.queue+".dlq", 5*time.Second)
		if !ok {
			t.Fatalf("dead letter %d missing", i)
		}
		if m.Headers[amqpidem.HeaderReason] != "missing key" {
			t.Fatalf("dead letter reason: %v", m.Headers[amqpidem.HeaderReason])
		}
		if string(m.Body) == "number key" && !strings.Contains(fmt.Sprint(m.Headers[amqpidem.HeaderError]), "int32") {
			t.Fatalf("wrong-type header not explained: %v", m.Headers[amqpidem.HeaderError])
		}
	}
}

// A dead-letter target that does not exist never loses the message: it is
// kept cycling through a delay until the target works.
func TestUnroutableDeadLetterTarget(t *testing.T) {
	e := newEnv(t, nil)
	exchange := e.queue + ".dead-ex"
	if err := e.ch.ExchangeDeclare(exchange, "direct", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Config: amqpidem.Config{DeadLetterExchange: exchange, DeadLetterRoutingKey: "dead", Observer: rec,
			UnavailableDelay: 100 * time.Millisecond},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		return nil, amqpidem.Permanent(errors.New("bad payment"))
	}))
	e.publish(amqp.Publishing{MessageId: "p1", Body: []byte("x")})
	rec.waitFor(t, 10*time.Second, "two unroutable attempts", func(evs []amqpidem.Event) bool {
		return count(evs, "p1", amqpidem.Abandoned) >= 2
	})
	// Now bind a queue: the next cycle delivers the dead letter.
	dlq := e.queue + ".custom-dlq"
	if _, err := e.ch.QueueDeclare(dlq, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := e.ch.QueueBind(dlq, "dead", exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, 10*time.Second, "dead-lettered", func(evs []amqpidem.Event) bool {
		return count(evs, "p1", amqpidem.DeadLettered) == 1
	})
	m, ok := e.get(dlq, 5*time.Second)
	if !ok || m.MessageId != "p1" || m.Headers[amqpidem.HeaderReason] != "permanent failure" {
		t.Fatalf("dead letter: ok=%v %+v", ok, m.Headers)
	}
}
