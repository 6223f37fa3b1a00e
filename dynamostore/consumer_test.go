package dynamostore_test

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// TestConsumerTxHandler runs an amqpidem.Consumer on the store with a
// TxHandler whose effect is a counter: each message's effect is applied
// once, and a copy of a message is a duplicate that runs nothing.
func TestConsumerTxHandler(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, prefix := srv.effects(t), testenv.Name(t)
		url := testenv.AMQPURL(t)
		queue := testenv.Name(t)
		ch := testenv.QueueChannel(t, queue)

		events := make(chan amqpidem.Event, 100)
		var runs atomic.Int32
		h := s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			runs.Add(1)
			bump(tx, table, prefix+"-"+d.MessageId)
			return []byte("receipt " + d.MessageId), nil
		})
		c, err := amqpidem.NewConsumer(s, amqpidem.ConsumerConfig{
			URL: url,
			Config: amqpidem.Config{
				Queue:            queue,
				LeaseTTL:         3 * time.Second,
				UnavailableDelay: 100 * time.Millisecond,
				Backoff:          func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
				Logger:           slog.New(slog.DiscardHandler),
				Observer:         amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { events <- e }),
			},
		}, h)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- c.Run(context.Background()) }()
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := c.Shutdown(ctx); err != nil {
				t.Errorf("Shutdown: %v", err)
			}
			if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
				t.Errorf("Run: %v", err)
			}
		})

		publish := func(ids ...string) {
			for _, id := range ids {
				err := ch.PublishWithContext(context.Background(), "", queue, false, false,
					amqp.Publishing{MessageId: id, DeliveryMode: amqp.Persistent, Body: []byte("pay " + id)})
				if err != nil {
					t.Fatal(err)
				}
			}
		}
		wait := func(n int) []amqpidem.Event {
			var got []amqpidem.Event
			timeout := time.After(20 * time.Second)
			for len(got) < n {
				select {
				case e := <-events:
					got = append(got, e)
				case <-timeout:
					t.Fatalf("got %d events, want %d: %+v", len(got), n, got)
				}
			}
			return got
		}
		publish("a", "b")
		for _, e := range wait(2) {
			if e.Outcome != amqpidem.Completed {
				t.Fatalf("first deliveries: %+v, want completed", e)
			}
		}
		publish("a")
		if e := wait(1)[0]; e.Outcome != amqpidem.Duplicate {
			t.Fatalf("the copy of a: %+v, want a duplicate", e)
		}
		if a, b := srv.count(t, prefix+"-a"), srv.count(t, prefix+"-b"); a != 1 || b != 1 || runs.Load() != 2 {
			t.Fatalf("effects a=%d b=%d after %d runs, want 1, 1 after 2", a, b, runs.Load())
		}
	})
}
