package pgstore

import (
	"fmt"
	"strings"
)

// formatVersion is the version of the table's layout and of the functions'
// behaviour; it is written in the table's comment, which Check reads.
const formatVersion = 1

// tableComment marks a table made by this package's migration.
var tableComment = fmt.Sprintf("amqpidem pgstore records, format %d", formatVersion)

// migrationSQL is the schema, with {table}, {acquire}, {finish} and
// {index} replaced by quoted identifiers, and {checkformat} by the
// table's formatCheckSQL.
//
// One row per (namespace, key). state: 'p' in progress (a lease: owner,
// fence, deadline), 'c' completed (value: the result), 'f' failed (value:
// the error text), 'r' released, 'x' cancelled (released with its attempt
// taken back). A row whose expires_at has passed is treated as absent by
// every function, and deleted by the cleanup.
//
// Every time is the server's clock_timestamp(): the real time of the
// statement, not the start of its transaction, which matters for a
// completion made at the end of a long handler transaction. A fence is
// read from the clock inside the statement that writes it ({clockus}), so
// that no write made in between can have used a later clock.
//
// The functions run with the search_path of the migration (so that a
// handler's SET search_path cannot point them at another table) and a
// lock_timeout: a record row held by a transaction that does not end (a
// COMMIT waiting for a synchronous standby, a client gone silent) makes
// the call fail as unavailable rather than wait without end.
const migrationSQL = `
CREATE TABLE IF NOT EXISTS {table} (
	ns          text        NOT NULL,
	key         bytea       NOT NULL,
	state       text        NOT NULL CHECK (state IN ('p', 'c', 'f', 'r', 'x')),
	owner       text        NOT NULL,
	fence       bigint      NOT NULL,
	deadline    timestamptz,
	attempts    integer     NOT NULL,
	fingerprint bytea       NOT NULL,
	value       bytea,
	created_at  timestamptz NOT NULL,
	ended_at    timestamptz,
	expires_at  timestamptz NOT NULL,
	PRIMARY KEY (ns, key)
);

CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);

-- The format this package reads. A table of another format is not
-- touched: this release cannot use it.
{checkformat}

-- acquire: take a lease on one key, or say why not. status: 1 acquired,
-- 2 completed, 3 failed, 4 in progress, 5 conflict (another fingerprint).
-- Most keys are new: it inserts first. A key that exists is read without
-- a lock: a final record (completed, failed) and a live lease are answered
-- from that read. A write to it is compare-and-set on the row as read, and
-- the function reads again when another statement changed it first.
CREATE OR REPLACE FUNCTION {acquire}(p_ns text, p_key bytea, p_owner text, p_ttl_ms bigint,
	p_ret_ms bigint, p_fp bytea,
	OUT status int, OUT fence bigint, OUT attempts int, OUT remaining_ms bigint, OUT value bytea)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = '{locktimeout}'
AS $fn$
DECLARE
	r      {table}%ROWTYPE;
	now_ts timestamptz;
	ttl    interval := p_ttl_ms * interval '1 millisecond';
	keep   interval := (p_ttl_ms + p_ret_ms) * interval '1 millisecond';
BEGIN
	IF NOT pg_try_advisory_xact_lock({heldlock}) THEN
		-- A transaction holds the key's lease (held.go): busy, unless
		-- the record already tells how the key ended.
		SELECT * INTO r FROM {table} t WHERE t.ns = p_ns AND t.key = p_key;
		fence := coalesce(r.fence, 0); attempts := coalesce(r.attempts, 0); remaining_ms := p_ttl_ms;
		status := 4;
		IF FOUND AND r.expires_at > clock_timestamp() AND r.state IN ('c', 'f') THEN
			remaining_ms := 0;
			IF length(p_fp) > 0 AND length(r.fingerprint) > 0 AND r.fingerprint <> p_fp THEN
				status := 5;
				RETURN;
			END IF;
			status := CASE r.state WHEN 'c' THEN 2 ELSE 3 END;
			value := r.value;
		END IF;
		RETURN;
	END IF;
	FOR try IN 1..100 LOOP
		now_ts := clock_timestamp();
		INSERT INTO {table} AS t (ns, key, state, owner, fence, deadline, attempts, fingerprint,
			value, created_at, ended_at, expires_at)
		VALUES (p_ns, p_key, 'p', p_owner, {clockus}, now_ts + ttl, 1, p_fp,
			NULL, now_ts, NULL, now_ts + keep)
		ON CONFLICT (ns, key) DO NOTHING
		RETURNING t.fence INTO fence;
		IF FOUND THEN
			status := 1; attempts := 1; remaining_ms := p_ttl_ms;
			RETURN;
		END IF;
		SELECT * INTO r FROM {table} t WHERE t.ns = p_ns AND t.key = p_key;
		IF NOT FOUND THEN
			CONTINUE; -- deleted since the insert found it: insert again
		END IF;

		IF r.expires_at <= now_ts THEN
			-- Past its retention, not yet deleted: a new record, with a
			-- fence above the old one's.
			UPDATE {table} t SET state = 'p', owner = p_owner, fence = greatest(r.fence + 1, {clockus}),
				deadline = now_ts + ttl, attempts = 1, fingerprint = p_fp, value = NULL,
				created_at = now_ts, ended_at = NULL, expires_at = now_ts + keep
			WHERE t.ns = p_ns AND t.key = p_key
				AND (t.state, t.owner, t.fence, t.attempts, t.expires_at) = (r.state, r.owner, r.fence, r.attempts, r.expires_at)
			RETURNING t.fence INTO fence;
			IF FOUND THEN
				status := 1; attempts := 1; remaining_ms := p_ttl_ms;
				RETURN;
			END IF;
			CONTINUE;
		END IF;

		fence := r.fence;
		attempts := r.attempts;
		remaining_ms := 0;
		IF length(p_fp) > 0 AND length(r.fingerprint) > 0 AND r.fingerprint <> p_fp THEN
			status := 5;
			RETURN;
		END IF;
		IF r.state IN ('c', 'f') THEN
			status := CASE r.state WHEN 'c' THEN 2 ELSE 3 END;
			value := r.value;
			RETURN;
		END IF;
		IF r.state = 'p' AND r.owner = p_owner THEN
			-- A retry of this same Acquire (its answer was lost): the lease
			-- is ours already.
			IF r.deadline >= now_ts + ttl THEN
				status := 1;
				remaining_ms := ceil(extract(epoch FROM r.deadline - now_ts) * 1000)::bigint;
				RETURN;
			END IF;
			UPDATE {table} t SET deadline = now_ts + ttl, expires_at = greatest(t.expires_at, now_ts + keep)
			WHERE t.ns = p_ns AND t.key = p_key
				AND (t.state, t.owner, t.fence, t.attempts, t.expires_at) = (r.state, r.owner, r.fence, r.attempts, r.expires_at);
			IF FOUND THEN
				status := 1; remaining_ms := p_ttl_ms;
				RETURN;
			END IF;
			CONTINUE;
		END IF;
		IF r.state = 'p' AND r.deadline > now_ts THEN
			status := 4;
			remaining_ms := greatest(ceil(extract(epoch FROM r.deadline - now_ts) * 1000)::bigint, 1);
			RETURN;
		END IF;

		-- Released or cancelled by its owner, or its lease expired: a new
		-- lease, a higher fence, one more attempt.
		UPDATE {table} t SET state = 'p', owner = p_owner, fence = greatest(r.fence + 1, {clockus}),
			deadline = now_ts + ttl, attempts = r.attempts + 1, expires_at = now_ts + keep
		WHERE t.ns = p_ns AND t.key = p_key
			AND (t.state, t.owner, t.fence, t.attempts, t.expires_at) = (r.state, r.owner, r.fence, r.attempts, r.expires_at)
		RETURNING t.fence INTO fence;
		IF FOUND THEN
			status := 1; attempts := r.attempts + 1; remaining_ms := p_ttl_ms;
			RETURN;
		END IF;
	END LOOP;
	RAISE EXCEPTION 'amqpidem: the record changed under 100 acquires in a row'
		USING ERRCODE = '40001';
END
$fn$;

-- held_key: the second half of the key of a record's transaction-level
-- advisory lock, which is a lease held by a transaction (held.go): a hash
-- of the table, the namespace and the key (the first half, 1634562409,
-- "amqi", keeps it apart from other programs' advisory locks). The
-- functions here compute the same inline; the Store's own statements call
-- it, so that they agree with them however the Store's Config spells the
-- table, and find the table's schema by it. Two keys whose hashes meet
-- only wait for each other (a busy answer), never share a lease: the
-- record decides. Plain SQL, immutable: inlined where it is called.
CREATE OR REPLACE FUNCTION {heldkey}(p_ns text, p_key bytea)
RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $fn$ SELECT {heldkeyhash} $fn$;

-- acquire_held: what the previous build of TxHandler called to take a
-- lease held by a transaction (this one sends plain statements, see
-- held.go), kept so that its consumers keep working the same during a
-- rolling upgrade; the next release drops it. The transaction-level
-- advisory lock of the key is the lease, and nothing is written until the
-- outcome (finish_held), which commits with the handler's writes. status as for
-- acquire, and 6 when the key has a record that counts attempts (released,
-- cancelled, or a lease that expired): the caller ends this transaction
-- and takes the lease with acquire instead (also under an isolation level
-- above READ COMMITTED). On 1 it sets the transaction's
-- idle_in_transaction_session_timeout to the TTL: a holder that stops
-- talking to the server (paused, cut off) loses its session, its
-- transaction and the lock with them. The fence is taken from the clock,
-- above an expired record's; xid is the transaction's id, by which the
-- caller can tell whether the handler committed it on its own.
CREATE OR REPLACE FUNCTION {acquireheld}(p_ns text, p_key bytea, p_ttl_ms bigint, p_fp bytea,
	OUT status int, OUT fence bigint, OUT attempts int, OUT remaining_ms bigint, OUT value bytea,
	OUT xid text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
DECLARE
	r {table}%ROWTYPE;
BEGIN
	fence := 0; attempts := 0; remaining_ms := p_ttl_ms;
	IF current_setting('transaction_isolation') <> 'read committed' THEN
		-- A snapshot older than the lock could miss a lease taken and
		-- committed just before it: a record-row lease instead.
		status := 6;
		RETURN;
	END IF;
	-- The record first, without the lock: a duplicate of finished work is
	-- answered without making anyone busy. Then the lock, and the record
	-- again (another holder may have finished in between).
	FOR try IN 1..2 LOOP
		fence := 0; attempts := 0; remaining_ms := p_ttl_ms;
		SELECT * INTO r FROM {table} t WHERE t.ns = p_ns AND t.key = p_key;
		IF FOUND AND r.expires_at > clock_timestamp() THEN
			fence := r.fence; attempts := r.attempts; remaining_ms := 0;
			IF length(p_fp) > 0 AND length(r.fingerprint) > 0 AND r.fingerprint <> p_fp THEN
				status := 5;
			ELSIF r.state IN ('c', 'f') THEN
				status := CASE r.state WHEN 'c' THEN 2 ELSE 3 END;
				value := r.value;
			ELSIF r.state = 'p' AND r.deadline > clock_timestamp() THEN
				status := 4;
				remaining_ms := greatest(ceil(extract(epoch FROM r.deadline - clock_timestamp()) * 1000)::bigint, 1);
			ELSE
				status := 6;
			END IF;
			RETURN;
		END IF;
		IF try = 1 AND NOT pg_try_advisory_xact_lock({heldlock}) THEN
			status := 4;
			RETURN;
		END IF;
	END LOOP;
	PERFORM set_config('idle_in_transaction_session_timeout', p_ttl_ms::text, true);
	status := 1; attempts := 1;
	fence := greatest(coalesce(r.fence + 1, 0), {clockus});
	xid := pg_current_xact_id()::text;
END
$fn$;


-- finish_held: write the outcome of a lease held by a transaction (p_state:
-- 'c' completed, 'f' failed, 'r' released), first attempt, as a new
-- record: once the transaction that held the lease ended without it, in
-- one of its own, if the lock is free and no live record is there (the
-- previous build also called it in the holding transaction, whose lock
-- it has already). Raises
-- SQLSTATE {leaselost} where it writes nothing, so that a COMMIT sent with
-- it rolls back; a retry of a call that landed finds its own record.
CREATE OR REPLACE FUNCTION {finishheld}(p_ns text, p_key bytea, p_owner text, p_fence bigint,
	p_state text, p_value bytea, p_ret_ms bigint, p_fp bytea)
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = '{locktimeout}'
AS $fn$
DECLARE
	now_ts timestamptz := clock_timestamp();
BEGIN
	IF pg_try_advisory_xact_lock({heldlock}) THEN
		INSERT INTO {table} AS t (ns, key, state, owner, fence, deadline, attempts, fingerprint,
			value, created_at, ended_at, expires_at)
		VALUES (p_ns, p_key, p_state, p_owner, p_fence, NULL, 1, p_fp,
			p_value, now_ts, now_ts, now_ts + p_ret_ms * interval '1 millisecond')
		ON CONFLICT (ns, key) DO UPDATE SET state = excluded.state, owner = excluded.owner,
			fence = excluded.fence, deadline = NULL, attempts = 1, fingerprint = excluded.fingerprint,
			value = excluded.value, created_at = now_ts, ended_at = now_ts, expires_at = excluded.expires_at
		WHERE t.expires_at <= now_ts AND t.fence < p_fence;
		IF FOUND THEN
			RETURN;
		END IF;
	END IF;
	PERFORM FROM {table} t WHERE t.ns = p_ns AND t.key = p_key AND t.owner = p_owner
		AND t.fence = p_fence AND t.state = p_state AND t.expires_at > now_ts;
	IF NOT FOUND THEN
		RAISE EXCEPTION 'amqpidem: the lease is no longer held (key %, fence %)', encode(p_key, 'escape'), p_fence
			USING ERRCODE = '{leaselost}';
	END IF;
END
$fn$;

-- finish: end a lease with an outcome, compare-and-set on owner and fence.
-- p_state: 'c' completed, 'f' failed (p_value stored), 'r' released, 'x'
-- cancelled (attempt taken back, never below 0). Returns 1 when written,
-- or already written by this same lease (a retried call), 0 when the
-- lease is no longer held. Called in a handler's transaction, its update
-- keeps the row locked until that transaction ends: a takeover waits for
-- the outcome.
CREATE OR REPLACE FUNCTION {finish}(p_ns text, p_key bytea, p_owner text, p_fence bigint,
	p_state text, p_value bytea, p_ret_ms bigint)
RETURNS int
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = '{locktimeout}'
AS $fn$
DECLARE
	now_ts timestamptz := clock_timestamp();
BEGIN
	UPDATE {table} t SET state = p_state, deadline = NULL,
		attempts = CASE WHEN p_state = 'x' THEN greatest(t.attempts - 1, 0) ELSE t.attempts END,
		value = CASE WHEN p_state IN ('c', 'f') THEN p_value ELSE t.value END,
		ended_at = now_ts, expires_at = now_ts + p_ret_ms * interval '1 millisecond'
	WHERE t.ns = p_ns AND t.key = p_key AND t.owner = p_owner AND t.fence = p_fence
		AND t.state = 'p' AND t.expires_at > now_ts;
	IF FOUND THEN
		RETURN 1;
	END IF;
	-- A retry of this same call that landed.
	PERFORM FROM {table} t WHERE t.ns = p_ns AND t.key = p_key AND t.owner = p_owner
		AND t.fence = p_fence AND t.state = p_state AND t.expires_at > now_ts;
	RETURN CASE WHEN FOUND THEN 1 ELSE 0 END;
END
$fn$;

-- finish_tx: finish, for a call sent together with the COMMIT of the
-- transaction it runs in (TxHandler sends both in one round trip): where
-- finish answers 0 (the lease is no longer held) it raises SQLSTATE AQ001
-- instead, so that the transaction is aborted and the COMMIT after it
-- rolls back. (An answer of 0 would let that COMMIT commit the handler's
-- writes without the record.)
CREATE OR REPLACE FUNCTION {finishtx}(p_ns text, p_key bytea, p_owner text, p_fence bigint,
	p_state text, p_value bytea, p_ret_ms bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $fn$
BEGIN
	IF {finish}(p_ns, p_key, p_owner, p_fence, p_state, p_value, p_ret_ms) <> 1 THEN
		RAISE EXCEPTION 'amqpidem: the lease is no longer held (key %, fence %)', encode(p_key, 'escape'), p_fence
			USING ERRCODE = '{leaselost}';
	END IF;
END
$fn$;
`

