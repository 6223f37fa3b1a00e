package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// TxFunc does the work of one message in tx and returns the result to
// store (and to send to ReplyTo) or an error, as amqpidem.Handler does.
// ctx is the handler's context (cancelled when the lease is lost, with
// amqpidem.FromContext giving the key, attempt and fence); run tx's
// statements with it.
//
// tx is a nested transaction of the one TxHandler commits with the record,
// as pgx's tx.Begin makes: Commit keeps the work for that commit (it does
// not commit by itself), Rollback undoes it, and either closes tx, so that
// the usual `defer tx.Rollback(ctx)` and `return nil, tx.Commit(ctx)` do
// what they say. What each way of ending comes to, the same on every
// lease (see "Writing a TxHandler" in the package documentation):
//
//   - return nil (after Commit or without it): the work commits with the
//     completed record, once.
//   - return an error: the work rolls back; the error is the handler's,
//     retried or dead-lettered as usual.
//   - Rollback, then return nil: the work did not happen, so the message
//     is not acked as done: the error wraps ErrRolledBack, Permanent.
//   - a statement failed and fn returned nil anyway: nothing can commit;
//     the error wraps pgx.ErrTxCommitRollback, retried.
//   - fn ended the transaction itself (a COMMIT or ROLLBACK statement, or
//     a library given tx.Conn() that commits a transaction of its own):
//     if that committed and fn returned nil, the record is completed on
//     its own (no second effect, but no longer atomic with the work: a
//     crash in between runs it again); otherwise the error wraps
//     ErrTxEnded, Permanent, since what it did after cannot be undone.
//     A panic counts as an error it returned (an *amqpidem.PanicError):
//     after its own COMMIT, it is not run again either. So does a BEGIN
//     after its own COMMIT: returning nil, the record is written in that
//     second transaction, or, when that fails, on its own; returning an
//     error, the second transaction is rolled back and the error wraps
//     ErrTxEnded, Permanent.
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
//     the handler's, retried or dead-lettered as usual. (What fn may do
//     to its tx, and what each way of ending comes to: TxFunc.)
//   - The lease was lost meanwhile (another consumer took the key over):
//     the record refuses the completion (compare-and-set on owner and
//     fence), everything rolls back, and the message is requeued for the
//     record to decide.
//   - The commit's outcome is unknown (the connection dropped during
//     COMMIT): the server is asked, on another connection, whether the
//     transaction committed; if it did, the message is acked. When it
//     cannot say, the error wraps lock.ErrUnavailable, the message is
//     requeued, and its redelivery finds the record completed (it is
//     acked as a duplicate) or still held (the effects rolled back with
//     it, and it runs again). Never both effects, never none.
//
// A message processed without a lease (amqpidem.ProcessMissingKey,
// FailOpen) runs fn in a transaction of its own, with no record, and the
// same rules for its tx.
//
// The returned handler implements amqpidem.LeaseTaker.
func (s *Store) TxHandler(fn TxFunc) amqpidem.Handler {
	return &txHandler{s: s, fn: fn, tx: txOptions{s.cfg.TxOptions, s.sql.begin}}
}

// TxHandlerWith is TxHandler with transactions begun with opts in place
// of Config.TxOptions: an isolation level, access mode or deferrable mode
// per message type (SERIALIZABLE for the transfers, READ COMMITTED for
// the rest), on one Store. What Config.TxOptions says of the levels above
// READ COMMITTED holds for opts: such a handler takes record-row leases,
// and one that runs longer than a heartbeat interval fails at its
// completion with a serialization failure. A read-only AccessMode cannot
// write the record: TxHandlerWith panics, as a programming error.
func (s *Store) TxHandlerWith(opts pgx.TxOptions, fn TxFunc) amqpidem.Handler {
	if opts.AccessMode == pgx.ReadOnly {
		panic("pgstore: TxHandlerWith: a read-only transaction cannot write the record")
	}
	return &txHandler{s: s, fn: fn, tx: txOptions{opts, beginSQL(opts)}}
}

// txHandler is what TxHandler returns.
type txHandler struct {
	s  *Store
	fn TxFunc
	tx txOptions // how its transactions begin
}

// txOptions are the options of a TxHandler's transactions, and the
// statement that begins one with them.
type txOptions struct {
	opts  pgx.TxOptions
	begin string
}

var _ amqpidem.LeaseTaker = (*txHandler)(nil)

