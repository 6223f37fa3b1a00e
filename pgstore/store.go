package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// Store is a lock.Store on PostgreSQL: one row per idempotency key in a
// table made by Migrate, with the state machine, answers and limits of the
// Redis store (see package lock), and a handler form, TxHandler, that
// completes the record in the handler's own transaction.
//
// A Store is safe for concurrent use. It uses connections of the pool it
// was given, one per call, and never closes the pool.
type Store struct {
	pool *pgxpool.Pool
	cfg  Config
	sql  statements
	// held are the transactions holding leases (held.go), by owner token;
	// closed is set by Close, after which none is kept.
	held   heldMap
	closed atomic.Bool
	// heldSQL are the statements of held leases once heldStatements found
	// the database ready for them; heldMissing is when it last found it
	// was not, or nil.
	heldSQL     atomic.Pointer[heldSQL]
	heldMissing atomic.Pointer[time.Time]

	stop context.CancelFunc // called by Close: ends the cleanup goroutine
	done chan struct{}      // closed when the cleanup goroutine has ended
}

var (
	_ lock.Store        = (*Store)(nil)
	_ amqpidem.ConnPool = (*Store)(nil)
)

// MaxConns is the most connections the Store's pool opens (its
// pgxpool.Config's MaxConns), for amqpidem.ConnPool: NewConsumer refuses
// a TxHandler whose Concurrency leaves no connection for the heartbeat.
func (s *Store) MaxConns() int { return int(s.pool.Stat().MaxConns()) }

// statements are the SQL texts of the Store's calls, for its Config.
type statements struct {
	acquire, finish, finishTx, extend, stillHeld, cleanup, check, amend string
	begin, finishHeld                                                   string
	finishBatch, acquireBatch                                           string
}

