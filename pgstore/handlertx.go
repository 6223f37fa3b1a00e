package pgstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// errTxOwned is what a handler's Commit of a held transaction answers.
var errTxOwned = errors.New("pgstore: TxHandler commits the transaction itself, with the record; the handler must not")

// handlerTx is the pgx.Tx a handler gets in a transaction that holds its
// lease: the statements go to the transaction TxHandler began with the
// acquire, with no round trip of a BEGIN of their own. Commit is refused
// (TxHandler commits, with the record); Rollback rolls back to the
// handler's savepoint, undoing what the handler wrote, and closes the Tx.
// Begin and LargeObjects work on a pgx.Tx begun, the first time one of
// them is called, with a savepoint of its own (one more round trip).
type handlerTx struct {
	conn   *pgx.Conn
	closed bool
	base   pgx.Tx // for Begin and LargeObjects, once one was called
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
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	base, err := t.baseTx(ctx)
	if err != nil {
		return nil, err
	}
	return base.Begin(ctx)
}

// Commit refuses: TxHandler commits the transaction with the record.
func (t *handlerTx) Commit(context.Context) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	return errTxOwned
}

// Rollback undoes what the handler wrote (a rollback to the handler's
// savepoint) and closes the Tx; the lease stays held until the message's
// outcome is written.
func (t *handlerTx) Rollback(ctx context.Context) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	// Not cut short by ctx: a rollback the handler asked for is made.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if _, err := t.conn.Exec(rctx, "ROLLBACK TO SAVEPOINT "+savepoint); err != nil {
		return fmt.Errorf("pgstore: rollback of the handler's work: %w", err)
	}
	t.closed = true
	return nil
}

// CopyFrom runs pgx.Conn.CopyFrom in the transaction.
func (t *handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if t.closed {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, columns, src)
}

// SendBatch runs pgx.Conn.SendBatch in the transaction.
func (t *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed {
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
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Prepare(ctx, name, sql)
}

// Exec runs pgx.Conn.Exec in the transaction.
func (t *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if t.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

// Query runs pgx.Conn.Query in the transaction.
func (t *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

// QueryRow runs pgx.Conn.QueryRow in the transaction.
func (t *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.closed {
		return closedRow{}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

// Conn returns the transaction's connection.
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
