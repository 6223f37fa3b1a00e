package pgstore_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
)

// TestTxHandlerForcedShutdownPoolHeld is
// TestBatchTxHandlerForcedShutdownPoolHeld for TxHandler, on both leases:
// handlers (and here the test) hold every connection of the pool; a
// forced shutdown cancels them, pgx closes each cancelled statement's
// connection, and each asks whether its transaction committed on another
// connection of the pool. Unless its closed connection goes back to the
// pool first, none is answered before the commit timeout (10 s).
func TestTxHandlerForcedShutdownPoolHeld(t *testing.T) {
	for _, rows := range []bool{false, true} {
		name := "held"
		if rows {
			name = "row"
		}
		t.Run(name, func(t *testing.T) {
			r := newRig(t)
			small := pgenv.Pool(t, 3)
			cfg := r.cfg
			cfg.RowLeases = rows
			st := newStore(t, small, cfg)
			var running atomic.Int32
			h := st.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				running.Add(1)
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, "SELECT pg_sleep(5)")
				return nil, err
			})
			c, err := amqpidem.NewConsumer(st, amqpidem.ConsumerConfig{
				URL: testenv.AMQPURL(t), Concurrency: 2,
				Config: amqpidem.Config{Queue: r.queue, LeaseTTL: 10 * time.Second},
			}, h)
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- c.Run(context.Background()) }()
			r.publish(ids("h", 2)...)
			deadline := time.Now().Add(10 * time.Second)
			for running.Load() < 2 {
				if time.Now().After(deadline) {
					t.Fatalf("%d handlers running, want 2", running.Load())
				}
				time.Sleep(10 * time.Millisecond)
			}
			// The pool's third connection (NewConsumer leaves one beyond
			// Concurrency for the heartbeat): held while they are cancelled.
			spare, err := small.Acquire(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer spare.Release()
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			start := time.Now()
			_ = c.Shutdown(ctx)
			took := time.Since(start)
			if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
				t.Errorf("Run: %v", err)
			}
			if took > 5*time.Second {
				t.Errorf("Shutdown with a 300 ms deadline took %v: the cancelled handlers waited for a connection the others held", took.Round(time.Millisecond))
			}
		})
	}
}