// New returns a Store on pool. It does no I/O: the table must exist
// (Migrate), which Check verifies. Unless Config.CleanupInterval is
// negative, a goroutine deletes expired records every CleanupInterval
// until Close.
//
// Every handler that TxHandler runs holds one pooled connection for as
// long as it runs, and the heartbeat, Acquire and the outcome calls need
// connections beside them: give the pool more connections than the
// handlers that can run at once (ConsumerConfig.Concurrency, summed over
// the consumers sharing the pool), or leases go unrenewed while every
// connection is busy.
func New(pool *pgxpool.Pool, cfg Config) (*Store, error) {
	if pool == nil {
		return nil, errors.New("pgstore: nil pool")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	n := cfg.names()
	s := &Store{
		pool: pool,
		cfg:  cfg,
		sql: statements{
			acquire:      "SELECT status, fence, attempts, remaining_ms, value FROM " + n.acquire + "($1, $2, $3, $4, $5, $6)",
			acquireBatch: acquireBatchSQL(n),
			finish:       "SELECT " + n.finish + "($1, $2, $3, $4, $5, $6, $7)",
			// finish_tx answers nothing: it raises where finish answers 0.
			finishTx:    "SELECT " + n.finishTx + "($1, $2, $3, $4, $5, $6, $7)",
			finishBatch: finishBatchSQL(n),
			// A lease held by a transaction (held.go).
			begin:      beginSQL(cfg.TxOptions),
			finishHeld: "SELECT " + n.finishHeld + "($1, $2, $3, $4, $5, $6, $7, $8)",
			// Rows another transaction holds are skipped, not waited for:
			// one held row must not delay the renewal of all the others.
			extend: `WITH x AS (
					SELECT * FROM unnest($2::bytea[], $3::text[], $4::bigint[], $5::bigint[], $6::bigint[])
						AS x(key, owner, fence, ttl, ret)),
				held AS (
					SELECT t.key FROM ` + n.table + ` t JOIN x ON t.ns = $1 AND t.key = x.key
						AND t.owner = x.owner AND t.fence = x.fence
					WHERE t.state = 'p' AND t.expires_at > clock_timestamp()
					FOR UPDATE OF t SKIP LOCKED)
				UPDATE ` + n.table + ` AS t
				SET deadline = clock_timestamp() + x.ttl * interval '1 millisecond',
					expires_at = clock_timestamp() + (x.ttl + x.ret) * interval '1 millisecond'
				FROM x
				WHERE t.ns = $1 AND t.key = x.key AND t.owner = x.owner AND t.fence = x.fence
					AND t.key IN (SELECT key FROM held)
				RETURNING t.key, t.owner, t.fence`,
			// Which of the leases Extend did not renew are still held: their
			// rows were locked by another transaction (the handler's own
			// completion, say), not taken over.
			stillHeld: `SELECT t.key, t.owner, t.fence FROM ` + n.table + ` t
				JOIN unnest($2::bytea[], $3::text[], $4::bigint[]) AS x(key, owner, fence)
					ON t.ns = $1 AND t.key = x.key AND t.owner = x.owner AND t.fence = x.fence
				WHERE t.state = 'p' AND t.expires_at > clock_timestamp()`,
			// statement_timestamp(), not clock_timestamp(): stable within the
			// statement, so that the index on expires_at is used. A row
			// revived since the statement began expires later than that.
			// $2 is the grace (see cleanupGrace).
			cleanup: "DELETE FROM " + n.table + ` AS t WHERE (t.ns, t.key) IN (
					SELECT ns, key FROM ` + n.table + ` WHERE expires_at <= statement_timestamp() - $2::interval
					LIMIT $1 FOR UPDATE SKIP LOCKED)
				AND t.expires_at <= statement_timestamp() - $2::interval`,
			// The now CTE reads the clock once and sets the functions'
			// lock_timeout for this statement's transaction only, as
			// forgetSQL does; the UPDATE joins it, so it is set before the
			// UPDATE can wait for a row. A record that already holds the
			// new value ($5) matches too, and is written with the same
			// bytes: the answer of a retried Amend that landed. NULL (a
			// Complete of a nil result) is the empty value.
			amend: `WITH now AS (
					SELECT clock_timestamp() AS ts, set_config('lock_timeout', '` + lockTimeout + `', true) AS lock_timeout)
				UPDATE ` + n.table + ` AS t SET value = $5::bytea
				FROM now
				WHERE t.ns = $1 AND t.key = $2 AND t.state = 'c' AND t.fence = $3 AND t.expires_at > now.ts
					AND coalesce(t.value, '') IN (coalesce($4::bytea, ''), coalesce($5::bytea, ''))`,
			check: `SELECT obj_description(to_regclass($1), 'pg_class'), to_regprocedure($2) IS NOT NULL AND to_regprocedure($3) IS NOT NULL
				AND to_regprocedure($4) IS NOT NULL AND to_regprocedure($5) IS NOT NULL AND to_regprocedure($6) IS NOT NULL`,
		},
		done: make(chan struct{}),
	}
	ctx, stop := context.WithCancel(context.Background())
	s.stop = stop
	if cfg.CleanupInterval > 0 {
		go s.cleanupLoop(ctx)
	} else {
		close(s.done)
	}
	return s, nil
}

// Close stops the background cleanup and waits for it, and rolls back the
// transactions holding leases that no call has ended yet (their handlers
// did not start, or failed and were not settled), giving their
// connections back. It does not close the pool; the Store must not be
// used after Close, but for the calls that end those leases (within a
// minute), which write their outcomes as for a transaction the server
// ended.
func (s *Store) Close() {
	s.stop()
	<-s.done
	s.closed.Store(true)
	s.held.Range(func(owner string, h *heldTx) bool {
		if h.conn != nil || h.batch != nil {
			s.endInPlace(owner, h, time.Minute, func() {})
		}
		return true
	})
}

// MaxResultSize is the largest result Complete accepts, in bytes.
func (s *Store) MaxResultSize() int { return s.cfg.MaxResultSize }

// callTimeout bounds each call of the Store's own (Check, Acquire,
// Extend, Complete and the others, AcquireBatch, a TxHandler's acquire)
// whose ctx has no earlier deadline: a database that accepts connections
// and never answers (a hung server, a partition behind a middlebox that
// keeps the TCP connection) makes it fail with lock.ErrUnavailable rather
// than hang with no word, as go-redis's read timeouts bound the Redis
// store's calls. The same bound as commitTimeout's.
const callTimeout = commitTimeout

// bounded is ctx bounded by callTimeout, unless its own deadline comes
// sooner.
func bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); ok && time.Until(d) <= callTimeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, callTimeout)
}

