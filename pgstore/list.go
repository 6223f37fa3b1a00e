package pgstore

import (
	"context"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

var _ lock.Lister = (*Store)(nil)

// listSQL reads, in key order, at most $4 records of namespace $1 after
// key $2 and from key $3 on (the request's prefix) up to $5 (the first key
// past the prefix; NULL when none), with the database clock. It is one
// range scan of the primary key's index (ns, key), LIMIT rows long,
// whatever the state filter: the filter is applied to the rows read, so
// that a page costs what its Scan says even when few records match. A
// completed record's value is read only when $6 asks for it; a failed
// one's is its error.
func listSQL(table string) string {
	return `SELECT clock_timestamp(), t.key, t.state, t.owner, t.fence, t.deadline, t.attempts, t.fingerprint,
			CASE WHEN t.state = 'f' OR (t.state = 'c' AND $6) THEN t.value END, t.created_at, t.ended_at, t.expires_at
		FROM ` + table + ` t
		WHERE t.ns = $1 AND t.key > $2 AND t.key >= $3 AND ($5::bytea IS NULL OR t.key < $5)
		ORDER BY t.key
		LIMIT $4`
}

// List reads the records of the Store's namespace (Config.Prefix) in key
// order, after req.Cursor and within req.Prefix, at most req.Scan of
// them, in one statement that scans that many entries of the primary
// key's index at most (no full scan, no index beyond the one Migrate
// makes); req.State and the expiry are checked on the rows read. The
// cursor is the last key read, in hex. Records whose retention has
// passed are left out, as Inspect leaves them. Like Inspect it takes no
// lock. A table that is missing is an error wrapping ErrNotMigrated.
func (s *Store) List(ctx context.Context, req lock.ListRequest) (lock.ListPage, error) {
	req, err := req.Check()
	if err != nil {
		return lock.ListPage{}, err
	}
	after := []byte{}
	if req.Cursor != "" {
		if after, err = hex.DecodeString(req.Cursor); err != nil || len(after) == 0 {
			return lock.ListPage{}, fmt.Errorf("%w: %q", lock.ErrBadCursor, req.Cursor)
		}
	}
	rows, err := s.pool.Query(ctx, listSQL(s.cfg.names().table), s.cfg.Prefix, after, []byte(req.Prefix), req.Scan, prefixEnd(req.Prefix), req.Values)
	if err != nil {
		return lock.ListPage{}, fmt.Errorf("pgstore: list: %w", classify(err))
	}
	defer rows.Close()
	var page lock.ListPage
	var last []byte
	for rows.Next() {
		var (
			now, created, expires time.Time
			deadline, ended       *time.Time
			key, fingerprint, val []byte
			state, owner          string
			fence                 int64
			attempts              int
		)
		if err := rows.Scan(&now, &key, &state, &owner, &fence, &deadline, &attempts, &fingerprint, &val, &created, &ended, &expires); err != nil {
			return lock.ListPage{}, fmt.Errorf("pgstore: list: %w", classify(err))
		}
		page.Scanned++
		last = key
		if len(state) != 1 || !expires.After(now) || !req.Keep(string(key), state[0]) {
			continue
		}
		r := lock.Record{Key: string(key), State: lock.StateOf(state[0]), Owner: owner, Fence: fence, Attempts: attempts,
			Fingerprint: string(fingerprint), Created: created, ExpiresIn: expires.Sub(now),
			Location: s.location(s.cfg.names().table, string(key))}
		if ended != nil {
			r.Ended = *ended
		}
		switch r.State {
		case lock.StateInProgress:
			if deadline != nil && deadline.After(now) {
				r.LeaseLeft = deadline.Sub(now)
			}
		case lock.StateCompleted:
			if req.Values {
				r.Value = val
			}
		case lock.StateFailed:
			r.Error = string(val)
		}
		page.Records = append(page.Records, r)
	}
	if err := rows.Err(); err != nil {
		return lock.ListPage{}, fmt.Errorf("pgstore: list: %w", classify(err))
	}
	if page.Scanned == req.Scan {
		page.Next = hex.EncodeToString(last)
	}
	return page, nil
}

// prefixEnd is the first key after every key that starts with prefix, or
// nil when there is none (an empty prefix, or one of 0xff bytes only).
func prefixEnd(prefix string) []byte {
	b := []byte(prefix)
	for len(b) > 0 && b[len(b)-1] == 0xff {
		b = b[:len(b)-1]
	}
	if len(b) == 0 {
		return nil
	}
	b[len(b)-1]++
	return b
}
