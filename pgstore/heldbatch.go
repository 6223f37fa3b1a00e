package pgstore

// Lease batches held by a session (BatchTxHandler's AcquireLeaseBatch):
// the leases of a batch taken in one round trip on one pooled connection,
// as session-level advisory locks in the lock space of held.go, and the
// batch's records written once, with the outcome, in the transaction of
// its work (one commit per batch).
//
// The session is kept in a transaction (the one the next run uses, begun
// with the lease, or again after each run) while it holds a lock of the
// batch: the transaction's idle_in_transaction_session_timeout, the
// leases' TTL, ends the session of a holder that stops talking to the
// server (paused, cut off), and its locks with it, as for a single held
// lease. One run or end at a time uses the connection (heldBatch.mu). The
// connection goes back to the pool, its locks released, once every lease
// of the batch ended; a connection that cannot be made clean is closed
// (the server then releases its locks).

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// heldBatch is a lease batch held by the session of conn: its members
// wait in Store.held as heldTx values with batch set (the key and the
// fingerprint), each under its lease's owner token.
type heldBatch struct {
	s   *Store
	hs  *heldSQL
	ttl time.Duration // the leases' (the longest), the idle timeout

	mu   sync.Mutex
	conn *pgxpool.Conn // nil once given back or closed
	// xid is the transaction open on conn (with the handler's savepoint)
	// that no run used yet, "" when none is.
	xid string
	// locked are the keys whose session-level lock the session holds.
	locked map[string]bool
	// members counts the leases not yet ended.
	members int
	// committed are the owners of leases whose records the run being
	// made committed, and fps the fingerprints of its members, by owner
	// (runHeld).
	committed map[string]bool
	fps       map[string][]byte

	// running is set while a run has its members (runHeld, after taking
	// them), and lastRun is when the last run ended (UnixNano): the
	// members waiting meanwhile for another part of a split batch are
	// the run's to end, not their guard's (busy).
	running atomic.Bool
	lastRun atomic.Int64
}

// busy reports whether a run of b is going on, or ended within the
// leases' TTL: amqpidem is working through the batch's parts, and ends
// each member waiting for its part itself.
func (b *heldBatch) busy() bool {
	return b.running.Load() || time.Since(time.Unix(0, b.lastRun.Load())) < b.ttl
}

// AcquireLeaseBatch takes the leases of reqs (amqpidem.BatchLeaseTaker):
// held by the session of one pooled connection (acquireHeldBatch), or,
// when one of them cannot be (a redelivered delivery, a key twice, a key
// whose record counts attempts: a retry), all of them record-row leases
// (Store.AcquireBatch): a lease batch is never part held, part record
// rows. With Config.RowLeases, an isolation level above READ COMMITTED,
// or a pool with no more than one connection free, every lease is a
// record row.
func (h *batchTxHandler) AcquireLeaseBatch(ctx context.Context, reqs []lock.Request, ds []*amqp.Delivery) ([]lock.Result, []error) {
	s := h.s
	lvl := h.tx.opts.IsoLevel
	st := s.pool.Stat()
	if s.cfg.RowLeases || lvl != "" && lvl != pgx.ReadCommitted || st.AcquiredConns()+1 >= st.MaxConns() {
		return s.AcquireBatch(ctx, reqs)
	}
	results := make([]lock.Result, len(reqs))
	errs := make([]error, len(reqs))
	var held, rows []int
	seen := make(map[string]bool, len(reqs))
	for i := range reqs {
		req, err := s.cfg.CheckRequest(reqs[i])
		switch {
		case err != nil:
			errs[i] = err
			continue
		case (i < len(ds) && ds[i] != nil && ds[i].Redelivered) || seen[req.Key] || req.TTL > maxIdleTimeout:
			rows = append(rows, i)
		default:
			held = append(held, i)
		}
		seen[req.Key] = true
		reqs[i] = req
	}
	// A lease batch is held by one session whole, or not at all: a run
	// batch is one lease batch (amqpidem), and a run of held and
	// record-row leases together would be two transactions, two parts
	// that fail and commit apart.
	switch {
	case len(held) > 0 && len(rows) == 0:
		rows = s.acquireHeldBatch(ctx, reqs, held, results, errs)
	default:
		rows = append(rows, held...)
	}
	if len(rows) > 0 {
		slices.Sort(rows)
		sub := make([]lock.Request, len(rows))
		for j, i := range rows {
			sub[j] = reqs[i]
		}
		rs, es := s.AcquireBatch(ctx, sub)
		for j, i := range rows {
			results[i], errs[i] = rs[j], es[j]
		}
	}
	return results, errs
}

