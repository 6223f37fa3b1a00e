package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/lock"
)

// A lease held by a transaction (TxHandler's AcquireLease, see the package
// documentation): acquireHeld takes the key's transaction-level advisory
// lock in a transaction that stays open on one pooled connection until the
// lease ends, and the record is written once, with the outcome, by a plain
// INSERT in that transaction (commitHeld), or by finish_held once the
// transaction ended without it (endHeld). Between AcquireLease and the
// call that ends the lease (HandleComplete, Complete, Fail, Release or
// Cancel) the transaction waits in Store.held, under the lease's owner
// token.

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
	// insert is heldSQL.insert, for the outcome.
	insert string
	// guard ends the transaction if nothing took it within the lease's
	// TTL (a bug: amqpidem always ends the leases it gets).
	guard *time.Timer
}

// isHeld reports whether l is held by a transaction.
func isHeld(l lock.Lease) bool { return l.Owner != "" && l.Owner[0] == heldMark }

// acquireHeld takes a lease on req.Key held by a transaction that it begins
// (with Config.TxOptions), in one round trip: BEGIN, the key's advisory
// lock, the record, and the SAVEPOINT the handler's work begins at
// (heldStatements). A key that is busy or answered by its record costs one
// more, the ROLLBACK; a key whose record counts attempts is taken by
// Acquire instead, and so is every key while the database has no
// held_key (not migrated by this release). Its failures are not
// retried: a transaction whose outcome is unknown ended with its
// connection, holding nothing.
func (s *Store) acquireHeld(ctx context.Context, req lock.Request) (lock.Result, error) {
	req, err := s.cfg.CheckRequest(req)
	if err != nil {
		return lock.Result{}, err
	}
	if lvl := s.cfg.TxOptions.IsoLevel; lvl != "" && lvl != pgx.ReadCommitted {
		// Known here: see the isolation check below.
		return s.Acquire(ctx, req)
	}
	hs, err := s.heldStatements(ctx)
	if err != nil {
		return lock.Result{}, fmt.Errorf("pgstore: acquire %q: %w", req.Key, classify(err))
	}
	if hs == nil {
		return s.Acquire(ctx, req)
	}
	start := s.cfg.Now()
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return lock.Result{}, fmt.Errorf("pgstore: acquire %q: %w", req.Key, classify(err))
	}
	var (
		locked, readCommitted *bool
		xid                   *string
		rec                   heldRecord
	)
	key := []byte(req.Key)
	b := &pgx.Batch{}
	b.Queue(s.sql.begin)
	b.Queue(hs.lock, s.cfg.Prefix, key, strconv.FormatInt(req.TTL.Milliseconds(), 10))
	b.Queue(hs.read, s.cfg.Prefix, key)
	b.Queue("SAVEPOINT " + savepoint)
	br := conn.SendBatch(ctx, b)
	_, berr := br.Exec()
	lerr := br.QueryRow().Scan(&locked, &xid, &readCommitted)
	rerr := br.QueryRow().Scan(&rec.state, &rec.fence, &rec.attempts, &rec.value, &rec.fp, &rec.live, &rec.remaining, &rec.clock)
	_, serr := br.Exec()
	if err := cmp.Or(berr, lerr, rerr, serr, br.Close()); err != nil {
		s.endConn(conn)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && notMigrated[pe.Code] {
			// The table went away since heldStatements found it: ask
			// again next time; Acquire says what is missing.
			s.heldSQL.Store(nil)
			return s.Acquire(ctx, req)
		}
		return lock.Result{}, fmt.Errorf("pgstore: acquire %q: %w", req.Key, classify(err))
	}
	// Under a level above READ COMMITTED (the server's default, when
	// Config.TxOptions sets none), the transaction's snapshot is the
	// lock's statement's: the record read after the lock could miss a
	// lease committed just before it. A record-row lease instead.
	status, fence, attempts, remaining, value := rec.status(req, locked != nil && *locked)
	if readCommitted == nil || !*readCommitted {
		status = statusCounted
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
	h := &heldTx{conn: conn, tx: &handlerTx{conn: conn.Conn()}, fp: []byte(req.Fingerprint), insert: hs.insert}
	if xid != nil {
		h.xid = *xid
	}
	s.putHeld(res.Lease, h)
	return res, nil
}

