package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestTxHandlerPoolAboveConcurrency: a TxHandler holds a pooled
// connection while it runs, and the heartbeat needs one more to renew its
// lease. On a pool of 2 with Concurrency 2, two handlers that run longer
// than most of their lease (1.5 s on a 1 s lease) held both connections:
// their leases went unrenewed, they were cancelled, then waited out the
// 10 s commit timeout for a connection, were requeued, and did the same
// again: nothing completed in 8 s (seen before the fix). NewConsumer now
// refuses that configuration (ErrPoolTooSmall; it accepted it before),
// and with one connection to spare (Concurrency 1) the same work completes.
func TestTxHandlerPoolAboveConcurrency(t *testing.T) {
	r := newRigWith(t, pgstore.Config{})
	r.store = newStore(t, pgenv.Pool(t, 2), r.cfg)
	h := r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if _, err := tx.Exec(ctx, "SELECT pg_sleep(1.5)"); err != nil {
			return nil, err
		}
		return nil, r.insert(ctx, tx, d.MessageId)
	})
	_, err := amqpidem.NewConsumer(r.store, amqpidem.ConsumerConfig{URL: testenv.AMQPURL(t), Concurrency: 2,
		Config: amqpidem.Config{Queue: r.queue}}, h)
	if !errors.Is(err, amqpidem.ErrPoolTooSmall) {
		t.Fatalf("NewConsumer with a pool of 2 and Concurrency 2: got %v, want ErrPoolTooSmall", err)
	}
	// The default Concurrency (Prefetch, 32) is refused too.
	if _, err := amqpidem.NewConsumer(r.store, amqpidem.ConsumerConfig{URL: testenv.AMQPURL(t),
		Config: amqpidem.Config{Queue: r.queue}}, h); !errors.Is(err, amqpidem.ErrPoolTooSmall) {
		t.Fatalf("NewConsumer with a pool of 2 and the default Concurrency: got %v, want ErrPoolTooSmall", err)
	}

	r.run(h, func(c *amqpidem.ConsumerConfig) { c.Concurrency = 1; c.LeaseTTL = time.Second })
	r.publish("a", "b")
	done := map[string]bool{}
	deadline := time.After(15 * time.Second)
	for len(done) < 2 {
		select {
		case e := <-r.events:
			if e.Outcome != amqpidem.Completed {
				t.Fatalf("%s: %v %q %v; want completed", e.Key, e.Outcome, e.Reason, e.Err)
			}
			done[e.Key] = true
		case <-deadline:
			t.Fatalf("completed within 15 s: %v", done)
		}
	}
	if got := r.effects(); got["a"] != 1 || got["b"] != 1 {
		t.Fatalf("effects: %v", got)
	}
}
