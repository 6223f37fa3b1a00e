package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/lock"
)

// A lease held by a transaction (TxHandler's AcquireLease, see the package
// documentation): acquire_held takes the key's transaction-level advisory
// lock in a transaction that stays open on one pooled connection until the
// lease ends, and the record is written once, with the outcome, by
// finish_held. Between AcquireLease and the call that ends the lease
// (HandleComplete, Complete, Fail, Release or Cancel) the transaction waits
// in Store.held, under the lease's owner token.

// errTxEnded says that the handler ended the transaction that held its
// lease (a COMMIT or ROLLBACK statement of its own).
var errTxEnded = errors.New("the handler ended the transaction holding the lease (a COMMIT or ROLLBACK of its own)")

// heldMark is the first byte of the owner token of a lease held by a
// transaction; other owner tokens are hex digits.
const heldMark = 't'

// savepoint is where the handler's work begins in a held transaction: an
// outcome other than completed is written after rolling back to it.
const savepoint = "amqpidem_handler"

// heldTx is a transaction that holds a lease, or, with no conn, what is
// left of one whose completion failed: the fingerprint, for the outcome
// written next.
type heldTx struct {
	conn *pgxpool.Conn
	tx   *handlerTx // the handler's
	fp   []byte     // the request's fingerprint, for the record
	xid  string     // the transaction's id (pg_current_xact_id)
	// guard ends the transaction if nothing took it within the lease's
	// TTL (a bug: amqpidem always ends the leases it gets).
	guard *time.Timer
}

// isHeld reports whether l is held by a transaction.
func isHeld(l lock.Lease) bool { return l.Owner != "" && l.Owner[0] == heldMark }

// acquireHeld takes a lease on req.Key held by a transaction that it begins
// (with Config.TxOptions), in one round trip: BEGIN, acquire_held, and the
// SAVEPOINT the handler's work begins at. A key that is busy or answered by
// its record costs one more, the ROLLBACK; a key whose record counts
// attempts is taken by Acquire instead. Its failures are not retried: a transaction
// whose outcome is unknown ended with its connection, holding nothing.
func (s *Store) acquireHeld(ctx context.Context, req lock.Request) (lock.Result, error) {
	req, err := s.cfg.CheckRequest(req)
	if err != nil {
		return lock.Result{}, err
	}
	start := s.cfg.Now()
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return lock.Result{}, fmt.Errorf("pgstore: acquire %q: %w", req.Key, classify(err))
	}
	var status, attempts int
	var fence, remaining int64
	var value []byte
	var xid *string
	b := &pgx.Batch{}
	b.Queue(s.sql.begin)
	b.Queue(s.sql.acquireHeld, s.cfg.Prefix, []byte(req.Key), req.TTL.Milliseconds(), []byte(req.Fingerprint))
	b.Queue("SAVEPOINT " + savepoint)
	br := conn.SendBatch(ctx, b)
	_, berr := br.Exec()
	qerr := br.QueryRow().Scan(&status, &fence, &attempts, &remaining, &value, &xid)
	_, serr := br.Exec()
	if err := cmp.Or(berr, qerr, serr, br.Close()); err != nil {
		s.endConn(conn)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && notMigrated[pe.Code] {
			// Not migrated for this release yet (a rolling upgrade):
			// the record-row lease of the earlier one, while Check says
			// to run Migrate.
			return s.Acquire(ctx, req)
		}
		return lock.Result{}, fmt.Errorf("pgstore: acquire %q: %w", req.Key, classify(err))
	}
	if status != int(lock.Acquired) {
		s.endConn(conn)
		if status == statusCounted {
			return s.Acquire(ctx, req)
		}
		return s.result(req, status, fence, attempts, remaining, value, "", start)
	}
	owner := lock.NewOwner()
	owner = string(heldMark) + owner[1:]
	res, err := s.result(req, status, fence, attempts, remaining, value, owner, start)
	if err != nil {
		s.endConn(conn)
		return res, err
	}
	h := &heldTx{conn: conn, tx: &handlerTx{conn: conn.Conn()}, fp: []byte(req.Fingerprint)}
	if xid != nil {
		h.xid = *xid
	}
	s.putHeld(res.Lease, h)
	return res, nil
}

// statusCounted is acquire_held's answer for a key whose record counts
// attempts: Acquire takes it.
const statusCounted = 6

// putHeld keeps h, the transaction holding l, until a call takes it, or
// until the guard ends it after l's TTL.
func (s *Store) putHeld(l lock.Lease, h *heldTx) {
	h.guard = time.AfterFunc(l.TTL, func() {
		if s.held.CompareAndDelete(l.Owner, h) && h.conn != nil {
			s.cfg.Logger.Warn("pgstore: a lease held by a transaction was not ended within its TTL; rolled back",
				"key", l.Key, "fence", l.Fence)
			s.endConn(h.conn)
		}
	})
	s.held.Store(l.Owner, h)
	if s.closed.Load() {
		// Close has run: nothing may stay held (see Close).
		if h := s.takeHeld(l.Owner); h != nil && h.conn != nil {
			h.conn.Release()
		}
	}
}

// takeHeld returns the transaction holding the lease of owner and forgets
// it, or nil when none waits (it ended).
func (s *Store) takeHeld(owner string) *heldTx {
	v, ok := s.held.LoadAndDelete(owner)
	if !ok {
		return nil
	}
	h := v.(*heldTx)
	h.guard.Stop()
	return h
}