// outboxFormatVersion is the version of the producer outbox table's layout,
// written in its comment.
const outboxFormatVersion = 2

// outboxComment marks an outbox table made by this package's migration.
var outboxComment = fmt.Sprintf("amqpidem pgstore outbox, format %d", outboxFormatVersion)

// outboxComment1 is the comment of an outbox table of format 1, which the
// migration upgrades in place.
const outboxComment1 = "amqpidem pgstore outbox, format 1"

// outboxSQL is the producer outbox's table (see Outbox), with {outbox},
// {outboxkeys}, {outboxpending}, {outboxorder}, {outboxsent},
// {outboxdead}, {upgradeoutbox} and {checkoutboxformat} replaced.
//
// One row per message written. state: 'p' pending (to be published), 's'
// sent (confirmed by the broker; kept for RelayConfig.Retention), 'd' dead
// (refused by the broker RelayConfig.MaxAttempts times: an operator lists
// and re-drives it). A pending row is claimable when due_at has passed: a
// relay's claim moves due_at to the end of its claim, a refusal to the
// next try.
//
// seq is a row's place among the rows of its order key, NULL without one.
// Write takes it from the key's row in {outboxkeys} by updating that row,
// whose lock the writing transaction then holds until it ends: a later
// writer of the key waits, and takes the next number once the earlier
// transaction committed (or rolled back, and the number is taken again).
// So the order of seq is the order in which the key's transactions
// committed, and a row that is visible has every row of lower seq of its
// key visible too (or gone for good). It is plain data: it survives a dump
// and restore, unlike a transaction id.
//
// The indexes are partial: on pending rows (the relay's queue), pending
// rows with an order key (each key's head and chain, and the key's last
// pending number), sent rows (cleanup) and dead ones (an operator's list).
// A claim changes no indexed column, so it can be a HOT update.
const outboxSQL = `
CREATE TABLE IF NOT EXISTS {outboxkeys} (
	order_key text   PRIMARY KEY,
	seq       bigint NOT NULL
);

{upgradeoutbox}

CREATE TABLE IF NOT EXISTS {outbox} (
	id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	order_key  text,
	seq        bigint,
	message_id text        NOT NULL,
	message    bytea       NOT NULL,
	state      text        NOT NULL DEFAULT 'p' CHECK (state IN ('p', 's', 'd')),
	due_at     timestamptz NOT NULL DEFAULT '-infinity',
	claimed_by text,
	attempts   integer     NOT NULL DEFAULT 0,
	last_error text,
	created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
	sent_at    timestamptz
);

CREATE INDEX IF NOT EXISTS {outboxpending} ON {outbox} (id) WHERE state = 'p';
CREATE INDEX IF NOT EXISTS {outboxorder} ON {outbox} (order_key, seq) WHERE state = 'p' AND order_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS {outboxsent} ON {outbox} (sent_at) WHERE state = 's';
CREATE INDEX IF NOT EXISTS {outboxdead} ON {outbox} (id) WHERE state = 'd';
CREATE INDEX IF NOT EXISTS {outboxdeadorder} ON {outbox} (order_key, seq) WHERE state = 'd' AND order_key IS NOT NULL;

{checkoutboxformat}
`