// acquireHeldBatch takes the leases of reqs[i], i in idx (checked, keys
// unique), held by the session of one pooled connection, in one round
// trip: BEGIN, the transaction's settings, the keys' session-level locks
// (batchLock), their records (batchRead) and the handler's savepoint. It
// sets results[i] and errs[i], and returns the indexes of the keys that
// Acquire must take (their records count attempts, or the database is not
// ready for held leases). Keys not acquired are unlocked in one more
// round trip, in the transaction.
func (s *Store) acquireHeldBatch(ctx context.Context, reqs []lock.Request, idx []int, results []lock.Result, errs []error) (counted []int) {
	ctx, cancel := bounded(ctx)
	defer cancel()
	fail := func(err error) []int {
		err = fmt.Errorf("pgstore: acquire batch of %d: %w", len(idx), classify(err))
		for _, i := range idx {
			errs[i] = err
		}
		return nil
	}
	hs, err := s.heldStatements(ctx)
	if err != nil {
		return fail(err)
	}
	if hs == nil {
		return idx
	}
	idx = slices.Clone(idx)
	slices.SortFunc(idx, func(a, b int) int { return cmp.Compare(reqs[a].Key, reqs[b].Key) })
	keys := keyBytes(len(idx), func(j int) string { return reqs[idx[j]].Key })
	var ttl time.Duration
	for _, i := range idx {
		ttl = max(ttl, reqs[i].TTL)
	}
	start := s.cfg.Now()
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return fail(err)
	}
	var (
		xid           string
		readCommitted bool
		pid           uint32
	)
	// got: the key's lock taken (every key's unless batchLock answers
	// it); recs: the keys' records, none unless batchRead answers one.
	got := make([]bool, len(idx))
	for j := range got {
		got[j] = true
	}
	recs := make([]heldRecord, len(idx))
	b := &pgx.Batch{}
	b.Queue(s.sql.begin)
	b.Queue(hs.batchSetup, strconv.FormatInt(ttl.Milliseconds(), 10))
	b.Queue(hs.batchLock, s.cfg.Prefix, byteaArray(keys))
	b.Queue(hs.batchRead, s.cfg.Prefix, byteaArray(keys))
	b.Queue("SAVEPOINT " + savepoint)
	br := conn.SendBatch(ctx, b)
	_, berr := br.Exec()
	var ok bool
	serr := br.QueryRow().Scan(&xid, &ok, &readCommitted, &pid)
	var (
		n      pgtype.Int8
		locked pgtype.Bool
		rec    heldRecord
	)
	lerr := scanEach(br, []any{&n, &locked}, func() error {
		if !n.Valid || n.Int64 < 1 || n.Int64 > int64(len(idx)) || locked.Valid && locked.Bool {
			return fmt.Errorf("pgstore: lock of a batch of %d answered key %d locked %v", len(idx), n.Int64, locked.Bool)
		}
		got[n.Int64-1] = false
		return nil
	})
	var clock int64
	clocked := false
	rerr := scanEach(br, []any{&n, &rec.state, &rec.fence, &rec.attempts, &rec.value, &rec.fp, &rec.live, &rec.remaining, &rec.clock}, func() error {
		clock, clocked = rec.clock, true
		if !n.Valid {
			return nil
		}
		if n.Int64 < 1 || n.Int64 > int64(len(idx)) || recs[n.Int64-1].state != nil || rec.state == nil {
			return fmt.Errorf("pgstore: read of a batch of %d answered key %d twice or empty", len(idx), n.Int64)
		}
		recs[n.Int64-1] = rec
		return nil
	})
	if rerr == nil && !clocked {
		rerr = fmt.Errorf("pgstore: read of a batch of %d answered no row", len(idx))
	}
	for j := range recs {
		if recs[j].state == nil {
			recs[j].clock = clock
		}
	}
	_, perr := br.Exec()
	if err := cmp.Or(berr, serr, lerr, rerr, perr, br.Close()); err != nil {
		// Locks may have been taken: the session goes, and they with it.
		closeConn(conn)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && notMigrated[pe.Code] {
			s.heldSQL.Store(nil)
			return idx
		}
		return fail(err)
	}
	hb := &heldBatch{s: s, hs: hs, ttl: ttl, conn: conn, xid: xid, locked: make(map[string]bool, len(idx))}
	type member struct {
		i int
		h *heldTx
	}
	members := make([]member, 0, len(idx))
	hts := make([]heldTx, len(idx)) // the members', one allocation
	fps := keyBytes(len(idx), func(j int) string { return reqs[idx[j]].Fingerprint })
	owners := heldOwners(pid, len(idx))
	var unlock [][]byte
	for j, i := range idx {
		req := reqs[i]
		status, fence, attempts, remaining, value := recs[j].status(req, got[j])
		if !readCommitted {
			status = statusCounted
		}
		if status == statusCounted {
			counted = append(counted, i)
		} else if status != int(lock.Acquired) {
			results[i], errs[i] = s.result(req, status, fence, attempts, remaining, value, "", start)
		} else {
			results[i], errs[i] = s.result(req, status, fence, attempts, remaining, value, owners[j], start)
			if errs[i] == nil {
				hb.locked[req.Key] = true
				hts[j] = heldTx{batch: hb, key: keys[j], fp: fps[j]}
				members = append(members, member{i, &hts[j]})
				continue
			}
		}
		if got[j] {
			unlock = append(unlock, keys[j])
		}
	}
	if len(counted) > 0 {
		// Some keys must be record-row leases: so must all (see
		// AcquireLeaseBatch). Every lock taken goes, with the
		// transaction, in the round trip that gives the connection back.
		members, unlock, counted = nil, nil, idx
		hb.locked = map[string]bool{}
		for _, i := range idx {
			results[i], errs[i] = lock.Result{}, nil
		}
	}
	hb.mu.Lock()
	hb.members = len(members)
	if len(unlock) > 0 || len(members) == 0 {
		hb.settle(ctx, unlock)
	}
	lost := hb.conn == nil && len(members) > 0
	hb.mu.Unlock()
	if lost {
		for _, m := range members {
			// The unlock failed and closed the session: nothing is held.
			results[m.i], errs[m.i] = lock.Result{}, fmt.Errorf("%w: pgstore: acquire batch: the session holding the leases ended", lock.ErrUnavailable)
		}
		return counted
	}
	ls := make([]lock.Lease, len(members))
	put := make([]*heldTx, len(members))
	for j, m := range members {
		ls[j], put[j] = results[m.i].Lease, m.h
	}
	s.putHeldBatch(ls, put)
	return counted
}

