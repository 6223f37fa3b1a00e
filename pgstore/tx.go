package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// TxFunc does the work of one message in tx, a transaction of the Store's
// pool, and returns the result to store (and to send to ReplyTo) or an
// error, as amqpidem.Handler does. It must not commit or roll back tx:
// TxHandler does, after writing the record in it. (When tx holds the lease
// itself, see "Leases held by transactions" in the package documentation,
// tx.Commit is refused and tx.Rollback undoes fn's writes only.) ctx is the
// handler's context (cancelled when a record-row lease is lost, with
// amqpidem.FromContext giving the key, attempt and fence); run tx's
// statements with it.
type TxFunc func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error)

// commitTimeout bounds writing the record and committing, which run even
// when the handler's context was cancelled meanwhile: whether the work
// counts is the record's compare-and-set to decide, not the context's.
const commitTimeout = 10 * time.Second

// TxHandler returns a handler that runs fn in a transaction (begun with
// Config.TxOptions) and completes the message's record in that same
// transaction, after fn, then commits: fn's writes and the record commit
// together or not at all. Give it to amqpidem.NewConsumer or
// amqpidem.Wrap with this Store.
//
//   - fn returns an error: the transaction rolls back, and the error is
//     the handler's, retried or dead-lettered as usual.
//   - The lease was lost meanwhile (another consumer took the key over):
//     the record refuses the completion (compare-and-set on owner and
//     fence), everything rolls back, and the message is requeued for the
//     record to decide.
//   - The commit's outcome is unknown (the connection dropped during
//     COMMIT): the error wraps lock.ErrUnavailable, the message is
//     requeued, and its redelivery finds the record completed (it is
//     acked as a duplicate) or still held (the effects rolled back with
//     it, and it runs again). Never both effects, never none.
//
// A message processed without a lease (amqpidem.ProcessMissingKey,
// FailOpen) runs fn in a transaction of its own, with no record.
//
// The returned handler implements amqpidem.Completer.
func (s *Store) TxHandler(fn TxFunc) amqpidem.Handler {
	return &txHandler{s: s, fn: fn}
}

// txHandler is what TxHandler returns.
type txHandler struct {
	s  *Store
	fn TxFunc
}

var _ amqpidem.LeaseTaker = (*txHandler)(nil)

// AcquireLease takes d's lease (amqpidem.LeaseTaker): held by the
// transaction that HandleComplete then runs fn in, or, for a redelivered
// message, a key whose record counts attempts and with Config.RowLeases,
// by a record row as Acquire takes it. See "Leases held by transactions"
// in the package documentation.
func (h *txHandler) AcquireLease(ctx context.Context, req lock.Request, d *amqp.Delivery) (lock.Result, error) {
	if d.Redelivered || h.s.cfg.RowLeases {
		return h.s.Acquire(ctx, req)
	}
	return h.s.acquireHeld(ctx, req)
}

// CompleterStore returns the Store the handler writes records to.
func (h *txHandler) CompleterStore() lock.Store { return h.s }

// Handle runs fn in a transaction with no record, and commits.
func (h *txHandler) Handle(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	return h.run(ctx, d, commitOnly)
}

// HandleComplete runs fn in a transaction, then completes lease's record
// with value(result) and commits, both in one round trip (see finishTx).
// For a lease held by a transaction, fn runs in that one (see
// completeHeld).
func (h *txHandler) HandleComplete(ctx context.Context, d *amqp.Delivery, lease lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	if isHeld(lease) {
		return h.completeHeld(ctx, d, lease, value)
	}
	return h.run(ctx, d, func(ctx context.Context, tx pgx.Tx, result []byte) error {
		v, err := h.stored(lease, result, value)
		if err != nil {
			return err
		}
		return h.s.finishTx(ctx, tx, lease, v)
	})
}

// stored is the value to store for result: value(result), within the
// Store's MaxResultSize.
func (h *txHandler) stored(lease lock.Lease, result []byte, value func([]byte) ([]byte, error)) ([]byte, error) {
	v, err := value(result)
	if err != nil {
		return nil, err
	}
	if len(v) > h.s.cfg.MaxResultSize {
		return nil, fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", lock.ErrResultTooLarge, lease.Key, len(v), h.s.cfg.MaxResultSize)
	}
	return v, nil
}

