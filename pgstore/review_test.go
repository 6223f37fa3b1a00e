package pgstore_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestTxHandlerCommitBeginThenErrorNotRerun: the function commits its
// work itself, then begins a transaction again ("COMMIT", then "BEGIN":
// work committed in chunks, or a library handed tx.Conn() whose second
// transaction then fails), and returns a retryable error. TxFunc's
// documentation: fn ended the transaction itself and it committed, then
// returned an error: "the error wraps ErrTxEnded, Permanent". ending only
// looks at the connection's last status, 'T' again after the BEGIN, and
// takes the run for one whose transaction is still open: the error is
// retried, and each attempt commits the work once more.
func TestTxHandlerCommitBeginThenErrorNotRerun(t *testing.T) {
	r := newRig(t)
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, "BEGIN"); err != nil {
			return nil, err
		}
		return nil, errors.New("a later step failed")
	}), func(c *amqpidem.ConsumerConfig) { c.MaxAttempts = 3 })
	ops := ids("cb", 2)
	r.publishOnce(ops)
}

// TestBatchTxHandlerCommitBeginThenErrorNotRerun: the batch form of
// TestTxHandlerCommitBeginThenErrorNotRerun. docs/batches.md: a batch
// error after the function's own COMMIT is made each message's own
// Permanent error, never split nor run again. With a BEGIN after that
// COMMIT, the batch error is split and its halves run again, committing
// their work once per run.
func TestBatchTxHandlerCommitBeginThenErrorNotRerun(t *testing.T) {
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
		if _, err := tx.Exec(ctx, "BEGIN"); err != nil {
			return nil, err
		}
		return nil, errors.New("a later step failed")
	}), func(c *amqpidem.ConsumerConfig) {
		c.BatchWait = 200 * time.Millisecond
		c.MaxAttempts = 3
	})
	ops := ids("cbb", 4)
	r.publishOnce(ops)
}

// TestTxHandlerCommitBeginThenRecordFailsNotRerun: the function commits
// its work itself, begins another transaction, and returns nil; the
// record is then written in that second transaction, which refuses it
// (BEGIN READ ONLY here; a lost lease or an outage would do as well). The
// work committed with the first: a rerun would do it again. The record is
// completed on its own instead, as after the function's own COMMIT.
func TestTxHandlerCommitBeginThenRecordFailsNotRerun(t *testing.T) {
	for _, rows := range []bool{false, true} {
		name := map[bool]string{false: "held", true: "row"}[rows]
		t.Run(name, func(t *testing.T) {
			r := newRigWith(t, pgstore.Config{RowLeases: rows})
			r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, "BEGIN READ ONLY")
				return nil, err
			}), func(c *amqpidem.ConsumerConfig) { c.MaxAttempts = 3 })
			r.publishOnce(ids("cbr", 2))
		})
	}
}

// TestBatchTxHandlerCommitBeginThenRecordFailsNotRerun: the batch form of
// TestTxHandlerCommitBeginThenRecordFailsNotRerun.
func TestBatchTxHandlerCommitBeginThenRecordFailsNotRerun(t *testing.T) {
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
		_, err := tx.Exec(ctx, "BEGIN READ ONLY")
		return nil, err
	}), func(c *amqpidem.ConsumerConfig) {
		c.BatchWait = 200 * time.Millisecond
		c.MaxAttempts = 3
	})
	r.publishOnce(ids("cbbr", 4))
}

