package pgstore

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/lock"
)

var _ lock.Admin = (*Store)(nil)

// inspectSQL reads one record that has not expired, with the database
// clock it was judged by (read once, in the CTE, so that the expiry test
// and the durations measured from it agree) and the schema and name of
// the table the row is in (Config.Schema may be empty: the table is then
// the one the search_path finds).
func inspectSQL(table string) string {
	return `WITH now AS (SELECT clock_timestamp() AS ts)
		SELECT now.ts, t.state, t.owner, t.fence, t.deadline, t.attempts, t.fingerprint, t.value,
			t.created_at, t.ended_at, t.expires_at, n.nspname, c.relname
		FROM now
		JOIN ` + table + ` t ON t.ns = $1 AND t.key = $2 AND t.expires_at > now.ts
		JOIN pg_catalog.pg_class c ON c.oid = t.tableoid
		JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace`
}

// forgetSQL deletes one record that has not expired if it is in state $3
// with fence $4, and answers how many rows it deleted and how many
// records it saw (0 or 1): 0 and 0 is no record, 0 and 1 a record that
// changed.
//
// The now CTE reads the clock once, and sets the functions' lock_timeout
// for this statement's transaction only (the statement runs on its own,
// out of any transaction block, so that the setting ends with it): a row
// held by a transaction that does not end makes the DELETE fail as
// unavailable instead of waiting without end. The DELETE joins now, so
// now is evaluated before the DELETE can reach, and wait for, any row.
//
// seen reads the statement's snapshot: when the DELETE found the row
// changed by a transaction that committed while it waited (its state or
// fence, or the row deleted), seen still has the row, and the answer is
// "changed", which a new Inspect settles.
func forgetSQL(table string) string {
	return `WITH now AS (
			SELECT clock_timestamp() AS ts, set_config('lock_timeout', '` + lockTimeout + `', true) AS lock_timeout),
		seen AS (
			SELECT 1 FROM now, ` + table + ` t WHERE t.ns = $1 AND t.key = $2 AND t.expires_at > now.ts),
		gone AS (
			DELETE FROM ` + table + ` t USING now
			WHERE t.ns = $1 AND t.key = $2 AND t.state = $3 AND t.fence = $4 AND t.expires_at > now.ts
			RETURNING 1)
		SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM seen)`
}

// Inspect reads key's record in one statement, judged by the database
// clock as Acquire judges it: a record whose retention has passed is
// absent (an error wrapping lock.ErrNotFound) even while Cleanup has not
// deleted its row yet. LeaseLeft and ExpiresIn are measured by that same
// clock, read by the statement. Error is the text Fail stored (cut to
// MaxResultSize bytes). Location names the table (schema-qualified), the
// namespace (Config.Prefix) and the key, as SQL literals for the ns and
// key columns: the key as text when it is printable ASCII, else in
// bytea's hex form.
//
// Inspect takes no lock: it never waits for a row another transaction
// holds, and reads the record as last committed.
func (s *Store) Inspect(ctx context.Context, key string) (lock.Record, error) {
	ctx, cancel := bounded(ctx)
	defer cancel()
	if err := checkKey(s.cfg, key); err != nil {
		return lock.Record{}, err
	}
	var (
		now, created, expires time.Time
		deadline, ended       *time.Time
		state, owner          string
		fence                 int64
		attempts              int
		fingerprint, value    []byte
		schema, table         string
	)
	err := s.pool.QueryRow(ctx, inspectSQL(s.cfg.names().table), s.cfg.Prefix, []byte(key)).Scan(
		&now, &state, &owner, &fence, &deadline, &attempts, &fingerprint, &value,
		&created, &ended, &expires, &schema, &table)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return lock.Record{}, fmt.Errorf("%w: key %q (%s)", lock.ErrNotFound, key, s.location(s.cfg.names().table, key))
	case err != nil:
		return lock.Record{}, fmt.Errorf("pgstore: inspect %q: %w", key, classify(err))
	}
	r := lock.Record{
		Key:         key,
		Owner:       owner,
		Fence:       fence,
		Attempts:    attempts,
		Fingerprint: string(fingerprint),
		Created:     created,
		ExpiresIn:   expires.Sub(now),
		Location:    s.location(pgx.Identifier{schema, table}.Sanitize(), key),
	}
	if len(state) == 1 {
		r.State = lock.StateOf(state[0])
	} else {
		r.State = lock.State(fmt.Sprintf("unknown(%q)", state))
	}
	if ended != nil {
		r.Ended = *ended
	}
	switch r.State {
	case lock.StateInProgress:
		if deadline != nil && deadline.After(now) {
			r.LeaseLeft = deadline.Sub(now)
		}
	case lock.StateCompleted:
		r.Value = value
	case lock.StateFailed:
		r.Error = string(value)
	}
	return r, nil
}