// scanEach reads the next result of br, scanning each row into dst and
// then calling each.
func scanEach(br pgx.BatchResults, dst []any, each func() error) error {
	rows, err := br.Query()
	if err != nil {
		return err
	}
	for rows.Next() {
		if err := rows.Scan(dst...); err != nil {
			rows.Close()
			return err
		}
		if err := each(); err != nil {
			rows.Close()
			return err
		}
	}
	rows.Close()
	return rows.Err()
}

// usable reports whether b's connection can be talked to, giving it
// back (closed) when it cannot: with b.mu held.
func (b *heldBatch) usable() bool {
	if b.conn == nil {
		return false
	}
	if pc := b.conn.Conn().PgConn(); pc.IsClosed() || pc.IsBusy() {
		b.drop()
		return false
	}
	return true
}

// sync makes b forget its connection once t, a run's transaction on it,
// gave it back to the pool (handlerTx.releaseClosed): its session ended,
// and its locks with it. It does nothing for a nil b, and returns true,
// for use in a condition.
func (b *heldBatch) sync(t *handlerTx) bool {
	if b != nil && t.pooled == nil && b.conn != nil {
		b.conn, b.xid, b.locked = nil, "", map[string]bool{}
	}
	return true
}

// drop closes b's connection: the server ends its session, its
// transaction and its locks. With b.mu held.
func (b *heldBatch) drop() {
	if b.conn != nil {
		closeConn(b.conn)
	}
	b.conn, b.xid, b.locked = nil, "", map[string]bool{}
}

