package pgstore

// The statements of a batch's leases and records (AcquireBatch,
// finishBatch). Each settles the common case with one set-based write and
// calls the per-key function of schema.go only for the keys that write
// left undecided, so that a batch of new keys does not pay a PL/pgSQL call
// per key (issue 39: the per-key calls cost PostgreSQL about 60 µs of CPU
// per key to acquire and 70 µs to finish, most of pg-batch's CPU per
// message).

// acquireBatchSQL is AcquireBatch's statement: $1 the namespace, then the
// keys, owners, TTLs and retentions (ms) and fingerprints of the batch, in
// key order. A key without a record, whose advisory lock (the lock a lease
// held by a transaction takes) is free, gets its new lease from one INSERT
// of every such key, in key order, with the values the acquire function's
// first INSERT gives it; every other key (a record exists, or its lock is
// held) goes through the acquire function, which decides it exactly as a
// single Acquire does. The rows come back in the order of the arrays: the
// acquire function's columns (status 1, attempts 1, the whole TTL left and
// no value for a new lease).
//
// The INSERT runs to its end before any acquire call: the first branch
// of the UNION reads all its rows. Its advisory locks, like the
// function's, are held until the statement's transaction ends. Like the
// function, it waits at most lock_timeout (set for the statement's
// transaction, the first thing x does) for a key's row that another
// transaction is writing; then the statement fails, every key of the
// batch with it (lock.ErrUnavailable), as when a function call timed out.
func acquireBatchSQL(n names) string {
	return `WITH x AS (
	SELECT x.*, clock_timestamp() AS now_ts, set_config('lock_timeout', '` + lockTimeout + `', true) AS lt
	FROM unnest($2::bytea[], $3::text[], $4::bigint[], $5::bigint[], $6::bytea[])
		WITH ORDINALITY AS x(key, owner, ttl, ret, fp, n)
), ins AS (
	INSERT INTO ` + n.table + ` AS t (ns, key, state, owner, fence, deadline, attempts, fingerprint,
		value, created_at, ended_at, expires_at)
	SELECT $1, x.key, 'p', x.owner, ` + clockUS + `, x.now_ts + x.ttl * interval '1 millisecond', 1, x.fp,
		NULL, x.now_ts, NULL, x.now_ts + (x.ttl + x.ret) * interval '1 millisecond'
	FROM x
	WHERE pg_try_advisory_xact_lock(` + heldLockClass + `, ` + heldKeyHashOf(n.table, "$1", "x.key") + `)
	ORDER BY x.key
	ON CONFLICT (ns, key) DO NOTHING
	RETURNING t.key, t.fence
)
SELECT status, fence, attempts, remaining_ms, value FROM (
	SELECT 1 AS status, i.fence, 1 AS attempts, x.ttl AS remaining_ms, NULL::bytea AS value, x.n
	FROM x JOIN ins i ON i.key = x.key
	UNION ALL
	SELECT a.status, a.fence, a.attempts, a.remaining_ms, a.value, x.n
	FROM x CROSS JOIN LATERAL ` + n.acquire + `($1, x.key, x.owner, x.ttl, x.ret, x.fp) a
	WHERE NOT EXISTS (SELECT FROM ins i WHERE i.key = x.key)
) r ORDER BY r.n`
}

// finishBatchSQL is finishBatch's statement, in the batch's transaction:
// $1 the namespace, then the keys, owners, fences, values and retentions
// (ms) of the records to complete. One UPDATE completes every record
// still held by its lease, as the finish function would; finish_tx is
// called only for the others, and raises (SQLSTATE AQ001), so that the
// COMMIT sent after it rolls the batch back.
//
// The UPDATE finds its rows by their ctid, each looked up by its primary
// key: a plan that cannot turn into a scan of the namespace, whatever the
// table's statistics say (a table not yet analyzed made the planner scan
// every row of the namespace for a join on the key). A row updated since
// its lookup (the heartbeat renewed the lease) is not found by its old
// ctid and goes to finish_tx, which decides it. finishBatch runs it under
// a custom plan and the functions' lock_timeout (see there).
func finishBatchSQL(n names) string {
	return `WITH x AS (
	SELECT x.*, clock_timestamp() AS now_ts
	FROM unnest($2::bytea[], $3::text[], $4::bigint[], $5::bytea[], $6::bigint[]) AS x(key, owner, fence, value, ret)
), u AS (
	UPDATE ` + n.table + ` t SET state = 'c', deadline = NULL, value = x.value,
		ended_at = x.now_ts, expires_at = x.now_ts + x.ret * interval '1 millisecond'
	FROM x
	WHERE t.ctid = ANY(ARRAY(SELECT (SELECT r.ctid FROM ` + n.table + ` r WHERE r.ns = $1 AND r.key = x.key) FROM x))
		AND t.ns = $1 AND t.key = x.key AND t.owner = x.owner AND t.fence = x.fence
		AND t.state = 'p' AND t.expires_at > x.now_ts
	RETURNING t.key, t.owner, t.fence
)
SELECT ` + n.finishTx + `($1, x.key, x.owner, x.fence, 'c', x.value, x.ret) FROM x
WHERE NOT EXISTS (SELECT FROM u WHERE u.key = x.key AND u.owner = x.owner AND u.fence = x.fence)`
}