// endConn rolls back what conn holds, if anything, and gives it back to the
// pool (which closes it if it could not be rolled back).
func (s *Store) endConn(conn *pgxpool.Conn) {
	if pc := conn.Conn().PgConn(); !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() != 'I' {
		ctx, cancel := context.WithTimeout(context.Background(), commitTimeout)
		_, _ = conn.Exec(ctx, "ROLLBACK")
		cancel()
	}
	conn.Release()
}

// endHeld ends the held lease l with the outcome state ('c', 'f', 'r'; op
// names the call) and value, or with none for "x" (cancelled: nothing was
// written, so the attempt is not counted). The transaction that holds l,
// if one still does, is rolled back to the handler's savepoint unless the
// outcome is completed, and finish_held and COMMIT run in it, in one round
// trip. Once it ended (its handler failed there, or its connection
// closed), finish_held runs alone: it writes the outcome if no other
// holder came meanwhile.
func (s *Store) endHeld(ctx context.Context, l lock.Lease, op, state string, value []byte) error {
	h := s.takeHeld(l.Owner)
	if state == "x" {
		if h != nil && h.conn != nil {
			s.endConn(h.conn)
		}
		return nil
	}
	fp := []byte{}
	if h != nil {
		fp = h.fp
	}
	if h != nil && h.conn != nil {
		err := s.commitHeld(ctx, h, l, op, state, value)
		closed := h.conn.Conn().IsClosed()
		s.endConn(h.conn)
		if err == nil || errors.Is(err, lock.ErrLeaseLost) || !closed && !errors.Is(err, errTxEnded) {
			return err
		}
		// The connection closed (the server ended an idle holder's
		// session, say), or the handler ended the transaction: nothing of
		// it committed, or this same outcome did, which finish_held alone
		// finds.
	}
	_, err := s.pool.Exec(ctx, s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, state, value,
		l.Retention.Milliseconds(), fp)
	return s.heldError(op, l, err)
}

// commitHeld writes l's outcome in h and commits: finish_held and COMMIT in
// one round trip, after a rollback to the handler's savepoint unless the
// outcome is completed. The caller gives h's connection back (endConn).
func (s *Store) commitHeld(ctx context.Context, h *heldTx, l lock.Lease, op, state string, value []byte) error {
	if err := lock.CheckLease(l); err != nil {
		return err
	}
	if h.conn.Conn().PgConn().TxStatus() == 'I' {
		// Ended by a statement of the handler's own (COMMIT, ROLLBACK),
		// and the lock with it. A completion is written only if the
		// handler's writes committed: else they would be lost, and if
		// they did, running it again would repeat them.
		if state == "c" {
			var status string
			err := h.conn.QueryRow(ctx, "SELECT pg_xact_status($1::xid8)", h.xid).Scan(&status)
			if err == nil && status == "committed" {
				_, err := h.conn.Exec(ctx, s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, state, value,
					l.Retention.Milliseconds(), h.fp)
				return s.heldError(op, l, err)
			}
		}
		return fmt.Errorf("pgstore: %s %q: %w", op, l.Key, errTxEnded)
	}
	b := &pgx.Batch{}
	if state != "c" {
		b.Queue("ROLLBACK TO SAVEPOINT " + savepoint)
	}
	b.Queue(s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, state, value,
		l.Retention.Milliseconds(), h.fp)
	b.Queue("COMMIT")
	br := h.conn.SendBatch(ctx, b)
	var rerr error
	if state != "c" {
		_, rerr = br.Exec()
	}
	_, ferr := br.Exec()
	tag, cerr := br.Exec()
	err := cmp.Or(rerr, ferr, cerr, br.Close())
	var pe *pgconn.PgError
	switch {
	case err == nil && tag.String() != "COMMIT":
		return fmt.Errorf("pgstore: commit of %q answered %q: nothing committed", l.Key, tag.String())
	case err == nil:
		return nil
	case cmp.Or(rerr, ferr) != nil && errors.As(cmp.Or(rerr, ferr), &pe):
		// The server refused the outcome (the lease lost, the schema not
		// migrated): the COMMIT was skipped, nothing committed.
		return s.heldError(op, l, cmp.Or(rerr, ferr))
	default:
		return fmt.Errorf("pgstore: commit (its outcome may be unknown: the record tells): %w", classify(err))
	}
}

// heldError is the error of finish_held's answer err for the call op of l:
// nil, lock.ErrLeaseLost where it raised leaseLostCode, else classified.
func (s *Store) heldError(op string, l lock.Lease, err error) error {
	var pe *pgconn.PgError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &pe) && pe.Code == leaseLostCode:
		return fmt.Errorf("%w: %s key %q fence %d", lock.ErrLeaseLost, op, l.Key, l.Fence)
	default:
		return fmt.Errorf("pgstore: %s %q: %w", op, l.Key, classify(err))
	}
}

// beginSQL is the statement that begins a transaction with o, as pgx
// renders it.
func beginSQL(o pgx.TxOptions) string {
	if o.BeginQuery != "" {
		return o.BeginQuery
	}
	var b strings.Builder
	b.WriteString("BEGIN")
	if o.IsoLevel != "" {
		b.WriteString(" ISOLATION LEVEL " + string(o.IsoLevel))
	}
	if o.AccessMode != "" {
		b.WriteString(" " + string(o.AccessMode))
	}
	if o.DeferrableMode != "" {
		b.WriteString(" " + string(o.DeferrableMode))
	}
	return b.String()
}