// settle releases the session-level locks of unlock and brings b's
// connection back to its resting state, in one round trip, with b.mu
// held: while leases of the batch remain, a transaction open with the
// handler's savepoint and the idle timeout, no run having used it (b.xid);
// once none remains, the connection given back to the pool, every lock
// of its session released first (in its transaction, when one is open).
// A connection it cannot make so is closed.
func (b *heldBatch) settle(ctx context.Context, unlock [][]byte) {
	for _, k := range unlock {
		delete(b.locked, string(k))
	}
	if !b.usable() {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	pc := b.conn.Conn().PgConn()
	st := pc.TxStatus()
	q := &pgx.Batch{}
	if st != 'I' && !(st == 'T' && b.xid != "") {
		q.Queue("ROLLBACK") // a run's, or an aborted one
		st = 'I'
	}
	reopen := b.members > 0 && st == 'I'
	if reopen {
		q.Queue(b.s.sql.begin)
		q.Queue(b.hs.batchSetup, strconv.FormatInt(b.ttl.Milliseconds(), 10))
		q.Queue("SAVEPOINT " + savepoint)
	}
	switch {
	case b.members > 0 && len(unlock) > 0:
		q.Queue(b.hs.batchUnlock, b.s.cfg.Prefix, byteaArray(unlock))
	case b.members <= 0 && (len(b.locked) > 0 || st == 'T'):
		// Every lock of the session, whatever the bookkeeping says: a
		// pooled connection must never keep one. (Each lock it took is
		// in b.locked until its release or its commit released it; an
		// unlock that failed closed the connection.)
		q.Queue("SELECT pg_advisory_unlock_all()")
		if st == 'T' {
			q.Queue("ROLLBACK")
		}
	}
	if q.Len() > 0 {
		br := b.conn.SendBatch(ctx, q)
		var err error
		for _, qq := range q.QueuedQueries {
			if qq.SQL == b.hs.batchSetup {
				var xid string
				var ok, rc bool
				var pid uint32
				err = cmp.Or(err, br.QueryRow().Scan(&xid, &ok, &rc, &pid))
				b.xid = xid
				continue
			}
			_, e := br.Exec()
			err = cmp.Or(err, e)
		}
		if err = cmp.Or(err, br.Close()); err != nil {
			b.drop()
			return
		}
	}
	if b.members <= 0 {
		if pc.TxStatus() != 'I' {
			b.drop()
			return
		}
		b.conn.Release()
		b.conn, b.xid, b.locked = nil, "", map[string]bool{}
	}
}

// end ends the member h of b with no outcome written (Cancel, a lease
// not ended within its TTL, Close): its key's lock is released.
func (b *heldBatch) end(h *heldTx) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.members--
	var unlock [][]byte
	if b.locked[string(h.key)] {
		unlock = [][]byte{h.key}
	}
	b.settle(context.Background(), unlock)
}

