// Package ledger is the side-effect sink of the chaos suite: a PostgreSQL
// schema per run where the handler's side effect is written, keyed by
// operation id and checked against the lease's fencing token, and where every
// handler execution is logged, so that after a run every operation can be
// classified: lost, applied once, applied more than once, re-executed, or
// written late by a stale lease holder (rejected).
//
// The write is the pattern a user's sink should follow (see Apply): in one
// transaction, raise the operation's fence only if the new one is not lower
// than the highest seen (else reject the write as stale), then insert the
// operation id into a table where it is the primary key (a second insert is
// a re-execution, absorbed).
//
// A Ledger is safe for concurrent use.
package ledger

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed schema.sql
var schemaSQL string

// Expectations of an operation, as stored in the ops table.
const (
	ExpectApply      = "apply"
	ExpectDeadLetter = "deadletter"
	ExpectBoth       = "both"
	// ExpectAny is a hostile message's: what becomes of it depends on
	// what it forged, but it takes effect at most once (applied at most
	// once, dead-lettered at most once) and is never lost.
	ExpectAny = "any"
)

// Ledger is one run's ledger schema, reached through a connection pool.
type Ledger struct {
	pool   *pgxpool.Pool
	schema string
}

var schemaName = regexp.MustCompile(`^[a-z][a-z0-9_]{0,62}$`)