// Ping checks that the database answers, for a readiness check (see
// amqpidem.Consumer.Ready): one round trip on a pooled connection.
func (s *Store) Ping(ctx context.Context) error {
	ctx, cancel := bounded(ctx)
	defer cancel()
	if err := s.pool.Ping(ctx); err != nil {
		return fmt.Errorf("pgstore: ping: %w", classify(err))
	}
	return nil
}

// Check verifies that the database answers and has what Migrate makes for
// this Store's Config, in the format this package reads. amqpidem's
// Consumer calls it once when Run starts, and logs what it returns.
func (s *Store) Check(ctx context.Context) error {
	ctx, cancel := bounded(ctx)
	defer cancel()
	n := s.cfg.names()
	var comment *string
	var functions bool
	finishArgs := "(text, bytea, text, bigint, text, bytea, bigint)"
	err := s.pool.QueryRow(ctx, s.sql.check, n.table,
		n.acquire+"(text, bytea, text, bigint, bigint, bytea)",
		n.finish+finishArgs, n.finishTx+finishArgs,
		n.finishHeld+"(text, bytea, text, bigint, text, bytea, bigint, bytea)", n.heldKey+"(text, bytea)").Scan(&comment, &functions)
	switch {
	case err != nil:
		return fmt.Errorf("pgstore: check: %w", classify(err))
	case comment == nil || !functions:
		return fmt.Errorf("%w: table %s or its functions are missing: run pgstore.Migrate, or apply pgstore.MigrationSQL, with this Config", ErrNotMigrated, n.table)
	case *comment != tableComment:
		return fmt.Errorf("pgstore: table %s says %q, this package reads %q: run pgstore.Migrate with this release", n.table, *comment, tableComment)
	}
	return nil
}

// Acquire takes a lease on req.Key in one statement.
//
// An Acquire whose answer is lost (the connection broke after the
// statement was sent) may have taken the lease: it is sent again with the
// same owner token, which the database answers with that same lease (no
// second attempt counted), up to 3 times over about 350 ms within ctx. An
// error saying the statement did not take effect (a failed connect, an
// error the server answered) is not retried while no earlier try may have
// reached the server (see lock.RetryAcquire). If the tries all fail,
// Acquire returns an error wrapping lock.ErrUnavailable, and a lease it
// may have taken blocks the key for its TTL.
func (s *Store) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	ctx, cancel := bounded(ctx)
	defer cancel()
	req, err := s.cfg.CheckRequest(req)
	if err != nil {
		return lock.Result{}, err
	}
	owner := lock.NewOwner()
	return lock.RetryAcquire(ctx, func(ctx context.Context) (lock.Result, error) { return s.acquire(ctx, req, owner) }, answered)
}

// acquire runs the acquire function for a checked request and owner token.
func (s *Store) acquire(ctx context.Context, req lock.Request, owner string) (lock.Result, error) {
	start := s.cfg.Now()
	var status, attempts int
	var fence, remaining int64
	var value []byte
	err := s.pool.QueryRow(ctx, s.sql.acquire, s.cfg.Prefix, []byte(req.Key), owner,
		req.TTL.Milliseconds(), req.Retention.Milliseconds(), []byte(req.Fingerprint),
	).Scan(&status, &fence, &attempts, &remaining, &value)
	if err != nil {
		return lock.Result{}, fmt.Errorf("pgstore: acquire %q: %w", req.Key, classify(err))
	}
	return s.result(req, status, fence, attempts, remaining, value, owner, start)
}