// TestBatchTxHandlerUnkeyedBatchesAtOnce: NewBatchConsumer's
// documentation: "At most Concurrency over BatchSize batches (rounded up)
// run at once", which its pool check counts on (docs/batches.md: "however
// few deliveries each has"). A message without a key
// (ProcessMissingKey, FailOpen) "runs as a batch of its own", but not in
// one of those slots (batchOnly.Handle calls HandleBatch directly): up to
// Concurrency such batches run at once, each holding a pooled connection,
// beyond the pool the check accepted. Here BatchSize 10 and Concurrency
// 20 allow 2 batches (a pool of 4 accepted, one more than the check
// asks); unkeyed messages run 4 at once, the whole pool.
func TestBatchTxHandlerUnkeyedBatchesAtOnce(t *testing.T) {
	r := newRig(t)
	small := pgenv.Pool(t, 4)
	st := newStore(t, small, r.cfg)
	var mu sync.Mutex
	running, most := 0, 0
	h := st.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		mu.Lock()
		running++
		most = max(most, running)
		mu.Unlock()
		defer func() {
			mu.Lock()
			running--
			mu.Unlock()
		}()
		for _, d := range ds {
			if err := r.insert(ctx, tx, string(d.Body)); err != nil {
				return nil, err
			}
		}
		select {
		case <-time.After(time.Second):
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
		return nil, nil
	})
	cfg := batchConfig(t, r.queue, r.events)
	cfg.BatchSize, cfg.Concurrency, cfg.Prefetch = 10, 20, 20
	cfg.MissingKey = amqpidem.ProcessMissingKey
	c, err := amqpidem.NewBatchConsumer(st, cfg, h)
	if err != nil {
		t.Fatalf("NewBatchConsumer refused the pool: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = c.Shutdown(ctx)
		if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
			t.Errorf("Run: %v", err)
		}
	})
	const n = 6
	for i := range n {
		err := r.ch.PublishWithContext(context.Background(), "", r.queue, false, false,
			amqp.Publishing{DeliveryMode: amqp.Persistent, Body: []byte{'u', byte('0' + i)}})
		if err != nil {
			t.Fatal(err)
		}
	}
	for range n {
		select {
		case <-r.events:
		case <-time.After(20 * time.Second):
			t.Fatal("no event in 20 s")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if most > 2 {
		t.Errorf("%d batches ran at once, each holding one of the pool's 4 connections; NewBatchConsumer runs at most 2 (Concurrency 20 over BatchSize 10)", most)
	}
}

// TestCommitAnswerLostAcked: the COMMIT of a handler's transaction with
// its record lands, but its answer is lost (LoseCommitAnswers stands for
// the connection dropping there). pgstore asks the server whether the
// transaction committed and, as it did, the message is acked at once,
// completed, its work done once: not requeued to be acked as a duplicate
// on its redelivery. On both leases of TxHandler, and for a batch.
func TestCommitAnswerLostAcked(t *testing.T) {
	insert := func(r *rig) pgstore.TxFunc {
		return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, r.insert(ctx, tx, d.MessageId)
		}
	}
	check := func(t *testing.T, r *rig, ops []string) {
		t.Helper()
		r.publish(ops...)
		evs := r.settled(ops, amqpidem.Completed, amqpidem.Duplicate, amqpidem.DeadLettered)
		got := r.effects()
		for _, op := range ops {
			if got[op] != 1 || len(evs[op]) != 1 || evs[op][0].Outcome != amqpidem.Completed {
				t.Errorf("%s: %d effect rows, events %s; want 1, completed at once", op, got[op], outcomes(evs[op]))
			}
		}
	}
	for _, rows := range []bool{false, true} {
		t.Run(map[bool]string{false: "held", true: "row"}[rows], func(t *testing.T) {
			r := newRigWith(t, pgstore.Config{RowLeases: rows})
			pgstore.LoseCommitAnswers(t, 1)
			r.run(r.store.TxHandler(insert(r)), nil)
			check(t, r, ids("al", 1))
		})
	}
	t.Run("batch", func(t *testing.T) {
		r := newRig(t)
		pgstore.LoseCommitAnswers(t, 1)
		r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			for _, d := range ds {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
			}
			return nil, nil
		}), func(c *amqpidem.ConsumerConfig) { c.BatchWait = 200 * time.Millisecond })
		check(t, r, ids("alb", 4))
	})
}
