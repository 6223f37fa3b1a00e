package pgstore

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// A lease held by a transaction (TxHandler's AcquireLease, see the package
// documentation): acquireHeld begins a transaction that stays open on one
// pooled connection until the lease ends and takes the key's advisory lock
// in it twice, at transaction level and at session level. The record is
// written once, with the outcome, by a plain INSERT in that transaction,
// which also releases the session-level lock, sent with the COMMIT
// (commitHeld): the transaction-level lock covers the moment from that
// release to the commit, when the record becomes visible, and the
// session-level one a COMMIT of the handler's own, after which the
// completion is written on the same session (finishHeldOn) before the key
// is free. Both are released while the transaction is open, so that a
// pooler in transaction mode never keeps a server session holding them;
// only a handler that ends the transaction itself makes the release come
// after it. Between AcquireLease and the call that ends the lease
// (HandleComplete, Complete, Fail, Release or Cancel) the transaction
// waits in Store.held, under the lease's owner token, which begins with
// heldMark and the backend's process ID: Extend asks the server whether
// that backend still holds the lock.

// heldMark is the first byte of the owner token of a lease held by a
// transaction; other owner tokens are hex digits.
const heldMark = 't'

// heldTx is a transaction that holds a lease, or, with no conn, what is
// left of one that ended before the outcome was written: the fingerprint,
// for that outcome.
type heldTx struct {
	conn *pgxpool.Conn
	tx   *handlerTx // the handler's
	hs   *heldSQL
	key  []byte // the lease's key, for the lock
	fp   []byte // the request's fingerprint, for the record
	xid  string // the transaction's id (pg_current_xact_id)
	// locked: the session still holds the key's advisory lock.
	locked bool
	// batch is the lease batch it is a member of (heldbatch.go), whose
	// session holds its key's lock; conn, tx and xid are not used then.
	batch *heldBatch
	// guard ends the transaction if nothing took it within the lease's
	// TTL (a bug: amqpidem always ends the leases it gets), and forgets
	// what is left of an ended one later. A batch member put with
	// others (putHeldBatch) has instead their shared one, and no guard.
	guard  *time.Timer
	shared atomic.Pointer[heldGuard]
}

// isHeld reports whether l is held by a transaction.
func isHeld(l lock.Lease) bool { return l.Owner != "" && l.Owner[0] == heldMark }

// heldOwner returns a new owner token for a lease held by a transaction
// on the backend pid: heldMark, pid in 8 hex digits, and 23 random ones.
func heldOwner(pid uint32) string { return heldOwners(pid, 1)[0] }

// heldOwners returns n new owner tokens as heldOwner makes them, all
// slices of one string (an allocation a batch, not three a token).
func heldOwners(pid uint32, n int) []string {
	const size = 32              // heldMark, 8 hex digits, 23 random ones
	random := make([]byte, 12*n) // 24 hex digits a token, 23 used
	_, _ = rand.Read(random)     // crypto/rand.Read never fails (Go 1.24+).
	var all strings.Builder
	all.Grow(size * n)
	var pidBytes [4]byte
	binary.BigEndian.PutUint32(pidBytes[:], pid)
	var pidHex [8]byte
	hex.Encode(pidHex[:], pidBytes[:])
	var digits [24]byte
	for j := range n {
		all.WriteByte(heldMark)
		all.Write(pidHex[:])
		hex.Encode(digits[:], random[12*j:12*j+12])
		all.Write(digits[:23])
	}
	tokens := all.String()
	owners := make([]string, n)
	for j := range owners {
		owners[j] = tokens[size*j : size*j+size]
	}
	return owners
}

// heldPID returns the backend process ID of the held lease owner (see
// heldOwner), and false for an owner token that has none.
func heldPID(owner string) (uint32, bool) {
	if len(owner) < 9 || owner[0] != heldMark {
		return 0, false
	}
	pid, err := strconv.ParseUint(owner[1:9], 16, 32)
	return uint32(pid), err == nil
}