// finishMember writes the outcome state of l, the member h of a lease
// batch, and ends it: on the batch's session, while it holds the key's
// lock, with finish_held and the lock's release, committed in the open
// transaction, in one round trip; else, the session having ended (or the
// key lost), with finish_held on a connection of the pool, as finishHeld
// does for a single lease.
func (s *Store) finishMember(ctx context.Context, h *heldTx, l lock.Lease, op, state string, value []byte) error {
	if err := lock.CheckLease(l); err != nil {
		return err
	}
	b := h.batch
	b.mu.Lock()
	var unanswered error
	if b.locked[string(h.key)] && b.usable() {
		pc := b.conn.Conn().PgConn()
		q := &pgx.Batch{}
		inTx := pc.TxStatus() == 'T'
		if pc.TxStatus() == 'E' {
			q.Queue("ROLLBACK")
			inTx = false
		}
		if !inTx {
			q.Queue(s.sql.begin)
		}
		q.Queue(s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, state, value, l.Retention.Milliseconds(), h.fp)
		q.Queue(b.hs.unlock, s.cfg.Prefix, h.key)
		q.Queue("COMMIT")
		if b.members > 1 {
			// Others remain: the session goes back into a transaction in
			// the same round trip (see settle).
			q.Queue(s.sql.begin)
			q.Queue(b.hs.batchSetup, strconv.FormatInt(b.ttl.Milliseconds(), 10))
			q.Queue("SAVEPOINT " + savepoint)
		}
		br := b.conn.SendBatch(ctx, q)
		var ferr, err error
		b.xid = ""
		for _, qq := range q.QueuedQueries {
			if qq.SQL == b.hs.batchSetup {
				var xid string
				var ok, rc bool
				var pid uint32
				if e := br.QueryRow().Scan(&xid, &ok, &rc, &pid); e == nil {
					b.xid = xid
				}
				continue
			}
			tag, e := br.Exec()
			switch {
			case qq.SQL == s.sql.finishHeld:
				ferr = e
			case e == nil && qq.SQL == "COMMIT" && tag.String() != "COMMIT":
				e = fmt.Errorf("pgstore: %s %q: commit answered %q", op, l.Key, tag.String())
			}
			err = cmp.Or(err, e)
		}
		err = cmp.Or(err, br.Close())
		if err != nil {
			b.xid = ""
		}
		closed := pc.IsClosed()
		if err == nil {
			delete(b.locked, string(h.key))
		}
		b.members--
		var unlock [][]byte
		if err != nil && b.locked[string(h.key)] {
			unlock = [][]byte{h.key}
		}
		b.settle(ctx, unlock)
		b.mu.Unlock()
		if ferr != nil || !closed {
			return cmp.Or(s.heldError(op, l, ferr), classifyEnd(op, l, err))
		}
		unanswered = err
	} else {
		b.members--
		b.settle(ctx, nil)
		b.mu.Unlock()
	}
	s.awaitSessionEnd(ctx, l)
	_, err := s.pool.Exec(ctx, s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, state, value,
		l.Retention.Milliseconds(), h.fp)
	err = s.heldError(op, l, err)
	if unanswered != nil && errors.Is(err, lock.ErrLeaseLost) {
		return fmt.Errorf("pgstore: %s %q (its outcome may be unknown: the record tells): %w", op, l.Key, classify(unanswered))
	}
	return err
}

// classifyEnd is the error of an end of a member whose round trip failed
// with err (nil: none), beyond finish_held's own.
func classifyEnd(op string, l lock.Lease, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("pgstore: %s %q: %w", op, l.Key, classify(err))
}

