package main

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// pgTracer counts, client side, what a pool sends: statements (Exec, Query,
// QueryRow, batched queries, CopyFrom; BEGIN and COMMIT are statements
// too), batches, prepares, and the transactions committed: every COMMIT
// that answered COMMIT, plus every statement (or batch: one implicit
// transaction) that ran successfully outside a transaction block
// (autocommit). A connection's transaction status is read before and after
// each statement. pgconn's own Ping and anything run on pgconn directly
// are not seen. Safe for concurrent use.
type pgTracer struct {
	statements, batches, prepares atomic.Int64
	batched                       atomic.Int64 // statements sent in batches
	commits, autocommits          atomic.Int64
	rollbacks, errors             atomic.Int64
}

// tracerCounts is a snapshot of a pgTracer.
type tracerCounts struct {
	Statements, Batches, Prepares int64
	Batched                       int64
	Commits, Autocommits          int64
	Rollbacks, Errors             int64
}

// RoundTrips is the round trips the statements took: one per statement
// sent alone, one per batch (prepares not counted).
func (c tracerCounts) RoundTrips() int64 { return c.Statements - c.Batched + c.Batches }

// Committed is the transactions committed: explicit COMMITs plus
// autocommit statements and batches.
func (c tracerCounts) Committed() int64 { return c.Commits + c.Autocommits }

// minus is c - o, field by field.
func (c tracerCounts) minus(o tracerCounts) tracerCounts {
	return tracerCounts{
		Statements: c.Statements - o.Statements, Batches: c.Batches - o.Batches, Prepares: c.Prepares - o.Prepares,
		Batched: c.Batched - o.Batched,
		Commits: c.Commits - o.Commits, Autocommits: c.Autocommits - o.Autocommits,
		Rollbacks: c.Rollbacks - o.Rollbacks, Errors: c.Errors - o.Errors,
	}
}

func (t *pgTracer) counts() tracerCounts {
	return tracerCounts{
		Statements: t.statements.Load(), Batches: t.batches.Load(), Prepares: t.prepares.Load(),
		Batched: t.batched.Load(),
		Commits: t.commits.Load(), Autocommits: t.autocommits.Load(),
		Rollbacks: t.rollbacks.Load(), Errors: t.errors.Load(),
	}
}

var (
	_ pgx.QueryTracer    = (*pgTracer)(nil)
	_ pgx.BatchTracer    = (*pgTracer)(nil)
	_ pgx.CopyFromTracer = (*pgTracer)(nil)
	_ pgx.PrepareTracer  = (*pgTracer)(nil)
)

// traceState is what a statement's or batch's start leaves for its end.
type traceState struct {
	txBefore byte // the connection's transaction status before it: 'I' idle
	explicit bool // a batch: a query in it was COMMIT or ROLLBACK
}

type traceKey struct{}

func (t *pgTracer) start(ctx context.Context, conn *pgx.Conn) context.Context {
	return context.WithValue(ctx, traceKey{}, &traceState{txBefore: conn.PgConn().TxStatus()})
}

// end counts the transaction a statement or batch ended, if any.
func (t *pgTracer) end(ctx context.Context, conn *pgx.Conn, tag pgconn.CommandTag, err error) {
	st, _ := ctx.Value(traceKey{}).(*traceState)
	if st == nil {
		return
	}
	if err != nil {
		t.errors.Add(1)
	}
	after := conn.PgConn().TxStatus()
	switch {
	case st.explicit:
	case err == nil && tag.String() == "COMMIT" && st.txBefore != 'I':
		t.commits.Add(1)
	case tag.String() == "ROLLBACK":
		t.rollbacks.Add(1)
	case err == nil && st.txBefore == 'I' && after == 'I':
		t.autocommits.Add(1)
	}
}

func (t *pgTracer) TraceQueryStart(ctx context.Context, conn *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	t.statements.Add(1)
	return t.start(ctx, conn)
}

func (t *pgTracer) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryEndData) {
	t.end(ctx, conn, data.CommandTag, data.Err)
}

func (t *pgTracer) TraceBatchStart(ctx context.Context, conn *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	t.batches.Add(1)
	return t.start(ctx, conn)
}

func (t *pgTracer) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, data pgx.TraceBatchQueryData) {
	t.statements.Add(1)
	t.batched.Add(1)
	switch data.CommandTag.String() {
	case "COMMIT":
		if data.Err == nil {
			t.commits.Add(1)
		}
	case "ROLLBACK":
		t.rollbacks.Add(1)
	default:
		return
	}
	if st, _ := ctx.Value(traceKey{}).(*traceState); st != nil {
		st.explicit = true
	}
}

func (t *pgTracer) TraceBatchEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceBatchEndData) {
	t.end(ctx, conn, pgconn.CommandTag{}, data.Err)
}

func (t *pgTracer) TraceCopyFromStart(ctx context.Context, conn *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	t.statements.Add(1)
	return t.start(ctx, conn)
}

func (t *pgTracer) TraceCopyFromEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceCopyFromEndData) {
	t.end(ctx, conn, data.CommandTag, data.Err)
}

func (t *pgTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

func (t *pgTracer) TracePrepareEnd(_ context.Context, _ *pgx.Conn, data pgx.TracePrepareEndData) {
	if !data.AlreadyPrepared {
		t.prepares.Add(1)
	}
}
