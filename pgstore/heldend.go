package pgstore

// How a lease held by a transaction ends (held.go): its outcome written
// and committed on the transaction's session, or its session closed.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/amqpidem/amqpidem/lock"
)

// endHeld ends the held lease l with the outcome state ('c', 'f', 'r'; op
// names the call) and value, or with none for "x" (cancelled: nothing was
// written, so the attempt is not counted), with finishHeld.
func (s *Store) endHeld(ctx context.Context, l lock.Lease, op, state string, value []byte) error {
	h := s.takeHeld(l.Owner)
	if h == nil {
		h = &heldTx{fp: []byte{}}
	}
	if state == "x" {
		if h.conn != nil || h.batch != nil {
			s.endHeldConn(h)
		}
		return nil
	}
	var err error
	if h.batch != nil {
		err = s.finishMember(ctx, h, l, op, state, value)
	} else {
		err = s.finishHeld(ctx, h, l, op, state, value)
	}
	if err != nil && !errors.Is(err, lock.ErrLeaseLost) {
		s.putHeld(l, &heldTx{fp: h.fp}) // for the call's retry
	}
	return err
}

// finishHeld writes the outcome state of the held lease l and ends what is
// left of its transaction h. While h's transaction is open, the outcome is
// written and committed in it (commitHeld); once the handler ended it, on
// the same session, under the key's session-level lock (finishHeldOn).
// Once the session ended (the server ended it, say: nothing of its
// transaction committed), finish_held runs on a connection of the pool: it
// writes the outcome if no other holder came meanwhile. When the outcome
// went out on the session and the session ended before its answer came
// back, the outcome is unknown: it may have committed, and a later lease
// taken its record over before finish_held looked. Then finish_held's
// "lease lost" is not an answer (the outcome may be written), and the
// error is the lost answer's, lock.ErrUnavailable.
func (s *Store) finishHeld(ctx context.Context, h *heldTx, l lock.Lease, op, state string, value []byte) error {
	var unanswered error // the outcome sent on h's session, its answer lost
	if h.conn != nil {
		pc := h.conn.Conn().PgConn()
		usable := !pc.IsClosed() && !pc.IsBusy()
		var err error
		switch {
		case !usable:
		case pc.TxStatus() == 'I':
			err = s.finishHeldOn(ctx, h, l, op, state, value)
		default:
			err = s.commitHeld(ctx, h, l, op, state, value)
		}
		closed := pc.IsClosed()
		s.endHeldConn(h)
		if usable && (!closed || err == nil) {
			return err
		}
		if usable {
			unanswered = err
		}
	}
	s.awaitSessionEnd(ctx, l)
	_, err := s.pool.Exec(ctx, s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, state, value,
		l.Retention.Milliseconds(), h.fp)
	err = s.heldError(op, l, err)
	if unanswered != nil && errors.Is(err, lock.ErrLeaseLost) {
		return unanswered
	}
	return err
}