// acquireHeld takes a lease on req.Key held by a transaction that it begins
// (with Config.TxOptions), in one round trip: BEGIN, the key's advisory
// lock, the record, and the SAVEPOINT the handler's work begins at
// (heldStatements). A key that is busy or answered by its record costs one
// more, the ROLLBACK (and the unlock, if it took the lock); a key whose
// record counts attempts is taken by Acquire instead, and so is every key
// while the database has no held_key (not migrated by this release). Its
// failures are not retried: a transaction whose outcome is unknown ended
// with its connection, holding nothing.
func (s *Store) acquireHeld(ctx context.Context, req lock.Request, o txOptions) (lock.Result, error) {
	ctx, cancel := bounded(ctx)
	defer cancel()
	req, err := s.cfg.CheckRequest(req)
	if err != nil {
		return lock.Result{}, err
	}
	if lvl := o.opts.IsoLevel; lvl != "" && lvl != pgx.ReadCommitted {
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
		pid                   uint32
		rec                   heldRecord
	)
	key := []byte(req.Key)
	b := &pgx.Batch{}
	b.Queue(o.begin)
	b.Queue(hs.lock, s.cfg.Prefix, key, strconv.FormatInt(req.TTL.Milliseconds(), 10))
	b.Queue(hs.read, s.cfg.Prefix, key)
	b.Queue("SAVEPOINT " + savepoint)
	br := conn.SendBatch(ctx, b)
	_, berr := br.Exec()
	lerr := br.QueryRow().Scan(&locked, &xid, &readCommitted, &pid)
	rerr := br.QueryRow().Scan(&rec.state, &rec.fence, &rec.attempts, &rec.value, &rec.fp, &rec.live, &rec.remaining, &rec.clock)
	_, serr := br.Exec()
	if err := cmp.Or(berr, lerr, rerr, serr, br.Close()); err != nil {
		// The lock may have been taken: the session goes, and it with it.
		closeConn(conn)
		var pe *pgconn.PgError
		if errors.As(err, &pe) && notMigrated[pe.Code] {
			// The table went away since heldStatements found it: ask
			// again next time; Acquire says what is missing.
			s.heldSQL.Store(nil)
			return s.Acquire(ctx, req)
		}
		return lock.Result{}, fmt.Errorf("pgstore: acquire %q: %w", req.Key, classify(err))
	}
	h := &heldTx{conn: conn, tx: &handlerTx{conn: conn.Conn()}, hs: hs, key: key, fp: []byte(req.Fingerprint),
		locked: locked != nil && *locked}
	// Under a level above READ COMMITTED (the server's default, when
	// Config.TxOptions sets none), the transaction's snapshot is the
	// lock's statement's: the record read after the lock could miss a
	// lease committed just before it. A record-row lease instead.
	status, fence, attempts, remaining, value := rec.status(req, h.locked)
	if readCommitted == nil || !*readCommitted {
		status = statusCounted
	}
	if status != int(lock.Acquired) {
		s.endHeldConn(h)
		if status == statusCounted {
			return s.Acquire(ctx, req)
		}
		return s.result(req, status, fence, attempts, remaining, value, "", start)
	}
	owner := heldOwner(pid)
	res, err := s.result(req, status, fence, attempts, remaining, value, owner, start)
	if err != nil {
		s.endHeldConn(h)
		return res, err
	}
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

// putHeld keeps h, the transaction holding l (or what is left of it),
// until a call takes it. A guard ends the transaction if nothing took it
// within l's TTL, keeping what is left of it.
func (s *Store) putHeld(l lock.Lease, h *heldTx) {
	if h.batch != nil && s.closed.Load() {
		h.batch.end(h) // Close has run: see there
		s.putEnded(l.Owner, h.fp, l.TTL+l.Retention)
		return
	}
	if h.conn == nil && h.batch == nil || s.closed.Load() {
		if h.conn != nil {
			// Close has run: no transaction may stay held (see Close).
			closeConn(h.conn)
		}
		s.putEnded(l.Owner, h.fp, l.TTL+l.Retention)
		return
	}
	if heldStoreHook != nil {
		heldStoreHook()
	}
	// The guard is armed once h is in Store.held, under its mutex: armed
	// before, it could fire first (this goroutine held up), find nothing
	// to end and never fire again.
	h.shared.Store(nil)
	s.held.Store(l.Owner, h, func() { s.guardHeld(l, h) })
	s.closedSince(l, h)
}

// closedSince ends h, just put in Store.held under l's owner, if Close
// has run since its caller looked (Close may have missed it), as Close
// ends it.
func (s *Store) closedSince(l lock.Lease, h *heldTx) {
	if s.closed.Load() {
		s.endInPlace(l.Owner, h, time.Minute, func() {})
	}
}

// heldStoreHook, when set (by tests, before any lease is held), is called
// by putHeld and guardBatch after they looked at Store.closed and before
// they put a held lease's transaction, or a batch's members, in
// Store.held.
var heldStoreHook func()

// putHeldBatch keeps hs[j], holding ls[j], as putHeld does each, with
// one guard for the members of lease batches of one TTL (heldGuard): one
// timer a batch, not one a member. It takes ls and hs.
func (s *Store) putHeldBatch(ls []lock.Lease, hs []*heldTx) {
	if s.closed.Load() {
		for j, h := range hs {
			s.putHeld(ls[j], h)
		}
		return
	}
	for len(hs) > 0 {
		// The batch members of the first one's TTL (most often all of
		// them), the rest for the next round; what is not a batch
		// member (what is left of one that ended), as putHeld does.
		ttl := ls[0].TTL
		same := true
		for j, h := range hs {
			same = same && ls[j].TTL == ttl && h.batch != nil
		}
		gl, gh := ls, hs
		var rl []lock.Lease
		var rh []*heldTx
		if !same {
			gl, gh = nil, nil
			for j, h := range hs {
				switch {
				case h.batch == nil:
					s.putHeld(ls[j], h)
				case ls[j].TTL == ttl:
					gl, gh = append(gl, ls[j]), append(gh, h)
				default:
					rl, rh = append(rl, ls[j]), append(rh, h)
				}
			}
		}
		if len(gh) > 0 {
			s.guardBatch(ttl, gl, gh)
		}
		ls, hs = rl, rh
	}
}

// guardBatch sets the guard of the batch members hs, holding ls[j], and
// keeps them in Store.held: one for them all, after ttl (see heldGuard).
func (s *Store) guardBatch(ttl time.Duration, ls []lock.Lease, hs []*heldTx) {
	g := &heldGuard{}
	g.left.Store(int32(len(hs)))
	for _, h := range hs {
		h.guard = nil
		h.shared.Store(g)
	}
	if heldStoreHook != nil {
		heldStoreHook()
	}
	// Armed with the members in Store.held, under its mutex, as putHeld
	// arms a guard: a takeHeld after it finds g.t set.
	s.held.StoreAll(ls, hs, func() {
		g.t = time.AfterFunc(ttl, func() {
			// Each member's in a goroutine of its own, as its own timer's
			// would be: ending one waits for the batch's session (b.mu), and
			// the others must not wait for that to leave the Store.
			for j, h := range hs {
				if h.shared.Load() == g {
					go s.guardFired(ls[j], h)
				}
			}
		})
	})
	for j, h := range hs {
		s.closedSince(ls[j], h)
	}
}

// heldMap is Store.held: the transactions holding leases (or what is
// left of them), by owner token, as a sync.Map would keep them: a map
// under a mutex, whose entries cost no allocation of their own (a
// sync.Map's cost two), and a lease batch's members go in together.
type heldMap struct {
	mu sync.Mutex
	m  map[string]*heldTx
}

// Load returns the entry of owner.
func (hm *heldMap) Load(owner string) (*heldTx, bool) {
	hm.mu.Lock()
	defer hm.mu.Unlock()
	h, ok := hm.m[owner]
	return h, ok
}

// Store sets the entry of owner to h, then calls arm (which arms the
// timer that takes it out again), under the mutex: the timer, firing,
// finds it there, and a taker finds the timer set.
func (hm *heldMap) Store(owner string, h *heldTx, arm func()) {
	hm.mu.Lock()
	defer hm.mu.Unlock()
	if hm.m == nil {
		hm.m = map[string]*heldTx{}
	}
	hm.m[owner] = h
	arm()
}

// StoreAll sets the entry of the owner of ls[j] to hs[j], for each j,
// then calls arm, under the mutex, as Store does.
func (hm *heldMap) StoreAll(ls []lock.Lease, hs []*heldTx, arm func()) {
	hm.mu.Lock()
	defer hm.mu.Unlock()
	if hm.m == nil {
		hm.m = make(map[string]*heldTx, len(hs))
	}
	for j, h := range hs {
		hm.m[ls[j].Owner] = h
	}
	arm()
}

// LoadAndDelete deletes the entry of owner, returning it.
func (hm *heldMap) LoadAndDelete(owner string) (*heldTx, bool) {
	hm.mu.Lock()
	defer hm.mu.Unlock()
	h, ok := hm.m[owner]
	if ok {
		delete(hm.m, owner)
	}
	return h, ok
}

// CompareAndSwap sets the entry of owner to h if it is old, then calls
// arm, under the mutex, as Store does, and reports whether it did.
func (hm *heldMap) CompareAndSwap(owner string, old, h *heldTx, arm func()) bool {
	hm.mu.Lock()
	defer hm.mu.Unlock()
	if cur, ok := hm.m[owner]; !ok || cur != old {
		return false
	}
	hm.m[owner] = h
	arm()
	return true
}

// CompareAndDelete deletes the entry of owner if it is old, and reports
// whether it did.
func (hm *heldMap) CompareAndDelete(owner string, old *heldTx) bool {
	hm.mu.Lock()
	defer hm.mu.Unlock()
	if cur, ok := hm.m[owner]; !ok || cur != old {
		return false
	}
	delete(hm.m, owner)
	return true
}

// Range calls f for each entry there was when it began (not under the
// mutex: f may change the map), until f returns false.
func (hm *heldMap) Range(f func(owner string, h *heldTx) bool) {
	hm.mu.Lock()
	owners := make([]string, 0, len(hm.m))
	hs := make([]*heldTx, 0, len(hm.m))
	for owner, h := range hm.m {
		owners, hs = append(owners, owner), append(hs, h)
	}
	hm.mu.Unlock()
	for j, owner := range owners {
		if !f(owner, hs[j]) {
			return
		}
	}
}

// heldGuard is the guard of members of a lease batch put in Store.held
// together (putHeldBatch): a timer of their TTL that does for each one
// still waiting under it what guardHeld's does, stopped once each was
// taken or ended (left counts those not yet).
type heldGuard struct {
	t    *time.Timer
	left atomic.Int32
}

// stopGuard stops h's guard, or counts h out of its batch's (the last
// one out stops it): h was taken from Store.held, or ended in its place.
func (h *heldTx) stopGuard() {
	if g := h.shared.Load(); g != nil {
		if g.left.Add(-1) == 0 {
			g.t.Stop()
		}
		return
	}
	if h.guard != nil {
		h.guard.Stop()
	}
}

// guardHeld sets h's guard: it ends h, waiting under l's owner, if
// nothing took it within l's TTL. It is called with h in Store.held,
// under its mutex (heldMap's arm), h.shared nil.
func (s *Store) guardHeld(l lock.Lease, h *heldTx) {
	h.guard = time.AfterFunc(l.TTL, func() { s.guardFired(l, h) })
}

// guardFired is what the guard of h, waiting under l's owner, does once
// l's TTL passed: it ends h, if it still waits.
func (s *Store) guardFired(l lock.Lease, h *heldTx) {
	if b := h.batch; b != nil && b.busy() && !s.closed.Load() {
		// A member of a batch whose other parts are running (a
		// split): waiting for its part is not being forgotten. Its
		// run, or amqpidem's end of it, takes it. A new guard comes
		// with a copy put in its place in one step, so a taker
		// never finds the member missing. (Only a batch member's
		// immutable fields are copied: h's guard may be rewritten
		// meanwhile, if a run took h and puts it back.)
		n := &heldTx{batch: b, key: h.key, fp: h.fp}
		if !s.held.CompareAndSwap(l.Owner, h, n, func() { s.guardHeld(l, n) }) {
			return // taken meanwhile
		}
		s.closedSince(l, n) // Close ran meanwhile and may have missed n
		return
	}
	s.endInPlace(l.Owner, h, l.TTL+l.Retention, func() {
		s.cfg.Logger.Warn("pgstore: a lease held by a transaction was not ended within its TTL; rolled back",
			"key", l.Key, "fence", l.Fence)
	})
}

// forget arms the guard of e, what is left of a held transaction that
// ended before its outcome was written (the fingerprint, for the outcome
// written next), waiting under owner: it is forgotten after keep (the
// record's life), if nothing took it. It is called with e in Store.held,
// under its mutex (heldMap's arm).
func (s *Store) forget(owner string, e *heldTx, keep time.Duration) {
	e.guard = time.AfterFunc(keep, func() { s.held.CompareAndDelete(owner, e) })
}

// putEnded keeps what is left of a held transaction that ended before its
// outcome was written, its fingerprint fp, under owner, for keep (see
// forget).
func (s *Store) putEnded(owner string, fp []byte, keep time.Duration) {
	e := &heldTx{fp: fp}
	s.held.Store(owner, e, func() { s.forget(owner, e, keep) })
}

// endInPlace ends h, the transaction waiting under owner, if it still
// waits, and puts what is left of it in its place (see forget), kept for
// keep; before ending it, it calls before. It reports whether it did.
func (s *Store) endInPlace(owner string, h *heldTx, keep time.Duration, before func()) bool {
	e := &heldTx{fp: h.fp}
	if !s.held.CompareAndSwap(owner, h, e, func() { s.forget(owner, e, keep) }) {
		return false
	}
	h.stopGuard()
	before()
	s.endHeldConn(h)
	return true
}

// takeHeld returns the transaction holding the lease of owner (or what is
// left of it) and forgets it, or nil when none waits.
func (s *Store) takeHeld(owner string) *heldTx {
	h, ok := s.held.LoadAndDelete(owner)
	if !ok {
		return nil
	}
	h.stopGuard()
	return h
}

// endConn rolls back what conn holds, if anything, and gives it back to the
// pool (which closes it if it could not be rolled back).
func (s *Store) endConn(t *handlerTx) {
	conn := t.pooled
	if conn == nil {
		return // released already (releaseClosed)
	}
	t.pooled = nil
	if pc := conn.Conn().PgConn(); !pc.IsClosed() && !pc.IsBusy() && pc.TxStatus() != 'I' {
		ctx, cancel := context.WithTimeout(context.Background(), commitTimeout)
		_, _ = conn.Exec(ctx, "ROLLBACK")
		cancel()
	}
	conn.Release()
}

// endHeldConn releases the key's session-level lock, if h's session
// still holds it, and ends h's transaction, if it is still open, in one
// round trip (two for a transaction a failed statement aborted: its
// rollback to the handler's savepoint goes first, on its own, since the
// server prepares nothing else in it), and gives the connection back to
// the pool. A connection that cannot be made clean (busy, or a statement
// failed) is closed instead, which ends the locks with the session: a
// pooled connection must never keep one.
func (s *Store) endHeldConn(h *heldTx) {
	if h.batch != nil {
		h.batch.end(h)
		return
	}
	pc := h.conn.Conn().PgConn()
	if pc.IsClosed() {
		h.conn.Release()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), commitTimeout)
	defer cancel()
	var err error
	if pc.IsBusy() {
		err = errors.New("pgstore: connection busy")
	} else if pc.TxStatus() == 'E' && h.locked {
		_, err = h.conn.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepoint)
	}
	if err == nil && (pc.TxStatus() != 'I' || h.locked) {
		b := &pgx.Batch{}
		if h.locked {
			b.Queue(h.hs.unlock, s.cfg.Prefix, h.key)
		}
		if pc.TxStatus() != 'I' {
			b.Queue("ROLLBACK")
		}
		err = h.conn.SendBatch(ctx, b).Close()
	}
	if err != nil || pc.TxStatus() != 'I' {
		closeConn(h.conn)
		return
	}
	h.locked = false
	h.conn.Release()
}