// AcquireLease takes d's lease (amqpidem.LeaseTaker): held by the
// transaction that HandleComplete then runs fn in, or, for a redelivered
// message, a key whose record counts attempts, a TTL longer than the
// server's idle timeout takes, and with Config.RowLeases, by a record row
// as Acquire takes it. See "Leases held by transactions" in the package
// documentation.
func (h *txHandler) AcquireLease(ctx context.Context, req lock.Request, d *amqp.Delivery) (lock.Result, error) {
	if d.Redelivered || h.s.cfg.RowLeases || req.TTL > maxIdleTimeout {
		return h.s.Acquire(ctx, req)
	}
	return h.s.acquireHeld(ctx, req, h.tx)
}

// maxIdleTimeout is the longest idle_in_transaction_session_timeout the
// server takes (2^31-1 ms, about 24.8 days): the longest lease a
// transaction can hold.
const maxIdleTimeout = (1<<31 - 1) * time.Millisecond

// CompleterStore returns the Store the handler writes records to.
func (h *txHandler) CompleterStore() lock.Store { return h.s }

// Handle runs fn in a transaction with no record, and commits.
func (h *txHandler) Handle(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	return h.run(ctx, d, nil, nil)
}

// HandleComplete runs fn in a transaction, then completes lease's record
// with value(result) and commits, both in one round trip (see finishTx).
// For a lease held by a transaction, fn runs in that one (see
// completeHeld).
func (h *txHandler) HandleComplete(ctx context.Context, d *amqp.Delivery, lease lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	if isHeld(lease) {
		return h.completeHeld(ctx, d, lease, value)
	}
	return h.run(ctx, d, &lease, value)
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

// ending is what a run of fn comes to, by how fn left its transaction
// (see TxFunc).
type ending int

const (
	// endCommit: the transaction is open with fn's work: the record is
	// written in it, and it commits.
	endCommit ending = iota + 1
	// endCommitted: fn ended the transaction itself and it committed,
	// and fn returned nil: the record is written on its own.
	endCommitted
	// endFailed: nothing is to be completed; the error says why.
	endFailed
)

// ending decides what fn's run comes to: fn returned ferr, having been
// given t in the transaction xid; held tells whether that transaction
// holds the lease. It asks the server only when fn ended the transaction
// itself, or its connection closed: whether xid committed.
func (s *Store) ending(ctx context.Context, t *handlerTx, xid string, ferr error, held bool) (ending, error) {
	pc := t.conn.PgConn()
	closed := pc.IsClosed()
	// The status of the connection's last answer, kept once it closed:
	// idle ('I') when fn's last statement ended the transaction.
	status := pc.TxStatus()
	ended := status == 'I'
	if !closed && !ended && (ferr != nil || t.state == txUndone || status == 'E') {
		// A failed run in a transaction: it may be another one, fn
		// having ended xid and begun again (COMMIT, then BEGIN).
		ended = s.begunAgain(ctx, t, xid, status)
		// The question may find the connection closed (the server ended
		// the session meanwhile): then decided as closed.
		closed = pc.IsClosed()
	}
	if closed || ended {
		// A closed connection goes back to the pool first, which forgets
		// it: the question is asked on another of the pool's, which must
		// not wait for this one's place (runs that all lost theirs at
		// once, a forced shutdown, would each wait for the others').
		t.releaseClosed()
		committed, err := s.committed(ctx, t.conn, xid)
		switch {
		case committed && ferr == nil:
			return endCommitted, nil
		case committed:
			return endFailed, amqpidem.Permanent(fmt.Errorf("%w, %w; then it returned an error, so it is not run again: %w", ErrTxEnded, errWorkCommitted, ferr))
		case closed && err != nil && !ended:
			// Rolled back with the session, or committed by a COMMIT of
			// fn whose answer was lost with the connection: unknown, the
			// server out of reach.
			return endFailed, fmt.Errorf("%w (%w)", connClosed(ctx, ferr, held), errWorkUnknown)
		case err != nil:
			// fn ended the transaction itself (its connection may have
			// closed after that), and the server cannot say how.
			return endFailed, amqpidem.Permanent(fmt.Errorf("%w; whether its work committed is unknown (%w), so it is not run again: %w", ErrTxEnded, classify(err), errWorkUnknown))
		case closed && !ended:
			// Rolled back with the session: the store is the cause.
			return endFailed, connClosed(ctx, ferr, held)
		case ferr != nil:
			return endFailed, amqpidem.Permanent(fmt.Errorf("%w and rolled it back; it returned: %w", ErrTxEnded, ferr))
		}
		return endFailed, amqpidem.Permanent(fmt.Errorf("%w and rolled it back, then returned no error: its work was undone", ErrTxEnded))
	}
	switch {
	case ferr != nil:
		return endFailed, ferr
	case t.state == txUndone:
		return endFailed, amqpidem.Permanent(ErrRolledBack)
	case status == 'E':
		return endFailed, fmt.Errorf("pgstore: a statement of the handler failed, and it returned no error: %w", pgx.ErrTxCommitRollback)
	}
	return endCommit, nil
}

// callFn runs f, a call of the handler's function, turning a panic into
// an *amqpidem.PanicError, which ending then decides on as on an error f
// returned: a function that committed its work itself and then panicked
// is not run again, and a transaction it left open rolls back.
func callFn[T any](f func() (T, error)) (res T, err error) {
	defer func() {
		if v := recover(); v != nil {
			var zero T
			res, err = zero, &amqpidem.PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return f()
}

// begunAgain reports whether the transaction open on t's connection, in
// status, is not xid: fn ended xid and began another (a COMMIT, then a
// BEGIN), which it then rolls back, so that ending decides on xid as for
// a transaction fn ended. A transaction a statement aborted ('E') is xid
// when its savepoint is there (rolling back to it, as the failed run's
// end does anyway); any other is asked for its id. An error in asking
// answers false (ending decides as before).
func (s *Store) begunAgain(ctx context.Context, t *handlerTx, xid string, status byte) bool {
	if xid == "" {
		return false
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	other := false
	if status == 'E' {
		_, err := t.conn.Exec(cctx, "ROLLBACK TO SAVEPOINT "+savepoint)
		var pe *pgconn.PgError
		other = errors.As(err, &pe) && pe.Code == "3B001" // no such savepoint
	} else if err := t.conn.QueryRow(cctx, "SELECT pg_current_xact_id_if_assigned()::text IS DISTINCT FROM $1", xid).Scan(&other); err != nil {
		other = false
	}
	if other {
		_, _ = t.conn.Exec(cctx, "ROLLBACK")
	}
	return other
}

// loseAnswer, when set (by tests), says whether a handler's commit that
// succeeded is to answer as one whose answer was lost with its
// connection (lostAnswer).
var loseAnswer func() bool

// lostAnswer is what a handler's commit that succeeded answers: nil, or,
// when a test asks (loseAnswer), the error of a commit whose answer was
// lost.
func lostAnswer() error {
	if loseAnswer != nil && loseAnswer() {
		return fmt.Errorf("pgstore: commit (its outcome may be unknown: the record tells): %w: answer lost (a test's)", lock.ErrUnavailable)
	}
	return nil
}

// workCommitted reports whether xid, the handler's transaction, committed,
// asked after the record's write and the commit failed: its COMMIT landed
// with the answer lost, or fn had committed xid itself and begun another
// transaction, the one that failed, with the record (a COMMIT, then a
// BEGIN, then nil). The work is then done, and a rerun would do it again.
// False when the server cannot say.
func (s *Store) workCommitted(ctx context.Context, t *handlerTx, xid string) bool {
	t.releaseClosed()
	if pc := t.conn.PgConn(); !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() != 'I' {
		// The failed transaction, aborted (its COMMIT skipped): rolled
		// back now rather than by endConn, to ask on its connection.
		if _, err := t.conn.Exec(ctx, "ROLLBACK"); err != nil {
			return false
		}
	}
	committed, err := s.committed(ctx, t.conn, xid)
	return err == nil && committed
}

// errWorkCommitted is in the error of a handler that ended its
// transaction itself, committed, and then failed (ending): its work is
// done and must not run again.
var errWorkCommitted = errors.New("and its work committed")

// recordAfterCommit is the error of a record that could not be completed
// (err) after the handler committed its work itself: Permanent, so that
// the message is not run again (released, a redelivery would take a new
// lease and do the work a second time).
func recordAfterCommit(err error) error {
	return amqpidem.Permanent(fmt.Errorf("%w, %w; then its record could not be completed, so it is not run again: %w",
		ErrTxEnded, errWorkCommitted, err))
}

// recordNotConfirmed is the error of a record that could not be completed
// on its own (err) after workCommitted found the handler's transaction
// committed though its commit failed: the COMMIT's answer was lost, or fn
// committed its work itself and began another transaction, the one that
// failed. Which of the two cannot be told, and neither is the handler's
// fault to look for (it is not ErrTxEnded); Permanent, as after fn's own
// COMMIT: the work is done, and a redelivery taking a new lease would do
// it again.
func recordNotConfirmed(err error) error {
	return amqpidem.Permanent(fmt.Errorf("pgstore: the handler's transaction committed, though its commit failed (its answer lost, or the handler committed its work itself and began another transaction); then its record could not be completed, so it is not run again: %w", err))
}

// errWorkUnknown is in the error of a run whose transaction ended (the
// handler ended it, or its connection closed) when the server could not
// tell whether it committed (ending): its work may be done, so it must not
// run again in place (a batch is not split and rerun); the record decides
// a redelivery.
var errWorkUnknown = errors.New("its work may have committed")

// connClosed is the error of a run whose connection closed before its
// commit, fn having returned ferr: nothing of the transaction committed.
// The store is the cause (lock.ErrUnavailable), unless ctx ended first
// (amqpidem reads why from the context) or fn's error is Permanent. A
// lease held by the transaction ended with it (lock.ErrLeaseLost too): the
// server ends a session idle in its transaction longer than the lease's
// TTL.
func connClosed(ctx context.Context, ferr error, held bool) error {
	switch {
	case ferr != nil && (ctx.Err() != nil || amqpidem.IsPermanent(ferr) || errors.Is(ferr, lock.ErrUnavailable)):
		return ferr
	case ferr == nil:
		ferr = errors.New("it closed before the commit")
	}
	if held {
		// The idle-in-transaction timeout is named only when the server
		// did not say why it ended the session (an administrator's
		// pg_terminate_backend is 57P01).
		why := " (the server ends one idle in its transaction longer than the lease's TTL)"
		if pe := (*pgconn.PgError)(nil); errors.As(ferr, &pe) && pe.Code != "25P03" {
			why = ""
		}
		return fmt.Errorf("%w: %w: the session holding the lease ended%s: %w",
			lock.ErrLeaseLost, lock.ErrUnavailable, why, ferr)
	}
	return fmt.Errorf("%w: the transaction's connection closed: %w", lock.ErrUnavailable, ferr)
}

// xactStatusSQL asks whether a transaction committed (committed); a
// variable so that a test can make the question fail.
var xactStatusSQL = "SELECT pg_xact_status($1::xid8) IS NOT DISTINCT FROM 'committed'"

// committed reports whether the transaction xid committed, asking on conn,
// or on a connection of the pool when conn is closed. An empty xid (none
// was taken) did not.
func (s *Store) committed(ctx context.Context, conn *pgx.Conn, xid string) (bool, error) {
	if xid == "" {
		return false, nil
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	q := xactStatusSQL
	var ok bool
	var err error
	if conn.IsClosed() {
		err = s.pool.QueryRow(cctx, q, xid).Scan(&ok)
	} else {
		err = conn.QueryRow(cctx, q, xid).Scan(&ok)
	}
	return ok, err
}

// run begins a transaction on a connection of the pool, with the
// handler's savepoint, runs fn in it, and commits it as ending decides:
// with lease's record completed with value(result) when lease is not nil
// (a record-row lease), else with no record. Anything else is rolled back.
func (h *txHandler) run(ctx context.Context, d *amqp.Delivery, lease *lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	// A connection of its own rather than pool.BeginTx: finishTx commits
	// with a statement the pgx.Tx does not see, after which that Tx would
	// send a ROLLBACK of its own to give the connection back.
	conn, err := h.s.pool.Acquire(ctx)
	var xid string
	var t *handlerTx
	if err == nil {
		t = &handlerTx{conn: conn.Conn(), pooled: conn}
		defer h.s.endConn(t)
		xid, err = h.s.begin(ctx, conn.Conn(), h.tx)
	}
	if err != nil {
		if ctx.Err() != nil {
			// The handler's context ended (a timeout, the lease lost,
			// shutdown): amqpidem reads why from the context.
			return nil, fmt.Errorf("pgstore: begin: %w", err)
		}
		return nil, fmt.Errorf("pgstore: begin: %w", classify(err))
	}
	result, ferr := callFn(func() ([]byte, error) { return h.fn(ctx, t, d) })
	end, err := h.s.ending(ctx, t, xid, ferr, false)
	if end == endFailed {
		return nil, err
	}
	// The record and the commit run even when ctx ended meanwhile: the
	// record's compare-and-set decides whether the work counts.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	var v []byte
	if lease != nil {
		if v, err = h.stored(*lease, result, value); err != nil {
			return nil, err
		}
	}
	switch {
	case end == endCommitted && lease != nil:
		if err = h.s.finish(cctx, t.querier(h.s), *lease, "complete", "c", v); err != nil {
			err = recordAfterCommit(err)
		}
	case end == endCommitted:
	case lease != nil:
		err = h.s.finishTx(cctx, conn.Conn(), xid, *lease, v)
		if err != nil && h.s.workCommitted(cctx, t, xid) {
			// Done, though the record's write and commit failed: as
			// after fn's own COMMIT, the record is completed on its own,
			// with a timeout of its own (a commit whose answer never
			// came used up cctx).
			fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
			defer fcancel()
			if err = h.s.finish(fctx, t.querier(h.s), *lease, "complete", "c", v); err != nil {
				err = recordNotConfirmed(err)
			}
		}
	default:
		err = commit(cctx, conn.Conn(), xid)
	}
	if err != nil {
		return nil, err
	}
	return result, nil
}

// begin begins a transaction on conn with o and the handler's savepoint,
// and returns its id, in one round trip.
func (s *Store) begin(ctx context.Context, conn *pgx.Conn, o txOptions) (string, error) {
	b := &pgx.Batch{}
	b.Queue(o.begin)
	b.Queue("SAVEPOINT " + savepoint)
	b.Queue("SELECT pg_current_xact_id()::text")
	br := conn.SendBatch(ctx, b)
	_, berr := br.Exec()
	_, serr := br.Exec()
	var xid string
	xerr := br.QueryRow().Scan(&xid)
	return xid, cmp.Or(berr, serr, xerr, br.Close())
}

// txGuardMark is in the message of txGuardSQL's error.
const txGuardMark = "amqpidem: not the transaction the handler was given"

// txGuardSQL goes first in every commit of a handler's work that fn
// left open (finishTx, commitHeld, finishBatch, commit), in the same round
// trip: it raises, so that the server skips the record's write and the
// COMMIT after it, unless the transaction open is $1, the one fn was
// given, or $1 committed (fn committed its work itself and began another,
// which then gets the record: see TxFunc). Otherwise fn ended $1 with a
// ROLLBACK (its own, or a library's given tx.Conn()) and began another
// transaction: its work was undone, and the message must not be completed
// in that other, empty one. It raises a cast's error (22P02, txGuardMark
// in its message), so that Migrate need not add a function; the cast's
// operand calls a volatile function, so that the server cannot evaluate
// it while planning. Its functions and types are named in pg_catalog, so
// that a handler's search_path cannot stand in for them.
const txGuardSQL = "SELECT CASE WHEN pg_catalog.pg_current_xact_id()::pg_catalog.text = $1 " +
	"OR pg_catalog.pg_xact_status($1::pg_catalog.xid8) IS NOT DISTINCT FROM 'committed' THEN true " +
	"ELSE ('" + txGuardMark + ": ' || pg_catalog.pg_current_xact_id()::pg_catalog.text)::pg_catalog.int4 > 0 END"

// isTxGuard reports whether err is txGuardSQL's.
func isTxGuard(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "22P02" && strings.Contains(pe.Message, txGuardMark)
}

// errTxRolledBack is the error of a run whose transaction fn rolled back
// itself and then began another (txGuardSQL): the guarded commit, of that
// other transaction, is skipped; what fn committed in between, if
// anything, is its own.
var errTxRolledBack = amqpidem.Permanent(fmt.Errorf("%w and rolled it back, then began another and returned no error: the work of the transaction it was given was undone, and the message is not completed", ErrTxEnded))

// commit commits the transaction on conn, which has no record, unless it
// is not xid (txGuardSQL).
func commit(ctx context.Context, conn *pgx.Conn, xid string) error {
	b := &pgx.Batch{}
	b.Queue(txGuardSQL, xid)
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	_, gerr := br.Exec()
	tag, err := br.Exec()
	err = cmp.Or(gerr, err, br.Close())
	switch {
	case isTxGuard(gerr):
		return errTxRolledBack
	case err != nil:
		return fmt.Errorf("pgstore: commit (its outcome may be unknown: the record tells): %w", classify(err))
	case tag.String() != "COMMIT":
		return fmt.Errorf("pgstore: commit answered %q: nothing committed", tag.String())
	}
	return nil
}
