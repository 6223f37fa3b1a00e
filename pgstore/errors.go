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

// notMigrated are the SQLSTATEs of a schema, table or function that does
// not exist: Migrate was not run (or for another Config).
var notMigrated = map[string]bool{"3F000": true, "42P01": true, "42883": true}

// unavailable reports whether err says the database could not answer now
// but may later: lock.ErrUnavailable.
func unavailable(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch c := pe.Code; {
		case strings.HasPrefix(c, "08"), // connection exception
			strings.HasPrefix(c, "53"),  // insufficient resources: connections, disk, memory
			strings.HasPrefix(c, "57P"), // shutdown, crash, cannot connect now
			c == "40001", c == "40P01",  // serialization failure, deadlock: try again
			c == "55P03", c == "55006", // lock not available, object in use
			c == "25006", // read-only transaction: a standby
			notMigrated[c]:
			return true
		}
		return false
	}
	var ne net.Error
	var ce *pgconn.ConnectError
	return errors.As(err, &ne) || errors.As(err, &ce) ||
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
		return fmt.Errorf("%w: %w (run pgstore.Migrate, or apply pgstore.MigrationSQL, with this Config)", lock.ErrUnavailable, err)
	}
	return fmt.Errorf("%w: %w", lock.ErrUnavailable, err)
}

// notSent reports whether err says the statement never reached the
// server: a failed connect, or an error pgx knows came before any byte was
// sent.
func notSent(err error) bool {
	var ce *pgconn.ConnectError
	return errors.As(err, &ce) || pgconn.SafeToRetry(err)
}