// result is the lock.Result of an acquire function's answer to req, its
// lease owned by owner, the call having begun at start.
func (s *Store) result(req lock.Request, status int, fence int64, attempts int, remaining int64, value []byte, owner string, start time.Time) (lock.Result, error) {
	res := lock.Result{Status: lock.Status(status), Fence: fence, Attempts: attempts}
	switch res.Status {
	case lock.Acquired:
		res.Lease = lock.Lease{
			Key:       req.Key,
			Owner:     owner,
			Fence:     fence,
			Attempt:   attempts,
			TTL:       req.TTL,
			Retention: req.Retention,
			// A retried Acquire may answer a deadline shorter than TTL.
			Deadline: start.Add(min(req.TTL, time.Duration(remaining)*time.Millisecond)),
		}
	case lock.Completed:
		res.Value = value
	case lock.Failed:
		res.Error = string(value)
	case lock.InProgress:
		res.Remaining = time.Duration(remaining) * time.Millisecond
	case lock.Conflict:
	default:
		return lock.Result{}, fmt.Errorf("pgstore: acquire %q: unexpected status %d", req.Key, status)
	}
	return res, nil
}

// Extend renews the leases in one statement. A lease held by a
// transaction (TxHandler) needs no renewal: it lasts as long as its
// session holds the key's lock, which the server ends once its
// transaction sat idle for the lease's TTL. Extend asks the server, in one
// more statement, whether those sessions still hold their locks, and
// answers lock.ErrLeaseLost for one that does not, as for a record-row
// lease taken over.
func (s *Store) Extend(ctx context.Context, leases ...lock.Lease) []error {
	ctx, cancel := bounded(ctx)
	defer cancel()
	errs := make([]error, len(leases))
	var keys, heldKeys [][]byte
	var owners []string
	var fences, ttls, rets []int64
	var pids []int32
	for i, l := range leases {
		if errs[i] = lock.CheckLease(l); errs[i] != nil {
			continue
		}
		if isHeld(l) {
			if pid, ok := heldPID(l.Owner); ok {
				heldKeys = append(heldKeys, []byte(l.Key))
				pids = append(pids, int32(pid))
			}
			continue
		}
		keys = append(keys, []byte(l.Key))
		owners = append(owners, l.Owner)
		fences = append(fences, l.Fence)
		ttls = append(ttls, l.TTL.Milliseconds())
		rets = append(rets, l.Retention.Milliseconds())
	}
	var renewed, held map[lease]bool
	var err error
	if len(keys) > 0 {
		renewed, err = s.leases(ctx, s.sql.extend, keys, owners, fences, ttls, rets)
		if err == nil && len(renewed) < len(keys) {
			held, err = s.leases(ctx, s.sql.stillHeld, keys, owners, fences)
		}
	}
	var live map[string]bool
	var herr error
	if hs := s.heldSQL.Load(); len(heldKeys) > 0 && hs != nil {
		live, herr = s.liveHeld(ctx, hs, heldKeys, pids)
	}
	for i, l := range leases {
		id := lease{l.Key, l.Owner, l.Fence}
		_, hasPID := heldPID(l.Owner)
		switch {
		case errs[i] != nil:
		case isHeld(l) && (!hasPID || live == nil && herr == nil || live[l.Key]):
			// Held (or not known to be lost: an owner of an earlier
			// release, or no statements to ask with).
		case isHeld(l) && herr != nil:
			errs[i] = fmt.Errorf("pgstore: extend %q: %w", l.Key, classify(herr))
		case isHeld(l):
			errs[i] = fmt.Errorf("%w: extend key %q fence %d: the session holding it ended", lock.ErrLeaseLost, l.Key, l.Fence)
		case renewed[id]:
		case err != nil:
			errs[i] = fmt.Errorf("pgstore: extend %q: %w", l.Key, classify(err))
		case held[id]:
			// Not taken over: its row was busy. The heartbeat tries again.
			errs[i] = fmt.Errorf("%w: extend %q: its record is locked by another transaction", lock.ErrUnavailable, l.Key)
		default:
			errs[i] = fmt.Errorf("%w: extend key %q fence %d", lock.ErrLeaseLost, l.Key, l.Fence)
		}
	}
	return errs
}

// liveHeld returns which of keys are still locked by the backend of the
// same index in pids, the sessions holding their leases.
func (s *Store) liveHeld(ctx context.Context, hs *heldSQL, keys [][]byte, pids []int32) (map[string]bool, error) {
	rows, err := s.pool.Query(ctx, hs.live, s.cfg.Prefix, keys, pids)
	if err != nil {
		return nil, err
	}
	live := map[string]bool{}
	var key []byte
	_, err = pgx.ForEachRow(rows, []any{&key}, func() error {
		live[string(key)] = true
		return nil
	})
	return live, err
}

