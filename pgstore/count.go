package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/amqpidem/amqpidem/lock"
)

var _ lock.Counter = (*Store)(nil)

// countSQL counts the records of namespace $1 from key $2 (the prefix)
// up to $3 (the first key past it; NULL when none) by state letter, with
// the expired leases and the live ones with less than $4 microseconds
// left, at the database's clock when the statement began (one reading:
// clock_timestamp() per row would cost a call per row). It is one range
// scan of the primary key's index (ns, key): as long as the prefix's
// records are many.
func countSQL(table string) string {
	return `SELECT t.state,
			count(*),
			count(*) FILTER (WHERE t.state = 'p' AND (t.deadline IS NULL OR t.deadline <= statement_timestamp())),
			count(*) FILTER (WHERE t.state = 'p' AND t.deadline > statement_timestamp() AND t.deadline < statement_timestamp() + $4 * interval '1 microsecond')
		FROM ` + table + ` t
		WHERE t.ns = $1 AND t.key >= $2 AND ($3::bytea IS NULL OR t.key < $3) AND t.expires_at > statement_timestamp()
		GROUP BY t.state`
}

// Count counts the records of the Store's namespace under req.Prefix by
// state (lock.Counter), in one statement run under a statement_timeout
// of req.Budget (default 100 ms, at least 1 ms): a count that takes
// longer fails with an error wrapping lock.ErrCountBudget. It scans the
// prefix's entries of the primary key's index, so its cost grows with
// the records counted; the budget bounds it. Like List it takes no lock.
func (s *Store) Count(ctx context.Context, req lock.CountRequest) (lock.Counts, error) {
	if len(req.Prefix) > lock.MaxKeyLen {
		return lock.Counts{}, fmt.Errorf("%w: count prefix of %d bytes", lock.ErrInvalidKey, len(req.Prefix))
	}
	budget := req.Budget
	if budget <= 0 {
		budget = 100 * time.Millisecond
	}
	budget = max(budget, time.Millisecond)
	out := lock.Counts{States: map[lock.State]int{}}
	// The budget is the server's: a server that never answers never
	// applies it.
	ctx, cancel := bounded(ctx)
	defer cancel()
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// SET LOCAL takes no parameter: the budget is an integer of ours.
		if _, err := tx.Exec(ctx, fmt.Sprintf("SET LOCAL statement_timeout = %d", budget.Milliseconds())); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, countSQL(s.cfg.names().table), s.cfg.Prefix, []byte(req.Prefix), prefixEnd(req.Prefix), req.LeaseBelow.Microseconds())
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				state                  string
				n, expired, leaseBelow int
			)
			if err := rows.Scan(&state, &n, &expired, &leaseBelow); err != nil {
				return err
			}
			if len(state) == 1 {
				out.States[lock.StateOf(state[0])] += n
			}
			out.Expired += expired
			out.LeaseBelow += leaseBelow
		}
		return rows.Err()
	})
	if err != nil {
		var pe *pgconn.PgError
		if ctx.Err() == nil && errors.As(err, &pe) && pe.Code == "57014" { // query_canceled: the statement timeout
			return lock.Counts{}, fmt.Errorf("pgstore: count: %w (%v)", lock.ErrCountBudget, budget)
		}
		return lock.Counts{}, fmt.Errorf("pgstore: count: %w", classify(err))
	}
	return out, nil
}
