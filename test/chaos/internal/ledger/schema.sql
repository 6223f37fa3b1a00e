-- schema.sql: the ledger of one chaos run, created in a schema of its own
-- (the connection's search_path) and dropped with it.

-- One sequence orders executions, effects and completions across processes.
CREATE SEQUENCE seq;

-- ops: every operation the run published and what must become of it:
-- 'apply' (applied once), 'deadletter' (dead-lettered once, never applied)
-- or 'both' (applied once and dead-lettered once: a result over the limit),
-- or 'any' (a hostile message: applied at most once, dead-lettered at most
-- once, either or neither).
CREATE TABLE ops (
	op_id  text PRIMARY KEY,
	expect text NOT NULL CHECK (expect IN ('apply', 'deadletter', 'both', 'any'))
);

-- executions: one row per handler execution, written when it starts.
-- acquired_at is when the consumer sent the Acquire that granted the lease,
-- by its own clock (all consumers run on this machine and share it).
CREATE TABLE executions (
	seq              bigint PRIMARY KEY DEFAULT nextval('seq'),
	exec_id          text NOT NULL UNIQUE,
	op_id            text NOT NULL,
	consumer         text NOT NULL,
	pid              integer NOT NULL,
	attempt          integer NOT NULL,
	fence            bigint NOT NULL,
	header_attempt   bigint,
	acquired_at      timestamptz,
	started_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
	finished_at      timestamptz,
	result           text,
	cancelled_at     timestamptz,
	cause            text,
	deadline_left_ms bigint
);
CREATE INDEX executions_op ON executions (op_id);

-- fences: the highest fencing token the sink has accepted per operation.
CREATE TABLE fences (
	op_id text PRIMARY KEY,
	fence bigint NOT NULL
);

-- applied: the side effect itself, at most once per operation.
CREATE TABLE applied (
	op_id   text PRIMARY KEY,
	exec_id text NOT NULL,
	fence   bigint NOT NULL,
	at      timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- effects: every write that passed the fence check; absorbed is true when
-- the operation had already been applied (a re-execution the sink absorbed).
CREATE TABLE effects (
	seq      bigint PRIMARY KEY DEFAULT nextval('seq'),
	op_id    text NOT NULL,
	exec_id  text NOT NULL,
	fence    bigint NOT NULL,
	absorbed boolean NOT NULL,
	at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX effects_op ON effects (op_id);

-- stale: every write the fence check rejected (a stale lease holder).
CREATE TABLE stale (
	seq          bigint PRIMARY KEY DEFAULT nextval('seq'),
	op_id        text NOT NULL,
	exec_id      text NOT NULL,
	fence        bigint NOT NULL,
	stored_fence bigint NOT NULL,
	at           timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX stale_op ON stale (op_id);

-- completions: every Complete the store accepted, logged right after it;
-- at is when Complete returned, by the consumer's clock.
CREATE TABLE completions (
	seq      bigint NOT NULL DEFAULT nextval('seq'),
	op_id    text NOT NULL,
	fence    bigint NOT NULL,
	consumer text NOT NULL,
	pid      integer NOT NULL,
	at       timestamptz NOT NULL DEFAULT clock_timestamp(),
	PRIMARY KEY (op_id, fence)
);

-- crashes: the crash windows taken, at most once per operation and window,
-- so that a restarted consumer does not crash on the same message forever.
CREATE TABLE crashes (
	op_id   text NOT NULL,
	win     text NOT NULL,
	exec_id text NOT NULL,
	fence   bigint NOT NULL,
	pid     integer NOT NULL,
	at      timestamptz NOT NULL DEFAULT clock_timestamp(),
	PRIMARY KEY (op_id, win)
);