// Create makes schema and the ledger's tables in the database at dsn. The
// schema must not exist yet.
func Create(ctx context.Context, dsn, schema string) error {
	if !schemaName.MatchString(schema) {
		return fmt.Errorf("ledger: schema name %q must match %s", schema, schemaName)
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return fmt.Errorf("ledger: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		return fmt.Errorf("ledger: create schema %s: %w", schema, err)
	}
	if _, err := conn.Exec(ctx, "SET search_path TO "+schema); err != nil {
		return fmt.Errorf("ledger: %w", err)
	}
	if _, err := conn.Exec(ctx, schemaSQL); err != nil {
		return fmt.Errorf("ledger: create tables in %s: %w", schema, err)
	}
	return nil
}

// Drop drops schema and everything in it.
func Drop(ctx context.Context, dsn, schema string) error {
	if !schemaName.MatchString(schema) {
		return fmt.Errorf("ledger: schema name %q must match %s", schema, schemaName)
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return fmt.Errorf("ledger: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
		return fmt.Errorf("ledger: drop schema %s: %w", schema, err)
	}
	return nil
}

// Open connects to the ledger in schema with at most maxConns connections.
// Commits are asynchronous (synchronous_commit off): the suite crashes
// consumers, never PostgreSQL.
func Open(ctx context.Context, dsn, schema string, maxConns int) (*Ledger, error) {
	if !schemaName.MatchString(schema) {
		return nil, fmt.Errorf("ledger: schema name %q must match %s", schema, schemaName)
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	cfg.MaxConns = int32(max(maxConns, 1))
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	cfg.ConnConfig.RuntimeParams["application_name"] = "amqpidem-chaos"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("ledger: ping: %w", err)
	}
	return &Ledger{pool: pool, schema: schema}, nil
}

// Close closes the pool.
func (l *Ledger) Close() { l.pool.Close() }

// Pool returns the connection pool, for the queries of a test.
func (l *Ledger) Pool() *pgxpool.Pool { return l.pool }

// OpID is the ledger's operation id for an idempotency key: the key itself
// when it is valid UTF-8 without NUL bytes and at most 200 bytes, else
// "sha256:" and its hex digest (binary and very long keys).
func OpID(key string) string {
	if len(key) <= 200 && utf8.ValidString(key) && !strings.ContainsRune(key, 0) {
		return key
	}
	sum := sha256.Sum256([]byte(key))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// Op is an operation the run expects to see settled.
type Op struct {
	ID     string
	Expect string // ExpectApply, ExpectDeadLetter, ExpectBoth or ExpectAny
}

// AddOps records the operations of a run.
func (l *Ledger) AddOps(ctx context.Context, ops []Op) error {
	rows := make([][]any, len(ops))
	for i, o := range ops {
		rows[i] = []any{o.ID, o.Expect}
	}
	_, err := l.pool.CopyFrom(ctx, pgx.Identifier{"ops"}, []string{"op_id", "expect"}, pgx.CopyFromRows(rows))
	if err != nil {
		return fmt.Errorf("ledger: add %d ops: %w", len(ops), err)
	}
	return nil
}

// Execution describes one handler execution, logged when it starts.
type Execution struct {
	ExecID   string
	OpID     string
	Consumer string
	PID      int
	Attempt  int
	Fence    int64
	// HeaderAttempt is the attempt header the delivery carried, or -1.
	HeaderAttempt int
	// Acquired is when the Acquire that granted the lease was sent; zero
	// if unknown.
	Acquired time.Time
}

// Start logs the start of an execution.
func (l *Ledger) Start(ctx context.Context, e Execution) error {
	var hdr, acquired any
	if e.HeaderAttempt >= 0 {
		hdr = e.HeaderAttempt
	}
	if !e.Acquired.IsZero() {
		acquired = e.Acquired
	}
	_, err := l.pool.Exec(ctx, `INSERT INTO executions (exec_id, op_id, consumer, pid, attempt, fence, header_attempt, acquired_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`, e.ExecID, e.OpID, e.Consumer, e.PID, e.Attempt, e.Fence, hdr, acquired)
	if err != nil {
		return fmt.Errorf("ledger: log execution of %q: %w", e.OpID, err)
	}
	return nil
}

// Finish records how an execution ended: "applied", "absorbed", "stale",
// "cancelled" or an error text.
func (l *Ledger) Finish(ctx context.Context, execID, result string) error {
	_, err := l.pool.Exec(ctx, `UPDATE executions SET finished_at = clock_timestamp(), result = $2 WHERE exec_id = $1`,
		execID, result)
	if err != nil {
		return fmt.Errorf("ledger: finish %s: %w", execID, err)
	}
	return nil
}

// Cancelled records that an execution's context was done: its cause (empty
// if it was not done) and how long its lease's confirmed local deadline was
// still ahead at that moment (negative: behind).
func (l *Ledger) Cancelled(ctx context.Context, execID, cause string, deadlineLeft time.Duration) error {
	var at any
	if cause != "" {
		at = time.Now()
	}
	_, err := l.pool.Exec(ctx, `UPDATE executions SET cancelled_at = $2, cause = $3, deadline_left_ms = $4 WHERE exec_id = $1`,
		execID, at, cause, deadlineLeft.Milliseconds())
	if err != nil {
		return fmt.Errorf("ledger: cancel %s: %w", execID, err)
	}
	return nil
}

// Outcome is what became of a write to the sink.
type Outcome int

// The outcomes of Apply.
const (
	// Applied: the operation's side effect took place, for the first time.
	Applied Outcome = iota + 1
	// Absorbed: the fence was current but the operation had already been
	// applied: a re-execution, absorbed.
	Absorbed
	// Stale: a higher fence had already written; the write was rejected.
	Stale
)

// String returns the outcome in lower case.
func (o Outcome) String() string {
	switch o {
	case Applied:
		return "applied"
	case Absorbed:
		return "absorbed"
	case Stale:
		return "stale"
	}
	return fmt.Sprintf("outcome(%d)", int(o))
}

// Apply is the side effect, in one transaction: the operation's fence is
// raised to fence unless a higher one is stored (then the write is rejected
// and logged as stale); then the operation is applied unless it already was
// (then the write is absorbed). Every write that passes the fence check is
// logged in effects.
func (l *Ledger) Apply(ctx context.Context, opID, execID string, fence int64) (Outcome, error) {
	out := Outcome(0)
	err := pgx.BeginFunc(ctx, l.pool, func(tx pgx.Tx) error {
		var stored int64
		err := tx.QueryRow(ctx, `INSERT INTO fences AS f (op_id, fence) VALUES ($1, $2)
			ON CONFLICT (op_id) DO UPDATE SET fence = EXCLUDED.fence WHERE f.fence <= EXCLUDED.fence
			RETURNING fence`, opID, fence).Scan(&stored)
		if errors.Is(err, pgx.ErrNoRows) {
			out = Stale
			_, err = tx.Exec(ctx, `INSERT INTO stale (op_id, exec_id, fence, stored_fence)
				SELECT $1, $2, $3, fence FROM fences WHERE op_id = $1`, opID, execID, fence)
			return err
		}
		if err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, `INSERT INTO applied (op_id, exec_id, fence) VALUES ($1, $2, $3)
			ON CONFLICT (op_id) DO NOTHING`, opID, execID, fence)
		if err != nil {
			return err
		}
		out = Absorbed
		if tag.RowsAffected() == 1 {
			out = Applied
		}
		_, err = tx.Exec(ctx, `INSERT INTO effects (op_id, exec_id, fence, absorbed) VALUES ($1, $2, $3, $4)`,
			opID, execID, fence, out == Absorbed)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("ledger: apply %q fence %d: %w", opID, fence, err)
	}
	return out, nil
}

// Completed logs a Complete the store accepted for opID with fence.
func (l *Ledger) Completed(ctx context.Context, opID string, fence int64, consumer string, pid int, at time.Time) error {
	_, err := l.pool.Exec(ctx, `INSERT INTO completions (op_id, fence, consumer, pid, at) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT DO NOTHING`, opID, fence, consumer, pid, at)
	if err != nil {
		return fmt.Errorf("ledger: log completion of %q: %w", opID, err)
	}
	return nil
}

// Completions returns how many Completes the store accepted for opID.
func (l *Ledger) Completions(ctx context.Context, opID string) (int, error) {
	var n int
	err := l.pool.QueryRow(ctx, `SELECT count(*) FROM completions WHERE op_id = $1`, opID).Scan(&n)
	return n, err
}

// FirstExecution reports whether execID is the first execution of opID
// the ledger logged.
func (l *Ledger) FirstExecution(ctx context.Context, opID, execID string) (bool, error) {
	var first bool
	err := l.pool.QueryRow(ctx, `SELECT NOT EXISTS (SELECT FROM executions WHERE op_id = $1 AND seq < (
		SELECT seq FROM executions WHERE exec_id = $2))`, opID, execID).Scan(&first)
	return first, err
}

// ClaimCrash reports whether the caller is the first to take crash window
// win for opID; it records the claim either way.
func (l *Ledger) ClaimCrash(ctx context.Context, opID, win, execID string, fence int64, pid int) (bool, error) {
	tag, err := l.pool.Exec(ctx, `INSERT INTO crashes (op_id, win, exec_id, fence, pid) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT DO NOTHING`, opID, win, execID, fence, pid)
	if err != nil {
		return false, fmt.Errorf("ledger: claim crash %s of %q: %w", win, opID, err)
	}
	return tag.RowsAffected() == 1, nil
}

// AppliedCount returns how many operations have been applied.
func (l *Ledger) AppliedCount(ctx context.Context) (int, error) {
	var n int
	err := l.pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&n)
	return n, err
}

// AppliedBy returns the execution that applied opID, if any.
func (l *Ledger) AppliedBy(ctx context.Context, opID string) (execID string, ok bool, err error) {
	err = l.pool.QueryRow(ctx, `SELECT exec_id FROM applied WHERE op_id = $1`, opID).Scan(&execID)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, nil
	}
	return execID, err == nil, err
}
