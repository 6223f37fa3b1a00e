package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// TestBatchTxHandlerCommitThenPanicNotRerun: as
// TestBatchTxHandlerCommitThenErrorNotRerun, but the function panics
// after ending the batch's transaction itself with a COMMIT (a library
// handed tx.Conn() that commits, then a nil map, say). docs/batches.md
// says a batch error after the function's own COMMIT is made each
// message's own Permanent error, never split nor run again, and "the
// handler returns an error for the whole batch, or panics" are one row
// of its table. The panic leaves pgstore without its ending being
// decided, amqpidem recovers it as a batch error and splits the batch:
// the halves run again and commit their work a second time.
func TestBatchTxHandlerCommitThenPanicNotRerun(t *testing.T) {
	r := newRig(t)
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		panic("after its own COMMIT")
	}), func(c *amqpidem.ConsumerConfig) { c.BatchWait = 200 * time.Millisecond })
	ops := ids("p", 8)
	r.publish(ops...)
	evs := r.settled(ops, amqpidem.DeadLettered, amqpidem.Completed)
	got := r.effects()
	for _, op := range ops {
		if got[op] != 1 {
			t.Errorf("%s: %d effect rows, events %s; want 1 (its work committed once, never run again)", op, got[op], outcomes(evs[op]))
		}
	}
}

// TestTxHandlerCommitThenPanicNotRerun: the single-message form of
// TestBatchTxHandlerCommitThenPanicNotRerun. TxFunc's documentation says
// a function that committed itself and then failed is not run again
// (Permanent, wrapping ErrTxEnded); a panic is the handler's failure as
// much as a returned error, but escapes pgstore, and amqpidem retries it.
func TestTxHandlerCommitThenPanicNotRerun(t *testing.T) {
	r := newRig(t)
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		panic("after its own COMMIT")
	}), nil)
	ops := ids("s", 2)
	r.publish(ops...)
	evs := r.settled(ops, amqpidem.DeadLettered, amqpidem.Completed)
	got := r.effects()
	for _, op := range ops {
		if got[op] != 1 {
			t.Errorf("%s: %d effect rows, events %s; want 1 (its work committed once, never run again)", op, got[op], outcomes(evs[op]))
		}
	}
}
