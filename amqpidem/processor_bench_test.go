package amqpidem

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// nopBroker takes every publish and requeue and keeps nothing, so that the
// processor's benchmarks measure the processor and the store.
type nopBroker struct{}

func (nopBroker) publish(context.Context, string, string, amqp.Publishing) error        { return nil }
func (nopBroker) publishAlone(context.Context, string, string, amqp.Publishing) error   { return nil }
func (nopBroker) declare(context.Context, string, amqp.Table, bool) error               { return nil }
func (nopBroker) forget(string)                                                         {}
func (nopBroker) requeue(context.Context, string, amqp.Publishing, time.Duration) error { return nil }

// BenchmarkProcess runs one delivery through the processor per op, on
// lock.MemoryStore with a broker that keeps nothing: the layer's own cost
// (allocations, CPU) with no network in the way. unique runs a new key to
// completion; duplicate answers a key completed before; retry runs a new
// key whose handler fails (released, requeued with backoff); outbox runs a
// new key whose handler stages one message (stored with the outcome,
// published, marked published). Each delivery
// carries the headers a requeued copy has.
func BenchmarkProcess(b *testing.B) {
	errBoom := errors.New("boom")
	for _, bc := range []struct {
		name    string
		dup     bool
		handler HandlerFunc
		want    Outcome
	}{
		{"unique", false, func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }, Completed},
		{"duplicate", true, func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }, Duplicate},
		{"retry", false, func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, errBoom }, Retried},
		{"outbox", false, func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			return nil, Stage(ctx, "", "next", amqp.Publishing{ContentType: "application/json", Body: d.Body})
		}, Completed},
	} {
		b.Run(bc.name, func(b *testing.B) {
			store, err := lock.NewMemoryStore(lock.Config{})
			if err != nil {
				b.Fatal(err)
			}
			p, err := newProcessor(store, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)}, bc.handler)
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = p.keeper.Shutdown(context.Background()) }()
			ctx, br, ack := context.Background(), nopBroker{}, &countChannel{}
			body := []byte(`{"order":42,"amount_cents":1999}`)
			table := amqp.Table{HeaderAttempt: int64(1), HeaderReason: "handler error",
				HeaderTimestampMillis: time.Now().UnixMilli(), "tenant": "acme"}
			ids := make([]string, b.N)
			for i := range ids {
				ids[i] = "op-" + strconv.Itoa(i)
				if bc.dup {
					ids[i] = "op-dup"
				}
			}
			if bc.dup {
				d := amqp.Delivery{Acknowledger: ack, MessageId: "op-dup", Body: body, Headers: table}
				if ev := p.process(ctx, br, &d, nil); ev.Outcome != Completed {
					b.Fatalf("first copy: %v %s %v", ev.Outcome, ev.Reason, ev.Err)
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				d := amqp.Delivery{Acknowledger: ack, MessageId: ids[i], Body: body, Headers: table}
				if ev := p.process(ctx, br, &d, nil); ev.Outcome != bc.want {
					b.Fatalf("%v %s %v, want %v", ev.Outcome, ev.Reason, ev.Err, bc.want)
				}
			}
		})
	}
}