// heldRecord is the key's record as acquireHeld reads it after the lock,
// every field nil when there is none. live: not past its retention;
// remaining: of a lease's deadline, ms; clock: the server's clock, µs,
// a new lease's fence.
type heldRecord struct {
	state     *string
	fence     *int64
	attempts  *int
	value, fp []byte
	live      *bool
	remaining *int64
	clock     int64
}

// status is acquireHeld's answer for the record r, with locked telling
// whether this transaction holds the key's advisory lock: as Acquire
// answers (lock.Status), or statusCounted where Acquire must take the key:
// its record counts attempts (released, cancelled, a lease past its
// deadline), or is past its retention and not yet deleted (a new record
// replaces it, which commitHeld's INSERT cannot).
func (r heldRecord) status(req lock.Request, locked bool) (status int, fence int64, attempts int, remaining int64, value []byte) {
	switch {
	case r.state == nil && locked:
		return int(lock.Acquired), r.clock, 1, req.TTL.Milliseconds(), nil
	case r.state == nil || !*r.live && !locked:
		// Another transaction holds the lock.
		return int(lock.InProgress), 0, 0, req.TTL.Milliseconds(), nil
	case !*r.live:
		return statusCounted, 0, 0, 0, nil
	}
	fence, attempts = *r.fence, *r.attempts
	switch {
	case len(req.Fingerprint) > 0 && len(r.fp) > 0 && string(r.fp) != req.Fingerprint:
		return int(lock.Conflict), fence, attempts, 0, nil
	case *r.state == "c":
		return int(lock.Completed), fence, attempts, 0, r.value
	case *r.state == "f":
		return int(lock.Failed), fence, attempts, 0, r.value
	case *r.state == "p" && r.remaining != nil && *r.remaining > 0:
		return int(lock.InProgress), fence, attempts, *r.remaining, nil
	}
	return statusCounted, fence, attempts, 0, nil
}

// statusCounted is heldRecord.status's answer for a key that Acquire
// takes.
const statusCounted = 6

// heldSQL are the statements of leases held by transactions, on the
// records table named in full (schema included), so that a handler's SET
// search_path cannot point them at another table.
type heldSQL struct {
	// lock answers whether the transaction took the key's advisory lock
	// (NULL: not tried, a live record is there), then the transaction's
	// id when it did, and whether its isolation is READ COMMITTED. With
	// the lock it sets the transaction's idle_in_transaction_session_timeout
	// to the lease's TTL: a holder that stops talking to the server
	// (paused, cut off) loses its session, its transaction and the lock
	// with them.
	lock string
	// read is the record, read after the lock by a statement of its own
	// (a snapshot of its own, under READ COMMITTED): another holder may
	// have finished in between. One row, NULLs when there is none.
	read string
	// insert writes the outcome as a new record (see commitHeld).
	insert string
}

// heldRetry is how long acquireHeld takes record-row leases after finding
// the database not migrated by this release, before it looks again (a
// variable for the tests).
var heldRetry = time.Minute

// heldStatements returns the statements of leases held by transactions,
// or nil while the database lacks what they need (held_key, and the
// table): then every lease is a record row. They call held_key as the
// other calls of the Store call the functions, and name the table in the
// schema where that held_key is, the migration's, which is asked of the
// server once.
func (s *Store) heldStatements(ctx context.Context) (*heldSQL, error) {
	if hs := s.heldSQL.Load(); hs != nil {
		return hs, nil
	}
	if t := s.heldMissing.Load(); t != nil && time.Since(*t) < heldRetry {
		return nil, nil
	}
	n := s.cfg.names()
	var table *string
	err := s.pool.QueryRow(ctx, `SELECT t.name FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace,
			format('%I.%I', n.nspname, $2::text) AS t(name)
		WHERE p.oid = to_regprocedure($1) AND to_regclass(t.name) IS NOT NULL`,
		n.heldKey+"(text, bytea)", s.cfg.Table).Scan(&table)
	switch {
	case errors.Is(err, pgx.ErrNoRows) || err == nil && table == nil:
		now := time.Now()
		s.heldMissing.Store(&now)
		return nil, nil
	case err != nil:
		return nil, err
	}
	hs := newHeldSQL(*table, heldLockClass+", "+n.heldKey+"($1, $2)")
	s.heldSQL.Store(hs)
	return hs, nil
}