// Forget deletes key's record if it has not expired and is still in state
// with fence, in one statement (compare-and-delete). It returns an error
// wrapping lock.ErrNotFound when there is no record (or only an expired
// one), lock.ErrChanged when the record is in another state or has
// another fence: nothing was deleted then. A record that another
// statement deleted or changed while Forget waited for its row is judged
// again by a second statement (at most three in all), so that Forget
// answers as if it came after that one. Like the lease calls, it waits at most 2 s for a row that
// another transaction holds (a TxHandler's completion not yet committed),
// then fails as lock.ErrUnavailable.
//
// The next Acquire of the key makes a new record: attempt 1, with a fence
// from the database clock, above the forgotten record's as long as that
// clock does not step back (the record's own fence is gone with it).
func (s *Store) Forget(ctx context.Context, key string, state lock.State, fence int64) error {
	ctx, cancel := bounded(ctx)
	defer cancel()
	if err := checkKey(s.cfg, key); err != nil {
		return err
	}
	letter := state.Letter()
	if letter == 0 {
		return fmt.Errorf("pgstore: forget %q: %q is not a record state", key, state)
	}
	var deleted, seen int64
	var err error
	// The statement's "seen" is its snapshot's: a record that another
	// statement deleted (or changed) while this one waited for its row
	// is seen, and not deleted. Only a second statement, taken after that
	// one committed, tells "gone" (ErrNotFound) from "not the record
	// seen" (ErrChanged); the first deleted nothing. (Two concurrent
	// Forgets of one record answered nil and ErrChanged, which no order of
	// them explains: found by test/linearizable.)
	for try := 0; try < 3 && err == nil && deleted == 0 && (try == 0 || seen > 0); try++ {
		err = s.pool.QueryRow(ctx, forgetSQL(s.cfg.names().table), s.cfg.Prefix, []byte(key), string(letter), fence).
			Scan(&deleted, &seen)
	}
	switch {
	case err != nil:
		return fmt.Errorf("pgstore: forget %q: %w", key, classify(err))
	case deleted > 0:
		return nil
	case seen == 0:
		return fmt.Errorf("%w: key %q (%s)", lock.ErrNotFound, key, s.location(s.cfg.names().table, key))
	}
	return fmt.Errorf("%w: key %q is no longer %s with fence %d; inspect it again", lock.ErrChanged, key, state, fence)
}

// checkKey refuses the keys that Acquire refuses (lock.ErrInvalidKey):
// package lock checks them in Config.CheckRequest, whose other checks
// cannot fail on a request of a key alone with a validated Config.
func checkKey(cfg Config, key string) error {
	_, err := cfg.CheckRequest(lock.Request{Key: key})
	return err
}

// location says where key's row is: "postgres table <table> ns='<prefix>'
// key=<literal>", with SQL literals that the ns and key columns compare
// equal to.
func (s *Store) location(table, key string) string {
	return "postgres table " + table + " ns=" + sqlLiteral(s.cfg.Prefix) + " key=" + keyLiteral(key)
}

// sqlLiteral quotes v as an SQL string literal.
func sqlLiteral(v string) string {
	return "'" + strings.ReplaceAll(v, "'", "''") + "'"
}

// keyLiteral is key as a literal of the key column (bytea): the text
// itself when it is printable ASCII with no backslash (which bytea's input
// reads as an escape), else bytea's hex form ('\x...').
func keyLiteral(key string) string {
	for i := range len(key) {
		if c := key[i]; c < 0x20 || c > 0x7e || c == '\\' {
			return `'\x` + hex.EncodeToString([]byte(key)) + `'`
		}
	}
	return sqlLiteral(key)
}
