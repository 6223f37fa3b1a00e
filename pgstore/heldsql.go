package pgstore

// The statements of leases held by transactions (held.go), and how a
// Store finds out whether the database has what they need.

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
)

// heldSQL are the statements of leases held by transactions, on the
// records table named in full (schema included), so that a handler's SET
// search_path cannot point them at another table.
type heldSQL struct {
	// lock answers whether the transaction took the key's advisory lock
	// (NULL: not tried, a live record is there), then the transaction's
	// id when it did, whether its isolation is READ COMMITTED, and the
	// backend's process ID (the server's own: a pooler's may differ). It
	// takes the lock twice, at transaction level and at session level,
	// so that a COMMIT of the handler's own does not free the key before
	// its record is written; unlock releases the session-level one (see
	// the top of this file). With the lock it sets the
	// transaction's idle_in_transaction_session_timeout to the lease's
	// TTL: a holder that stops talking to the server (paused, cut off)
	// loses its session, its transaction and the lock with them.
	lock, unlock string
	// live answers which of the keys ($2) are still locked by the
	// backends ($3) holding their leases (Extend).
	live string
	// read is the record, read after the lock by a statement of its own
	// (a snapshot of its own, under READ COMMITTED): another holder may
	// have finished in between. One row, NULLs when there is none.
	read string
	// insert writes the outcome as a new record, and releases the key's
	// session-level lock (see commitHeld).
	insert string
	// The statements of a lease batch held by a session (heldbatch.go),
	// over arrays of keys ($2) of the namespace $1. batchSetup answers
	// the transaction's id, sets its idle_in_transaction_session_timeout
	// to $1 (ms), and answers whether its isolation is READ COMMITTED and
	// the backend's process ID. batchLock tries each key's session-level
	// lock, unless a live record is there (NULL), and answers the keys
	// whose lock it did not take, by their place in the array (from 1);
	// batchRead reads the keys' records after it (a snapshot of its own),
	// a row for each key that has one, by its place, as read does, and
	// the server's clock. batchGuard is txGuardSQL that also sets the
	// transaction's lock_timeout, before batchInsert.
	// batchUnlock releases keys' session-level locks. batchInsert writes
	// the completed records of the keys, owners ($3), fences ($4),
	// fingerprints ($5), values ($6) and retentions ($7, ms), releasing
	// each key's session-level lock after taking its transaction-level
	// one, as insert does for one key.
	batchSetup, batchLock, batchRead, batchUnlock, batchInsert, batchGuard string
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
	hs := newHeldSQL(*table, n.heldKey, n.table)
	s.heldSQL.Store(hs)
	return hs, nil
}