// closeConn closes conn, and gives it back to the pool, which then
// forgets it: the server ends the session, its transaction and its locks.
func closeConn(conn *pgxpool.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = conn.Conn().Close(ctx)
	conn.Release()
}

// completeHeld runs fn in the transaction that holds lease, from the
// handler's savepoint, then writes the completed record and commits, in
// one round trip (commitHeld), or, when fn committed its work itself,
// writes the completed record after it (finishHeldOn). When there is
// nothing to complete (see ending), the transaction is kept for the call
// that ends the lease next (Fail, Release, Cancel: amqpidem makes one),
// which writes that outcome under the same lock.
func (h *txHandler) completeHeld(ctx context.Context, d *amqp.Delivery, lease lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	ht := h.s.takeHeld(lease.Owner)
	if ht == nil || ht.conn == nil {
		if ht != nil {
			h.s.putHeld(lease, ht)
		}
		return nil, fmt.Errorf("%w: key %q: the transaction holding the lease ended before the handler ran", lock.ErrUnavailable, lease.Key)
	}
	committing := false
	defer func() {
		if !committing { // nothing completed: the next call ends it
			h.s.putHeld(lease, ht)
		}
	}()
	result, ferr := callFn(func() ([]byte, error) { return h.fn(ctx, ht.tx, d) })
	if ht.conn.Conn().PgConn().IsClosed() {
		// Its session ended, and the lock with it: the pool forgets the
		// connection now, so that the questions that follow go to another
		// without waiting for this one's place (see releaseClosed), and
		// the transaction counts as ended (ht.conn nil).
		ht.conn.Release()
		ht.conn = nil
	}
	end, err := h.s.ending(ctx, ht.tx, ht.xid, ferr, true)
	if end == endFailed {
		return nil, err
	}
	v, err := h.stored(lease, result, value)
	if err != nil {
		return nil, err
	}
	committing = true
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if end == endCommitted {
		err = h.s.finishHeld(cctx, ht, lease, "complete", "c", v)
	} else {
		err = h.s.commitHeld(cctx, ht, lease, "complete", "c", v)
		if err != nil && ht.conn.Conn().PgConn().IsClosed() {
			// As above: the pool forgets the closed connection before
			// workCommitted asks on another.
			ht.conn.Release()
			ht.conn = nil
		}
		switch {
		case err != nil && h.s.workCommitted(cctx, ht.tx, ht.xid):
			// Done, though the record's write and commit failed (see
			// workCommitted): as after fn's own COMMIT. A commit whose
			// answer never came used up cctx: the record's write gets a
			// timeout of its own.
			fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
			defer fcancel()
			if err = h.s.finishHeld(fctx, ht, lease, "complete", "c", v); err != nil {
				err = recordNotConfirmed(err)
			}
		case ht.conn != nil:
			h.s.endHeldConn(ht)
		}
	}
	if err != nil {
		if !errors.Is(err, lock.ErrLeaseLost) {
			// amqpidem ends the lease next: its record keeps the
			// fingerprint.
			h.s.putHeld(lease, &heldTx{fp: ht.fp})
		}
		if end == endCommitted {
			return nil, recordAfterCommit(err)
		}
		return nil, err
	}
	return result, nil
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