// finishOwn completes the record of l, a member of b whose run's work
// committed on its own (the handler committed it itself, or the commit's
// answer was lost and it landed): on b's session with finish_held and the
// key's release, while it holds the key's lock, else on a connection of
// the pool once the session ended. With b.mu held, in a run (runHeld).
func (s *Store) finishOwn(ctx context.Context, b *heldBatch, l lock.Lease, value []byte) error {
	if b.committed[l.Owner] {
		// Its record committed with the batch's (finishHeldBatch saw the
		// COMMIT answered), and its member was counted down then.
		return nil
	}
	fp := b.fps[l.Owner]
	if b.locked[l.Key] && b.usable() && b.conn.Conn().PgConn().TxStatus() == 'I' {
		q := &pgx.Batch{}
		q.Queue(s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, "c", value, l.Retention.Milliseconds(), fp)
		q.Queue(b.hs.unlock, s.cfg.Prefix, []byte(l.Key))
		br := b.conn.SendBatch(ctx, q)
		_, ferr := br.Exec()
		_, uerr := br.Exec()
		err := cmp.Or(ferr, uerr, br.Close())
		if err == nil {
			delete(b.locked, l.Key)
			b.committed[l.Owner] = true
			b.members--
			return nil
		}
		if ferr != nil && !b.conn.Conn().PgConn().IsClosed() {
			return s.heldError("complete", l, ferr)
		}
		if ferr == nil {
			// Written; the release failed: the session goes, and the
			// lock with it.
			b.drop()
			b.committed[l.Owner] = true
			b.members--
			return nil
		}
	}
	delete(b.locked, l.Key)
	s.awaitSessionEnd(ctx, l)
	_, err := s.pool.Exec(ctx, s.sql.finishHeld, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, "c", value,
		l.Retention.Milliseconds(), fp)
	if err = s.heldError("complete", l, err); err == nil {
		b.committed[l.Owner] = true
		b.members--
	}
	return err
}

// runHeld runs fn on the items of one lease batch b, on its session, as
// complete does on a connection of the pool, with b.mu held for the
// whole: the members' leases are taken out of Store.held for the run and
// put back unless their records committed. A member whose key b no
// longer holds (its lock released by a failed commit, or its session
// ended) is answered lock.ErrLeaseLost, and one that ended before the run
// lock.ErrUnavailable, and the rest run without them.
func (h *batchTxHandler) runHeld(ctx context.Context, b *heldBatch, ds []*amqp.Delivery, leases []lock.Lease, value func(int, []byte) ([]byte, error)) ([]amqpidem.BatchResult, error) {
	s := h.s
	var taken func(int) *heldTx
	var back []int // the members to put back, once b.mu is released
	defer func() {
		if len(back) == 0 {
			return
		}
		ls := make([]lock.Lease, len(back))
		put := make([]*heldTx, len(back))
		for j, i := range back {
			ls[j], put[j] = leases[i], taken(i)
		}
		s.putHeldBatch(ls, put)
	}()
	b.mu.Lock()
	defer b.mu.Unlock()
	rs := make([]amqpidem.BatchResult, len(ds))
	members := make([]*heldTx, len(ds))
	taken = func(i int) *heldTx { return members[i] }
	var ok []int
	for i, l := range leases {
		m := s.takeHeld(l.Owner)
		members[i] = m
		switch {
		case m == nil || m.batch != b:
			rs[i].Err = fmt.Errorf("%w: key %q: the session holding the lease ended before the handler ran", lock.ErrUnavailable, l.Key)
		case !b.locked[l.Key] || b.conn == nil:
			rs[i].Err = fmt.Errorf("%w: key %q fence %d: the session holding it no longer holds its lock", lock.ErrLeaseLost, l.Key, l.Fence)
		default:
			ok = append(ok, i)
		}
	}
	b.committed, b.fps = make(map[string]bool, len(ok)), make(map[string][]byte, len(ok))
	for _, i := range ok {
		b.fps[leases[i].Owner] = members[i].fp
	}
	b.running.Store(true)
	defer func() {
		b.lastRun.Store(time.Now().UnixNano())
		b.running.Store(false)
		for i, m := range members {
			switch {
			case m == nil:
			case m.batch == b && b.committed[leases[i].Owner]:
				// Ended (members counted down by its commit).
			default:
				back = append(back, i)
			}
		}
		b.committed, b.fps = nil, nil
		b.settle(ctx, nil)
	}()
	if len(ok) == 0 {
		return rs, nil
	}
	subDs := make([]*amqp.Delivery, len(ok))
	subLeases := make([]lock.Lease, len(ok))
	for j, i := range ok {
		subDs[j], subLeases[j] = ds[i], leases[i]
	}
	srs, err := h.complete(ctx, subDs, subLeases, func(j int, r []byte) ([]byte, error) { return value(ok[j], r) }, b)
	if err != nil {
		if len(ok) == len(ds) {
			return nil, err
		}
		// Some were answered already: the batch error is each of the
		// rest's (none of theirs committed).
		for _, i := range ok {
			rs[i].Err = err
		}
		return rs, nil
	}
	for j, i := range ok {
		if srs != nil {
			rs[i] = srs[j]
		}
	}
	return rs, nil
}