// newHeldSQL returns the statements of leases held by transactions on the
// records table (its full name, quoted), with heldKey the function that
// makes the second half of a key's advisory lock, the one the functions
// try, and hashTable the table's name as held_key hashes it: the
// statements over a batch's keys compute that half inline, as
// acquireBatchSQL does, rather than call the function for each key.
func newHeldSQL(table, heldKey, hashTable string) *heldSQL {
	lockKey := heldLockClass + ", " + heldKey + "($1, $2)"
	xKey := heldLockClass + ", " + heldKeyHashOf(hashTable, "$1", "x.key")
	return &heldSQL{
		batchSetup: `SELECT pg_current_xact_id()::text, set_config('idle_in_transaction_session_timeout', $1::text, true) IS NOT NULL,
				current_setting('transaction_isolation') = 'read committed', pg_backend_pid()`,
		// Each key's record is looked up by its primary key, in a
		// correlated subquery with a LIMIT, which the planner can turn
		// neither into a join nor into a hashed scan of the whole table
		// (as it did an EXISTS, the cost growing with the table).
		// Only the keys not locked are answered (a fresh batch: none),
		// with their place in the array: the subquery, volatile, is
		// neither pulled up nor filtered before each key's lock is tried.
		batchLock: `SELECT s.n, s.locked FROM (SELECT x.n, CASE WHEN (SELECT true FROM ` + table + ` t
					WHERE t.ns = $1 AND t.key = x.key AND t.expires_at > clock_timestamp() LIMIT 1) THEN NULL
				ELSE pg_try_advisory_lock(` + xKey + `) END AS locked
			FROM unnest($2::bytea[]) WITH ORDINALITY AS x(key, n)) s
			WHERE s.locked IS NOT TRUE`,
		// Only the keys that have a record are answered, with their
		// place in the array, and one row of NULLs when none has: each
		// row has the server's clock, read after every lock of the batch.
		batchRead: `SELECT r.n, r.state, r.fence, r.attempts, r.value, r.fingerprint, r.live, r.remaining, ` + clockUS + `
			FROM (SELECT) one LEFT JOIN (SELECT x.n, t.state, t.fence, t.attempts, t.value, t.fingerprint,
					t.expires_at > clock_timestamp() AS live,
					ceil(extract(epoch FROM t.deadline - clock_timestamp()) * 1000)::bigint AS remaining
				FROM unnest($2::bytea[]) WITH ORDINALITY AS x(key, n)
				JOIN LATERAL (SELECT * FROM ` + table + ` r WHERE r.ns = $1 AND r.key = x.key LIMIT 1) t ON true) r ON true`,
		batchUnlock: `SELECT pg_advisory_unlock(` + xKey + `) FROM unnest($2::bytea[]) AS x(key)`,
		// Each row takes the key's transaction-level lock (the session's
		// already: at once) and then releases its session-level one (a
		// CASE evaluates its condition first), before it is inserted:
		// the key stays covered until the COMMIT. An unlock is not undone
		// if the statement fails: the caller counts the keys as lost then.
		// The lock's key is hashed once a row (h).
		batchInsert: `WITH x AS MATERIALIZED (
				SELECT x.*, CASE WHEN pg_advisory_xact_lock(` + heldLockClass + `, x.h) IS NULL THEN pg_advisory_unlock(` + heldLockClass + `, x.h)
					ELSE pg_advisory_unlock(` + heldLockClass + `, x.h) END AS unlocked
				FROM (SELECT x.*, ` + heldKeyHashOf(hashTable, "$1", "x.key") + ` AS h
					FROM unnest($2::bytea[], $3::text[], $4::bigint[], $5::bytea[], $6::bytea[], $7::bigint[])
						AS x(key, owner, fence, fp, value, ret)) x)
			INSERT INTO ` + table + ` (ns, key, state, owner, fence, deadline, attempts, fingerprint,
				value, created_at, ended_at, expires_at)
			SELECT $1::text, x.key, 'c', x.owner, x.fence, NULL, 1, x.fp, x.value,
				clock_timestamp(), clock_timestamp(), clock_timestamp() + x.ret * interval '1 millisecond'
			FROM x`,
		// A row another transaction holds (an INSERT of the same key not
		// yet committed) is waited for at most as long as the functions
		// wait (lockTimeout), not until commitTimeout.
		batchGuard: txGuardSQL + ", set_config('lock_timeout', '" + lockTimeout + "', true)",
		unlock:     "SELECT pg_advisory_unlock(" + lockKey + ")",
		// A lock of two int4 keys is listed with objsubid 2, the second
		// key in objid as an oid.
		live: `SELECT x.key FROM unnest($2::bytea[], $3::int[]) AS x(key, pid)
			WHERE EXISTS (SELECT FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
				AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
				AND l.pid = x.pid AND l.classid = ` + heldLockClass + ` AND l.objsubid = 2
				AND l.objid = ` + heldKey + `($1, x.key)::oid)`,
		// A subquery of its own, so that the lock is tried once (a
		// volatile expression is not pulled up into the outer query).
		lock: `SELECT s.locked, CASE WHEN s.locked THEN pg_current_xact_id()::text END,
				current_setting('transaction_isolation') = 'read committed', pg_backend_pid()
			FROM (SELECT CASE WHEN EXISTS (SELECT FROM ` + table + ` t
					WHERE t.ns = $1 AND t.key = $2 AND t.expires_at > clock_timestamp()) THEN NULL
				WHEN pg_try_advisory_xact_lock(` + lockKey + `) AND pg_try_advisory_lock(` + lockKey + `)
					THEN set_config('idle_in_transaction_session_timeout', $3::text, true) IS NOT NULL
				ELSE false END AS locked) s`,
		read: `SELECT t.state, t.fence, t.attempts, t.value, t.fingerprint, t.expires_at > clock_timestamp(),
				ceil(extract(epoch FROM t.deadline - clock_timestamp()) * 1000)::bigint, ` + clockUS + `
			FROM (SELECT) one LEFT JOIN ` + table + ` t ON t.ns = $1 AND t.key = $2`,
		// The release of the session-level lock rides along (a CTE with a
		// volatile function runs once, before the INSERT): the
		// transaction-level one covers the key until the COMMIT, and an
		// advisory unlock is not undone if the INSERT fails. That one is
		// taken again first (the session's already, so at once): after a
		// COMMIT of the handler's own, this is another transaction, which
		// has none.
		insert: `WITH unlocked AS (SELECT pg_advisory_unlock(` + lockKey + `)
				FROM (SELECT pg_advisory_xact_lock(` + lockKey + `)) x)
			INSERT INTO ` + table + ` (ns, key, state, owner, fence, deadline, attempts, fingerprint,
				value, created_at, ended_at, expires_at)
			SELECT $1::text, $2::bytea, $3::text, $4::text, $5::bigint, NULL, 1, $6::bytea, $7::bytea,
				clock_timestamp(), clock_timestamp(), clock_timestamp() + $8::bigint * interval '1 millisecond'
			FROM unlocked`,
	}
}