// completeHeld runs fn in the transaction that holds lease, from the
// handler's savepoint, then writes the completed record and commits, in
// one round trip (commitHeld). When fn fails, or its result cannot be
// stored, the transaction is kept for the call that ends the lease next
// (Fail, Release, Cancel: amqpidem makes one), which rolls back to the
// savepoint and writes that outcome under the same lease.
func (h *txHandler) completeHeld(ctx context.Context, d *amqp.Delivery, lease lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	ht := h.s.takeHeld(lease.Owner)
	if ht == nil {
		return nil, fmt.Errorf("%w: key %q: the transaction holding the lease ended before the handler ran", lock.ErrUnavailable, lease.Key)
	}
	committing := false
	defer func() {
		if !committing { // fn failed or panicked: the next call ends it
			h.s.putHeld(lease, ht)
		}
	}()
	result, err := h.fn(ctx, ht.tx, d)
	if err != nil {
		return nil, h.fnError(ctx, ht.tx, err)
	}
	v, err := h.stored(lease, result, value)
	if err != nil {
		return nil, err
	}
	committing = true
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	err = h.s.commitHeld(cctx, ht, lease, "complete", "c", v)
	h.s.endConn(ht.conn)
	if err != nil {
		if !errors.Is(err, lock.ErrLeaseLost) {
			// amqpidem releases the lease next: its record keeps the
			// fingerprint.
			h.s.putHeld(lease, &heldTx{fp: ht.fp})
		}
		return nil, err
	}
	return result, nil
}

// fnError is the error fn's error err comes to: lock.ErrUnavailable when
// the transaction's connection is gone (the server restarted, the backend
// was terminated) and not because ctx ended, since nothing of it committed
// and the store is the cause; err as it is otherwise.
func (h *txHandler) fnError(ctx context.Context, tx pgx.Tx, err error) error {
	if ctx.Err() == nil && tx.Conn().IsClosed() && !amqpidem.IsPermanent(err) && !errors.Is(err, lock.ErrUnavailable) {
		return fmt.Errorf("%w: the transaction's connection closed: %w", lock.ErrUnavailable, err)
	}
	return err
}

// commitOnly is run's commit for a transaction with no record.
func commitOnly(ctx context.Context, tx pgx.Tx, _ []byte) error {
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgstore: commit (its outcome may be unknown: the record tells): %w", classify(err))
	}
	return nil
}

// run begins a transaction on a connection of the pool, runs fn in it,
// then commit, which must end the transaction, with COMMIT when it
// returns nil. Anything else is rolled back.
func (h *txHandler) run(ctx context.Context, d *amqp.Delivery, commit func(context.Context, pgx.Tx, []byte) error) ([]byte, error) {
	// A connection of its own rather than pool.BeginTx: finishTx commits
	// with a statement the pgx.Tx does not see, after which that Tx would
	// send a ROLLBACK of its own to give the connection back.
	conn, err := h.s.pool.Acquire(ctx)
	var tx pgx.Tx
	if err == nil {
		defer conn.Release()
		tx, err = conn.BeginTx(ctx, h.s.cfg.TxOptions)
	}
	if err != nil {
		if ctx.Err() != nil {
			// The handler's context ended (a timeout, the lease lost,
			// shutdown): amqpidem reads why from the context.
			return nil, fmt.Errorf("pgstore: begin: %w", err)
		}
		return nil, fmt.Errorf("pgstore: begin: %w", classify(err))
	}
	committed := false
	defer func() {
		if committed {
			return
		}
		// After a cancelled context, a fresh one lets the connection go
		// back to the pool clean (Release closes one left in a
		// transaction).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	result, err := h.fn(ctx, tx, d)
	if err != nil {
		return nil, h.fnError(ctx, tx, err)
	}
	// The record and the commit run even when ctx ended meanwhile: the
	// record's compare-and-set decides whether the work counts.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if err := commit(cctx, tx, result); err != nil {
		return nil, err
	}
	committed = true
	return result, nil
}