// lease identifies a lease in the rows of a statement.
type lease struct {
	key, owner string
	fence      int64
}

// leases runs sql, which returns (key, owner, fence) rows, and returns them
// as a set.
func (s *Store) leases(ctx context.Context, sql string, args ...any) (map[lease]bool, error) {
	rows, err := s.pool.Query(ctx, sql, append([]any{s.cfg.Prefix}, args...)...)
	if err != nil {
		return nil, err
	}
	set := map[lease]bool{}
	var l lease
	var key []byte
	_, err = pgx.ForEachRow(rows, []any{&key, &l.owner, &l.fence}, func() error {
		l.key = string(key)
		set[l] = true
		return nil
	})
	return set, err
}

// Complete stores result and marks the record completed.
func (s *Store) Complete(ctx context.Context, lease lock.Lease, result []byte) error {
	if len(result) > s.cfg.MaxResultSize {
		return fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", lock.ErrResultTooLarge, lease.Key, len(result), s.cfg.MaxResultSize)
	}
	return s.finish(ctx, s.pool, lease, "complete", "c", result)
}

// Fail marks the record failed with reason, cut to MaxResultSize bytes.
func (s *Store) Fail(ctx context.Context, lease lock.Lease, reason string) error {
	return s.finish(ctx, s.pool, lease, "fail", "f", []byte(lock.CutText(reason, s.cfg.MaxResultSize)))
}

// Release gives the lease up, keeping the attempt count.
func (s *Store) Release(ctx context.Context, lease lock.Lease) error {
	return s.finish(ctx, s.pool, lease, "release", "r", nil)
}

// Cancel gives the lease up and takes back the attempt its Acquire counted.
// A retried Cancel that finds its own write answers nil and takes nothing
// back again.
func (s *Store) Cancel(ctx context.Context, lease lock.Lease) error {
	return s.finish(ctx, s.pool, lease, "cancel", "x", nil)
}

var _ lock.Amender = (*Store)(nil)

// Amend replaces the value of key's completed record with value if its
// fence is fence and its value is old (see lock.Amender), in one UPDATE
// that changes the value column alone: state, owner, fence, attempts,
// times and expires_at stay as the completion wrote them. The row lock
// makes it compare-and-set: of concurrent Amends from the same old value,
// the first to commit changes the row and the others, which waited for
// it, find another value and answer lock.ErrChanged. A record that
// already holds value is matched and written again with the same bytes,
// so that a retried Amend whose first answer was lost answers nil. Like
// Forget, it waits at most 2 s for a row that another transaction holds,
// then fails as lock.ErrUnavailable. It needs nothing beyond what
// Migrate made for earlier releases.
func (s *Store) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	ctx, cancel := bounded(ctx)
	defer cancel()
	if err := checkKey(s.cfg, key); err != nil {
		return err
	}
	if len(value) > s.cfg.MaxResultSize {
		return fmt.Errorf("%w: amend key %q: %d bytes, at most %d allowed", lock.ErrResultTooLarge, key, len(value), s.cfg.MaxResultSize)
	}
	tag, err := s.pool.Exec(ctx, s.sql.amend, s.cfg.Prefix, []byte(key), fence, old, value)
	switch {
	case err != nil:
		return fmt.Errorf("pgstore: amend %q: %w", key, classify(err))
	case tag.RowsAffected() != 1:
		return fmt.Errorf("%w: amend key %q fence %d", lock.ErrChanged, key, fence)
	}
	return nil
}

// querier is what finish runs on: the pool (a statement of its own) or a
// handler's transaction.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// finish runs the finish function on q: compare-and-set on owner and
// fence. A lease held by a transaction is ended by endHeld instead.
func (s *Store) finish(ctx context.Context, q querier, l lock.Lease, op, state string, value []byte) error {
	ctx, cancel := bounded(ctx)
	defer cancel()
	if err := lock.CheckLease(l); err != nil {
		return err
	}
	if isHeld(l) {
		return s.endHeld(ctx, l, op, state, value)
	}
	var n int
	err := q.QueryRow(ctx, s.sql.finish, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, state, value,
		l.Retention.Milliseconds()).Scan(&n)
	switch {
	case err != nil:
		return fmt.Errorf("pgstore: %s %q: %w", op, l.Key, classify(err))
	case n != 1:
		return fmt.Errorf("%w: %s key %q fence %d", lock.ErrLeaseLost, op, l.Key, l.Fence)
	}
	return nil
}

