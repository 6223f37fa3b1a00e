package lock

import (
	"context"
	"errors"
	"time"
)

// ErrCountBudget means a Counter gave up a count that would have taken
// longer than its CountRequest.Budget.
var ErrCountBudget = errors.New("lock: count over budget")

// Counter counts a store's records exactly, for operators' tools (the
// console's overview), within a time budget: a store where a count is
// one bounded statement implements it (pgstore's Store, with the
// statement timeout as the budget). RedisStore and dynamostore's Store do
// not: they could count only by a full scan, which a page never does; a
// tool counts among the records of one List page instead and says so.
type Counter interface {
	// Count counts the records under req.Prefix by state, or fails with
	// an error wrapping ErrCountBudget after about req.Budget.
	Count(ctx context.Context, req CountRequest) (Counts, error)
}

// CountRequest asks a Counter for the counts of one prefix.
type CountRequest struct {
	// Prefix keeps the records whose key starts with it; "" keeps every
	// key.
	Prefix string
	// LeaseBelow: Counts.LeaseBelow counts the live leases with less
	// than this left (zero: none).
	LeaseBelow time.Duration
	// Budget bounds the count's time in the store (zero: 100 ms).
	Budget time.Duration
}

// Counts are a prefix's records by state, as Inspect would report them
// (records whose retention passed are left out), counted at one moment
// of the store's clock.
type Counts struct {
	// States counts the records in each state.
	States map[State]int
	// Expired counts the in-progress records whose lease expired;
	// LeaseBelow the live leases with less than CountRequest.LeaseBelow
	// left. Both are among States[StateInProgress].
	Expired, LeaseBelow int
}