// awaitSessionEnd waits, up to a second, until the backend that held l
// no longer holds its key's lock: a session the server ended (terminated,
// or idle past the lease) or whose connection closed releases its locks
// only once its backend has exited, a moment later, and finish_held
// would find the key busy until then and write nothing.
func (s *Store) awaitSessionEnd(ctx context.Context, l lock.Lease) {
	pid, ok := heldPID(l.Owner)
	hs := s.heldSQL.Load()
	if !ok || hs == nil {
		return
	}
	for range 50 {
		live, err := s.liveHeld(ctx, hs, [][]byte{[]byte(l.Key)}, []int32{int32(pid)})
		if err != nil || !live[l.Key] {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// finishHeldOn writes l's outcome with finish_held on the session of h,
// whose transaction the handler ended, under the key's session-level lock,
// then releases that lock, in one round trip. (Through a pooler in
// transaction mode, these may reach another server session than the one
// holding the lock: see "Writing a TxHandler" in the package
// documentation.) The caller gives h's connection back (endHeldConn).
func (s *Store) finishHeldOn(ctx context.Context, h *heldTx, l lock.Lease, op, state string, value []byte) error {
	if err := lock.CheckLease(l); err != nil {
		return err
	}
	b := &pgx.Batch{}
	b.Queue(s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, state, value, l.Retention.Milliseconds(), h.fp)
	b.Queue(h.hs.unlock, s.cfg.Prefix, h.key)
	br := h.conn.SendBatch(ctx, b)
	_, ferr := br.Exec()
	_, uerr := br.Exec()
	err := cmp.Or(ferr, br.Close())
	if err == nil && uerr == nil {
		h.locked = false
	}
	return s.heldError(op, l, ferr)
}

// commitHeld writes l's outcome state ('c', 'f', 'r'; op names the call)
// with value in h's transaction and commits it: after a rollback to the
// handler's savepoint unless the outcome is completed, the record's
// INSERT, which releases the key's session-level lock (its
// transaction-level one lasts to the COMMIT), and the COMMIT, in one round
// trip (two for a transaction a failed statement aborted: its rollback to
// the savepoint goes first, on its own, since the server prepares nothing
// else in it). The key's lock is h's since the acquire, which found no
// record: nobody else can have written one (Acquire tries the lock too),
// and the INSERT, with no ON CONFLICT, would fail if someone had. The
// caller gives h's connection back (endHeldConn).
func (s *Store) commitHeld(ctx context.Context, h *heldTx, l lock.Lease, op, state string, value []byte) error {
	if err := lock.CheckLease(l); err != nil {
		return err
	}
	rollback := state != "c"
	if rollback && h.conn.Conn().PgConn().TxStatus() == 'E' {
		if _, err := h.conn.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepoint); err != nil {
			return fmt.Errorf("pgstore: %s %q: rollback of the handler's work: %w", op, l.Key, classify(err))
		}
		rollback = false
	}
	b := &pgx.Batch{}
	if rollback {
		b.Queue("ROLLBACK TO SAVEPOINT " + savepoint)
	}
	// A completion only: a failure or a release rolls back to the
	// savepoint, which a transaction fn began itself does not have.
	guard := state == "c" && h.xid != ""
	if guard {
		b.Queue(txGuardSQL, h.xid)
	}
	b.Queue(h.hs.insert, s.cfg.Prefix, []byte(l.Key), state, l.Owner, l.Fence, h.fp, value, l.Retention.Milliseconds())
	b.Queue("COMMIT")
	br := h.conn.SendBatch(ctx, b)
	var rerr, gerr error
	if rollback {
		_, rerr = br.Exec()
	}
	if guard {
		_, gerr = br.Exec()
		rerr = cmp.Or(rerr, gerr)
	}
	_, ierr := br.Exec()
	tag, cerr := br.Exec()
	cerr = cmp.Or(cerr, br.Close())
	if rerr == nil && ierr == nil {
		h.locked = false
	}
	var pe *pgconn.PgError
	werr := cmp.Or(rerr, ierr) // before the COMMIT: the server skipped it
	switch {
	case isTxGuard(gerr):
		return errTxRolledBack
	case ierr != nil && errors.As(ierr, &pe) && pe.Code == uniqueViolation:
		// A record is there that this lease did not write: someone wrote
		// it without the key's lock (an earlier release's Migrate ran
		// after this one's, say). Nothing committed.
		return fmt.Errorf("%w: %s key %q fence %d: %s", lock.ErrLeaseLost, op, l.Key, l.Fence, pe.Message)
	case werr != nil && errors.As(werr, &pe):
		// The server refused the outcome (the schema changed under it,
		// say): nothing committed.
		return s.heldError(op, l, werr)
	case cmp.Or(werr, cerr) != nil:
		return fmt.Errorf("pgstore: commit (its outcome may be unknown: the record tells): %w", classify(cmp.Or(werr, cerr)))
	case tag.String() != "COMMIT":
		return fmt.Errorf("pgstore: commit of %q answered %q: nothing committed", l.Key, tag.String())
	}
	return lostAnswer()
}

// uniqueViolation is the SQLSTATE of an INSERT that found its key taken.
const uniqueViolation = "23505"

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