// finishTx completes l's record in the transaction open on conn, which
// must be xid (txGuardSQL), and commits it, in one round trip: the guard,
// finish_tx, which raises (leaseLostCode) where finish would answer 0,
// and COMMIT, which the server skips once either raised. So the
// transaction's writes commit with the completed record or not at all,
// as with two round trips.
func (s *Store) finishTx(ctx context.Context, conn *pgx.Conn, xid string, l lock.Lease, value []byte) error {
	if err := lock.CheckLease(l); err != nil {
		return err
	}
	b := &pgx.Batch{}
	b.Queue(txGuardSQL, xid)
	b.Queue(s.sql.finishTx, s.cfg.Prefix, []byte(l.Key), l.Owner, l.Fence, "c", value, l.Retention.Milliseconds())
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	_, gerr := br.Exec()
	_, ferr := br.Exec()
	tag, cerr := br.Exec()
	ferr = cmp.Or(gerr, ferr)
	err := cmp.Or(ferr, cerr, br.Close())
	var pe *pgconn.PgError
	switch {
	case isTxGuard(gerr):
		return errTxRolledBack
	case ferr != nil && errors.As(ferr, &pe) && pe.Code == leaseLostCode:
		return fmt.Errorf("%w: complete key %q fence %d", lock.ErrLeaseLost, l.Key, l.Fence)
	case ferr != nil && errors.As(ferr, &pe):
		// The server refused finish_tx (not migrated, say): the COMMIT
		// was skipped, nothing committed.
		return fmt.Errorf("pgstore: complete %q: %w", l.Key, classify(ferr))
	case err != nil:
		return fmt.Errorf("pgstore: commit (its outcome may be unknown: the record tells): %w", classify(err))
	case tag.String() != "COMMIT":
		return fmt.Errorf("pgstore: commit of %q answered %q: nothing committed", l.Key, tag.String())
	}
	return lostAnswer()
}

// cleanupGrace is how long after its expiry a record is kept before
// Cleanup deletes it. An expired record is treated as absent at once; it
// is kept a while so that its fence still raises the fence of a record
// made again in its place by an Acquire that read the clock before the
// record expired and was slow to insert (a stalled backend): the clock
// alone could then hand out a lower fence.
var cleanupGrace = time.Minute

// Cleanup deletes the records whose retention has passed (a minute ago or
// more), in statements of at most Config.CleanupBatch rows (skipping rows another transaction
// holds), until a statement finds fewer than that or ctx ends. It returns
// how many it deleted. Expired records are never used whether or not they
// were deleted; Cleanup only bounds the table. Many processes may run it
// at once.
func (s *Store) Cleanup(ctx context.Context) (int64, error) {
	var total int64
	for {
		// Each statement bounded (callTimeout): cleanupLoop's ctx has no
		// deadline, and a database that never answers would otherwise
		// hold its connection, and stop cleanups, for good.
		sctx, cancel := bounded(ctx)
		tag, err := s.pool.Exec(sctx, s.sql.cleanup, s.cfg.CleanupBatch, cleanupGrace)
		cancel()
		if err != nil {
			return total, fmt.Errorf("pgstore: cleanup: %w", classify(err))
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(s.cfg.CleanupBatch) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// cleanupLoop runs Cleanup every CleanupInterval (with up to 10% jitter,
// so that the processes sharing a table spread their cleanups) until
// Close.
func (s *Store) cleanupLoop(ctx context.Context) {
	defer close(s.done)
	for {
		t := time.NewTimer(s.cfg.CleanupInterval + rand.N(s.cfg.CleanupInterval/10+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if n, err := s.Cleanup(ctx); err != nil && ctx.Err() == nil {
			s.cfg.Logger.Warn("pgstore: cleanup of expired records failed; trying again later",
				"table", s.cfg.names().table, "deleted", n, "error", err)
		}
	}
}
