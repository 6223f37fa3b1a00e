package pgstore

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// savepoint is where a handler's work begins in its transaction: its
// Rollback rolls back to it, and, in a transaction holding the lease, an
// outcome other than completed is written after rolling the whole
// transaction back.
const savepoint = "amqpidem_handler"

// txState is what a handler did to its handlerTx.
type txState int

const (
	txOpen txState = iota
	// txKept: the handler called Commit. Its work stays in the
	// transaction, which TxHandler commits with the record.
	txKept
	// txUndone: the handler called Rollback, which rolled its work back
	// to the savepoint.
	txUndone
)

// handlerTx is the pgx.Tx a TxHandler's function gets, on either lease:
// a nested transaction of TxHandler's own, which begins at the savepoint
// and whose statements go to TxHandler's transaction without a round trip
// of a BEGIN of their own. As with pgx's nested transactions (tx.Begin),
// Commit keeps the work (TxHandler commits it, with the record, once the
// function returned nil) and Rollback undoes it (a rollback to the
// savepoint); either closes the Tx, after which the other answers
// pgx.ErrTxClosed, so that `defer tx.Rollback(ctx)` after a Commit is
// harmless. Begin and LargeObjects work on a pgx.Tx begun, the first time
// one of them is called, with a savepoint of its own (one more round trip).
//
// It is not safe for concurrent use, as no pgx.Tx is.
type handlerTx struct {
	conn  *pgx.Conn
	state txState
	base  pgx.Tx // for Begin and LargeObjects, once one was called
	// pooled is the pool's connection conn is, until it is given back
	// (endConn, releaseClosed); nil for a held lease's (heldTx has it).
	pooled *pgxpool.Conn
}

// releaseClosed gives conn back to the pool now if it closed, as endConn
// would at the run's end: the pool forgets it, and its place is free for
// the questions asked on another connection after it closed (ending).
func (t *handlerTx) releaseClosed() {
	if t.pooled != nil && t.conn.PgConn().IsClosed() {
		t.pooled.Release()
		t.pooled = nil
	}
}

// querier is where a run whose function committed its work itself
// writes the record: its own connection, or the pool once that closed.
func (t *handlerTx) querier(s *Store) querier {
	if t.pooled != nil && !t.conn.PgConn().IsClosed() {
		return t.pooled
	}
	return s.pool
}

var _ pgx.Tx = (*handlerTx)(nil)

// baseTx returns the pgx.Tx that Begin and LargeObjects use, beginning it
// the first time.
func (t *handlerTx) baseTx(ctx context.Context) (pgx.Tx, error) {
	if t.base == nil {
		base, err := t.conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: "SAVEPOINT amqpidem_nested"})
		if err != nil {
			return nil, err
		}
		t.base = base
	}
	return t.base, nil
}

// Begin starts a pseudo nested transaction (a savepoint), as pgx's do.
func (t *handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.state != txOpen {
		return nil, pgx.ErrTxClosed
	}
	base, err := t.baseTx(ctx)
	if err != nil {
		return nil, err
	}
	return base.Begin(ctx)
}

// Commit closes the Tx and keeps the handler's work, for TxHandler to
// commit with the record once the handler returned nil; it does not commit
// by itself. As pgx's Commit does, it answers pgx.ErrTxCommitRollback for
// a transaction a failed statement aborted: nothing of it can commit.
func (t *handlerTx) Commit(context.Context) error {
	if t.state != txOpen {
		return pgx.ErrTxClosed
	}
	t.state = txKept
	if t.conn.PgConn().TxStatus() == 'E' {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// Rollback undoes what the handler wrote (a rollback to the handler's
// savepoint) and closes the Tx. The lease stays held; a handler that then
// returns nil fails with ErrRolledBack, since its work did not happen.
func (t *handlerTx) Rollback(ctx context.Context) error {
	if t.state != txOpen {
		return pgx.ErrTxClosed
	}
	t.state = txUndone
	if t.conn.PgConn().TxStatus() == 'I' {
		return nil // ended by the handler itself: TxHandler sees it
	}
	// Not cut short by ctx: a rollback the handler asked for is made.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if _, err := t.conn.Exec(rctx, "ROLLBACK TO SAVEPOINT "+savepoint); err != nil {
		return fmt.Errorf("pgstore: rollback of the handler's work: %w", err)
	}
	return nil
}

// CopyFrom runs pgx.Conn.CopyFrom in the transaction.
func (t *handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if t.state != txOpen {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, columns, src)
}

// SendBatch runs pgx.Conn.SendBatch in the transaction.
func (t *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.state != txOpen {
		return closedBatch{}
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects returns the large objects of the transaction. The first
// call begins a savepoint for them, and panics if the connection fails
// then (amqpidem recovers a handler's panic as its error).
func (t *handlerTx) LargeObjects() pgx.LargeObjects {
	ctx, cancel := context.WithTimeout(context.Background(), commitTimeout)
	defer cancel()
	base, err := t.baseTx(ctx)
	if err != nil {
		panic(fmt.Sprintf("pgstore: large objects: %v", err))
	}
	return base.LargeObjects()
}

// Prepare runs pgx.Conn.Prepare on the transaction's connection.
func (t *handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.state != txOpen {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Prepare(ctx, name, sql)
}

// Exec runs pgx.Conn.Exec in the transaction.
func (t *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.state != txOpen {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

// Query runs pgx.Conn.Query in the transaction.
func (t *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.state != txOpen {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

// QueryRow runs pgx.Conn.QueryRow in the transaction.
func (t *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.state != txOpen {
		return closedRow{}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

// Conn returns the transaction's connection. Statements run on it
// directly are in the transaction too; a COMMIT or ROLLBACK run on it (a
// library that begins and commits a transaction of its own, say) ends
// TxHandler's transaction: see ErrTxEnded.
func (t *handlerTx) Conn() *pgx.Conn { return t.conn }

// closedRow is the Row of a closed Tx.
type closedRow struct{}

func (closedRow) Scan(...any) error { return pgx.ErrTxClosed }

// closedBatch is the BatchResults of a closed Tx.
type closedBatch struct{}

func (closedBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, pgx.ErrTxClosed }
func (closedBatch) Query() (pgx.Rows, error)         { return nil, pgx.ErrTxClosed }
func (closedBatch) QueryRow() pgx.Row                { return closedRow{} }
func (closedBatch) Close() error                     { return pgx.ErrTxClosed }
func (closedBatch) Tx() pgx.Tx                       { return nil }
