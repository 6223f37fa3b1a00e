package ledger

import (
	"context"
	"fmt"
	"sort"
	"strings"
)

// OpStats is what the ledger saw of one operation.
type OpStats struct {
	ID     string
	Expect string
	// Executions is how many times the handler started.
	Executions int
	// Applied is how many writes applied the side effect (the sink lets
	// through at most one); Absorbed how many writes came after it with a
	// current fence and were absorbed.
	Applied, Absorbed int
	// Stale is how many writes the fence check rejected.
	Stale int
	// Completions is how many Completes the store accepted.
	Completions int
	// AfterComplete is how many executions began after the operation's
	// record was completed: their Acquire was sent after a Complete had
	// returned, or their fence is higher than the completed one. Without
	// data loss in the store this is always zero.
	AfterComplete int
	// DeadLetters is how many copies reached the dead-letter target.
	DeadLetters int
}

// Lost reports whether the operation did not end as expected: never
// applied, or never dead-lettered, as its expectation says.
func (s OpStats) Lost() bool {
	switch s.Expect {
	case ExpectDeadLetter:
		return s.DeadLetters == 0
	case ExpectBoth:
		return s.Applied == 0 || s.DeadLetters == 0
	case ExpectAny:
		return false
	}
	return s.Applied == 0
}

// Duplicated reports whether the operation took effect more than once:
// applied twice, dead-lettered twice, or applied although it should only
// have been dead-lettered.
func (s OpStats) Duplicated() bool {
	return s.Applied > 1 || s.DeadLetters > 1 || (s.Expect == ExpectDeadLetter && s.Applied > 0) ||
		(s.Expect == ExpectApply && s.DeadLetters > 0)
}

// Reexecuted reports whether the handler ran more than once for an
// operation that still took effect exactly once.
func (s OpStats) Reexecuted() bool {
	return s.Executions > 1 && !s.Lost() && !s.Duplicated()
}

// Report classifies every operation of a run.
type Report struct {
	Name string
	Ops  int
	// Lost, Duplicated and Reexecuted count operations; StaleRejected
	// counts rejected writes.
	Lost, Duplicated, Reexecuted, StaleRejected int

	// Executions, Absorbed, Completions and AfterComplete are totals over
	// all operations.
	Executions, Absorbed, Completions, AfterComplete int
	// Crashes is how many crash windows were taken.
	Crashes int
	// Unknown counts executions of operations the run never published.
	Unknown int

	// PerOp holds the statistics of every operation.
	PerOp map[string]OpStats
}

// Line is the scenario's summary line.
func (r Report) Line() string {
	return fmt.Sprintf("scenario %s ops=%d lost=%d duplicated=%d reexecuted=%d stale_rejected=%d",
		r.Name, r.Ops, r.Lost, r.Duplicated, r.Reexecuted, r.StaleRejected)
}

// Detail is a second line with the totals behind the summary.
func (r Report) Detail() string {
	return fmt.Sprintf("detail %s executions=%d absorbed=%d completions=%d after_complete=%d crashes=%d unknown=%d",
		r.Name, r.Executions, r.Absorbed, r.Completions, r.AfterComplete, r.Crashes, r.Unknown)
}

// Failing lists, for a failure message, up to n operations that match pred.
func (r Report) Failing(n int, pred func(OpStats) bool) string {
	var ids []string
	for id, s := range r.PerOp {
		if pred(s) {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	var b strings.Builder
	for i, id := range ids {
		if i == n {
			fmt.Fprintf(&b, "\n  ... and %d more", len(ids)-n)
			break
		}
		fmt.Fprintf(&b, "\n  %+v", r.PerOp[id])
	}
	return b.String()
}

// Classify reads the whole ledger and classifies every operation of the
// ops table. deadLetters counts, per operation id, the copies found at the
// dead-letter target (nil: none).
func (l *Ledger) Classify(ctx context.Context, name string, deadLetters map[string]int) (Report, error) {
	r := Report{Name: name, PerOp: map[string]OpStats{}}
	rows, err := l.pool.Query(ctx, `
WITH e AS (SELECT op_id, count(*) AS n FROM executions GROUP BY op_id),
     f AS (SELECT op_id, count(*) FILTER (WHERE NOT absorbed) AS applied,
                  count(*) FILTER (WHERE absorbed) AS absorbed
             FROM effects GROUP BY op_id),
     s AS (SELECT op_id, count(*) AS n FROM stale GROUP BY op_id),
     c AS (SELECT op_id, count(*) AS n, min(at) AS first_at, max(fence) AS max_fence
             FROM completions GROUP BY op_id),
     ac AS (SELECT x.op_id, count(*) AS n FROM executions x JOIN c ON c.op_id = x.op_id
             WHERE x.acquired_at > c.first_at OR x.fence > c.max_fence GROUP BY x.op_id)
SELECT o.op_id, o.expect, coalesce(e.n, 0), coalesce(f.applied, 0), coalesce(f.absorbed, 0),
       coalesce(s.n, 0), coalesce(c.n, 0), coalesce(ac.n, 0)
  FROM ops o LEFT JOIN e USING (op_id) LEFT JOIN f USING (op_id) LEFT JOIN s USING (op_id)
             LEFT JOIN c USING (op_id) LEFT JOIN ac USING (op_id)`)
	if err != nil {
		return r, fmt.Errorf("ledger: classify: %w", err)
	}
	for rows.Next() {
		var s OpStats
		if err := rows.Scan(&s.ID, &s.Expect, &s.Executions, &s.Applied, &s.Absorbed, &s.Stale,
			&s.Completions, &s.AfterComplete); err != nil {
			rows.Close()
			return r, fmt.Errorf("ledger: classify: %w", err)
		}
		s.DeadLetters = deadLetters[s.ID]
		r.PerOp[s.ID] = s
	}
	if err := rows.Err(); err != nil {
		return r, fmt.Errorf("ledger: classify: %w", err)
	}
	for _, s := range r.PerOp {
		r.Ops++
		switch {
		case s.Lost():
			r.Lost++
		case s.Duplicated():
			r.Duplicated++
		case s.Reexecuted():
			r.Reexecuted++
		}
		r.StaleRejected += s.Stale
		r.Executions += s.Executions
		r.Absorbed += s.Absorbed
		r.Completions += s.Completions
		r.AfterComplete += s.AfterComplete
	}
	err = l.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM crashes),
		(SELECT count(*) FROM executions x WHERE NOT EXISTS (SELECT 1 FROM ops o WHERE o.op_id = x.op_id))`).
		Scan(&r.Crashes, &r.Unknown)
	if err != nil {
		return r, fmt.Errorf("ledger: classify: %w", err)
	}
	for id := range deadLetters {
		if _, ok := r.PerOp[id]; !ok {
			r.Unknown++
		}
	}
	return r, nil
}