// upgradeOutboxSQL upgrades an outbox table of format 1, which ordered
// rows by their writing transaction's id (txid: the order in which
// transactions first wrote, not the order they committed in), to format
// 2: the rows of each order key are numbered in the order format 1 would
// have published them, the keys' counters start after them, and txid is
// dropped (with its index). The table is locked against writers meanwhile.
// Rows that a writer of the previous release inserts afterwards have no
// seq: a relay publishes them as if they had no order key.
const upgradeOutboxSQL = `DO $do$
BEGIN
	IF obj_description(to_regclass({outboxliteral}), 'pg_class') = {comment1} THEN
		LOCK TABLE {outbox} IN SHARE ROW EXCLUSIVE MODE;
		ALTER TABLE {outbox} ADD COLUMN seq bigint;
		UPDATE {outbox} o SET seq = s.n
			FROM (SELECT id, row_number() OVER (PARTITION BY order_key ORDER BY txid, id) AS n
				FROM {outbox} WHERE order_key IS NOT NULL) s
			WHERE o.id = s.id;
		INSERT INTO {outboxkeys} (order_key, seq)
			SELECT order_key, max(seq) FROM {outbox} WHERE order_key IS NOT NULL GROUP BY order_key
			ON CONFLICT (order_key) DO UPDATE SET seq = greatest({outboxkeys}.seq, excluded.seq);
		ALTER TABLE {outbox} DROP COLUMN txid;
		COMMENT ON TABLE {outbox} IS {comment};
	END IF;
END
$do$;`