// beginHeld returns the transaction open on b's connection for a run
// (b.xid), or begins one, with b.mu held.
func (b *heldBatch) beginHeld(ctx context.Context) (string, error) {
	if !b.usable() {
		return "", fmt.Errorf("%w: the session holding the batch's leases ended", lock.ErrLeaseLost)
	}
	if pc := b.conn.Conn().PgConn(); b.xid != "" && pc.TxStatus() == 'T' {
		xid := b.xid
		b.xid = ""
		return xid, nil
	}
	b.settle(ctx, nil)
	if b.conn == nil || b.xid == "" {
		return "", fmt.Errorf("%w: the session holding the batch's leases ended", lock.ErrLeaseLost)
	}
	xid := b.xid
	b.xid = ""
	return xid, nil
}

// finishHeldBatch writes the completed records of leases[i], for i in
// done, with values[i] in the transaction open on b's connection and
// commits it, in one round trip: the guard with the statement's settings
// (batchGuard), batchInsert (which releases the keys' session-level locks,
// their transaction-level ones lasting to the COMMIT) and the COMMIT. With
// b.mu held. When the insert may have run and nothing committed, the
// keys' locks may be released: they count as lost.
func (s *Store) finishHeldBatch(ctx context.Context, b *heldBatch, xid string, leases []lock.Lease, values [][]byte, done []int) error {
	keys := keyBytes(len(done), func(j int) string { return leases[done[j]].Key })
	owners := make([]string, len(done))
	fences := make([]int64, len(done))
	fps := make([][]byte, len(done))
	vals := make([][]byte, len(done))
	rets := make([]int64, len(done))
	for j, i := range done {
		l := leases[i]
		owners[j], fences[j], vals[j], rets[j] = l.Owner, l.Fence, values[i], l.Retention.Milliseconds()
		if vals[j] == nil {
			vals[j] = []byte{}
		}
		fps[j] = b.fps[l.Owner]
	}
	q := &pgx.Batch{}
	q.Queue(b.hs.batchGuard, xid)
	q.Queue(b.hs.batchInsert, s.cfg.Prefix, byteaArray(keys), textArray(owners), int8Array(fences), byteaArray(fps), byteaArray(vals), int8Array(rets))
	q.Queue("COMMIT")
	br := b.conn.SendBatch(ctx, q)
	_, gerr := br.Exec()
	_, ierr := br.Exec()
	tag, cerr := br.Exec()
	werr := cmp.Or(gerr, ierr)
	err := cmp.Or(werr, cerr, br.Close())
	if err == nil && tag.String() == "COMMIT" {
		for j := range keys {
			delete(b.locked, string(keys[j]))
			b.committed[owners[j]] = true
		}
		b.members -= len(done)
		return lostAnswer()
	}
	if gerr == nil {
		// The insert ran (or may have): its unlocks are not undone.
		for _, k := range keys {
			delete(b.locked, string(k))
		}
	}
	var pe *pgconn.PgError
	switch {
	case isTxGuard(gerr):
		return errTxRolledBack
	case ierr != nil && errors.As(ierr, &pe) && pe.Code == uniqueViolation:
		return fmt.Errorf("%w: complete batch of %d: %s", lock.ErrLeaseLost, len(done), pe.Message)
	case werr != nil && errors.As(werr, &pe):
		return fmt.Errorf("pgstore: complete batch of %d: %w", len(done), classify(werr))
	case err != nil:
		return fmt.Errorf("%w: pgstore: commit of a batch of %d (its outcome may be unknown: the records tell): %w",
			lock.ErrUnavailable, len(done), classify(err))
	}
	return fmt.Errorf("pgstore: commit of a batch of %d answered %q: nothing committed", len(done), tag.String())
}
