package pgstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/puddle/v2"

	"github.com/amqpidem/amqpidem/lock"
)

// ErrNotMigrated is wrapped by the errors of a Store, Outbox or Check
// that finds its schema, table or functions missing: Migrate was not run
// with this Config, or the Config names another table than the one
// Migrate made.
var ErrNotMigrated = errors.New("pgstore: not migrated")

// notMigrated are the SQLSTATEs of a schema, table or function that does
// not exist: Migrate was not run (or for another Config).
var notMigrated = map[string]bool{"3F000": true, "42P01": true, "42883": true}

// unavailable reports whether err says the database could not answer now
// but may later: lock.ErrUnavailable.
func unavailable(err error) bool {
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		// Whatever the server said (a wrong password, a database that does
		// not exist yet): no statement ran, and a later call may succeed.
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch c := pe.Code; {
		case strings.HasPrefix(c, "08"), // connection exception
			strings.HasPrefix(c, "53"),               // insufficient resources: connections, disk, memory
			strings.HasPrefix(c, "57"),               // shutdown, crash, cannot connect now, statement timeout
			strings.HasPrefix(c, "58"),               // system error: I/O
			c == "40001", c == "40P01", c == "40003", // serialization failure, deadlock, completion unknown
			c == "55P03", c == "55006", // lock not available, object in use
			c == "25006", c == "25P03", // read-only transaction (a standby), idle-in-transaction timeout
			notMigrated[c]:
			return true
		}
		return false
	}
	var ne net.Error
	return errors.As(err, &ne) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, puddle.ErrClosedPool) ||
		errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err) || pgconn.SafeToRetry(err)
}

// classify wraps err with lock.ErrUnavailable when the database could not
// answer, and says what to do when the schema is missing.
func classify(err error) error {
	if err == nil || errors.Is(err, lock.ErrUnavailable) || !unavailable(err) {
		return err
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) && notMigrated[pe.Code] {
		return fmt.Errorf("%w: %w: %w (run pgstore.Migrate, or apply pgstore.MigrationSQL, with this Config)", lock.ErrUnavailable, ErrNotMigrated, err)
	}
	return fmt.Errorf("%w: %w", lock.ErrUnavailable, err)
}

// answered reports whether err says for sure that the statement did not
// take effect: it never reached the server (a failed connect, an error
// pgx knows came before any byte was sent), or the server answered it
// with an error (the statement, one function call, was rolled back).
func answered(err error) bool {
	var ce *pgconn.ConnectError
	var pe *pgconn.PgError
	return errors.As(err, &ce) || pgconn.SafeToRetry(err) || errors.As(err, &pe)
}

// ErrRolledBack is wrapped, with amqpidem.Permanent, by the error of a
// TxHandler whose function rolled its work back (tx.Rollback, a deferred
// one included) and then returned no error: its work did not happen, so
// the message is not acked as done; it is dead-lettered. To do nothing,
// return nil without calling Rollback; to keep the work, call tx.Commit
// (or nothing) before Rollback.
var ErrRolledBack = errors.New("pgstore: the handler rolled its transaction back (tx.Rollback, a deferred one included) and returned no error: its work was undone (call tx.Commit before returning nil to keep it)")

// ErrTxEnded is wrapped, with amqpidem.Permanent, by the error of a
// TxHandler whose function ended the transaction itself (a COMMIT or
// ROLLBACK statement, or a library given tx.Conn() that begins and
// commits its own transaction on it) and then returned an error, or whose
// transaction did not commit: what it did after that is neither undone nor
// known, so the message is dead-lettered rather than run again.
var ErrTxEnded = errors.New("pgstore: the handler ended the transaction itself (a COMMIT or ROLLBACK statement, or a library given tx.Conn())")