// formatCheckSQL marks the table {table} as of the format {comment} (a
// string literal), or, when it says another, refuses it: a table of
// another format is not touched, this release cannot use it.
const formatCheckSQL = `DO $do$
DECLARE
	found text := obj_description({tableliteral}::regclass, 'pg_class');
BEGIN
	IF found IS NULL THEN
		COMMENT ON TABLE {table} IS {comment};
	ELSIF found <> {comment} THEN
		RAISE EXCEPTION 'amqpidem pgstore: table % says "%", this release needs "%"', {tableliteral}, found, {comment};
	END IF;
END
$do$;`

// formatCheck is formatCheckSQL for the quoted, qualified table and the
// comment text.
func formatCheck(table, comment string) string {
	return strings.NewReplacer(
		"{table}", table,
		"{tableliteral}", literal(table),
		"{comment}", literal(comment),
	).Replace(formatCheckSQL)
}

// literal quotes s as an SQL string literal.
func literal(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}

// heldKeyHash is the SQL of the second half of the key of a record's
// transaction-level advisory lock in the functions of table (held_key), of
// the key p_key of namespace p_ns.
func heldKeyHash(table string) string {
	return heldKeyHashOf(table, "p_ns", "p_key")
}

// heldKeyHashOf is heldKeyHash of the namespace and key given as the SQL
// expressions ns and key, for a statement outside the functions (the
// batch statements of store.go).
func heldKeyHashOf(table, ns, key string) string {
	return "hashtext(" + literal(table+":") + " || " + ns + " || ':' || encode(" + key + ", 'hex'))"
}

// clockUS is the SQL of the server's clock in µs, a fence. The functions
// read it inside the statement that writes it, so that no write made in
// between can have used a later clock; a lease held by a transaction
// reads it under the key's lock, which no other writer of the key holds
// until that lease's record is written.
const clockUS = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"

// leaseLostCode is the SQLSTATE finish_tx raises when the lease is
// no longer held.
const leaseLostCode = "AQ001"

// lockTimeout bounds how long the functions wait for a record row that
// another transaction holds.
const lockTimeout = "2s"

// migrateLock is the key of the advisory lock that serializes concurrent
// migrations (two processes starting at once).
const migrateLock = 0x616d717069646d // "amqpidm"