// newHeldSQL returns the statements of leases held by transactions on the
// records table (its full name, quoted), with lockKey the SQL of the key's
// advisory lock of $1 (namespace) and $2 (key), the one the functions try
// (held_key).
func newHeldSQL(table, lockKey string) *heldSQL {
	return &heldSQL{
		// A subquery of its own, so that the lock is tried once (a
		// volatile expression is not pulled up into the outer query).
		lock: `SELECT s.locked, CASE WHEN s.locked THEN pg_current_xact_id()::text END,
				current_setting('transaction_isolation') = 'read committed'
			FROM (SELECT CASE WHEN EXISTS (SELECT FROM ` + table + ` t
					WHERE t.ns = $1 AND t.key = $2 AND t.expires_at > clock_timestamp()) THEN NULL
				WHEN pg_try_advisory_xact_lock(` + lockKey + `)
					THEN set_config('idle_in_transaction_session_timeout', $3::text, true) IS NOT NULL
				ELSE false END AS locked) s`,
		read: `SELECT t.state, t.fence, t.attempts, t.value, t.fingerprint, t.expires_at > clock_timestamp(),
				ceil(extract(epoch FROM t.deadline - clock_timestamp()) * 1000)::bigint, ` + clockUS + `
			FROM (SELECT) one LEFT JOIN ` + table + ` t ON t.ns = $1 AND t.key = $2`,
		insert: `INSERT INTO ` + table + ` (ns, key, state, owner, fence, deadline, attempts, fingerprint,
				value, created_at, ended_at, expires_at)
			VALUES ($1, $2, $3, $4, $5, NULL, 1, $6, $7, clock_timestamp(), clock_timestamp(),
				clock_timestamp() + $8::bigint * interval '1 millisecond')`,
	}
}

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
// outcome is completed, and the record's INSERT and COMMIT run in it, in
// one round trip (commitHeld). Once it ended (its handler failed there, or its connection
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

// commitHeld writes l's outcome in h and commits: the record's INSERT and
// COMMIT in one round trip, after a rollback to the handler's savepoint
// unless the outcome is completed. The key's lock is h's since the
// acquire, which found no record: nobody else can have written one
// (Acquire tries the lock too), and the INSERT, with no ON CONFLICT,
// would fail if someone had. The caller gives h's connection back
// (endConn).
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
	b.Queue(h.insert, s.cfg.Prefix, []byte(l.Key), state, l.Owner, l.Fence, h.fp, value, l.Retention.Milliseconds())
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
	case ferr != nil && errors.As(ferr, &pe) && pe.Code == uniqueViolation:
		// A record is there that this lease did not write: someone wrote
		// it without the key's lock (an earlier release's Migrate ran
		// after this one's, say). The COMMIT was skipped, nothing
		// committed.
		return fmt.Errorf("%w: %s key %q fence %d: %s", lock.ErrLeaseLost, op, l.Key, l.Fence, pe.Message)
	case cmp.Or(rerr, ferr) != nil && errors.As(cmp.Or(rerr, ferr), &pe):
		// The server refused the outcome (the schema changed under it,
		// say): the COMMIT was skipped, nothing committed.
		return s.heldError(op, l, cmp.Or(rerr, ferr))
	default:
		return fmt.Errorf("pgstore: commit (its outcome may be unknown: the record tells): %w", classify(err))
	}
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
