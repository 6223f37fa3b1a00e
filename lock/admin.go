package lock

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Errors of the Admin methods, and of Amender.Amend (ErrChanged).
var (
	// ErrNotFound means a key has no record: it was never seen, or its
	// record expired or was forgotten.
	ErrNotFound = errors.New("lock: no record")
	// ErrChanged means the record is not the one the caller saw: Forget
	// found it in another state or with another fence (nothing was
	// deleted); Amend found no completed record with that fence and value
	// (another writer amended it first, it expired or was forgotten, it is
	// not completed), and nothing was changed.
	ErrChanged = errors.New("lock: record changed")
)

// State is the state of a record, as Inspect reports it.
type State string

// The states a record moves through (see Store).
const (
	// StateInProgress: a lease was granted; it may have expired
	// (Record.LeaseLeft is zero then) without anyone taking it over yet.
	StateInProgress State = "in_progress"
	// StateCompleted: the operation succeeded; Record.Value holds its
	// stored result.
	StateCompleted State = "completed"
	// StateFailed: the operation failed terminally; Record.Error holds the
	// stored error.
	StateFailed State = "failed"
	// StateReleased: a lease was given up after a retryable failure; the
	// next Acquire takes the key.
	StateReleased State = "released"
	// StateCancelled: a lease was given up before its work started.
	StateCancelled State = "cancelled"
)

// stateOf maps the one-letter state the stores write to a State.
func stateOf(c byte) State {
	switch c {
	case 'p':
		return StateInProgress
	case 'c':
		return StateCompleted
	case 'f':
		return StateFailed
	case 'r':
		return StateReleased
	case 'x':
		return StateCancelled
	}
	return State(fmt.Sprintf("unknown(%q)", c))
}

// StateOf maps the one-letter state a store writes ('p', 'c', 'f', 'r',
// 'x') to a State, for Admin implementations outside this package.
func StateOf(c byte) State { return stateOf(c) }

// Letter is the one-letter form of s that stores write, or 0 for a State
// that is not one of the five.
func (s State) Letter() byte {
	switch s {
	case StateInProgress:
		return 'p'
	case StateCompleted:
		return 'c'
	case StateFailed:
		return 'f'
	case StateReleased:
		return 'r'
	case StateCancelled:
		return 'x'
	}
	return 0
}

// Record is one key's record as an operator sees it. Times are the
// store's; durations are measured by the store's clock at the moment of
// the Inspect.
type Record struct {
	// Key is the idempotency key, as the Store was given it.
	Key string
	// State is where the record is in its life.
	State State
	// Owner is the owner token of the latest lease ("" if none was
	// granted since the record was made).
	Owner string
	// Fence is the latest lease's fencing token.
	Fence int64
	// Attempts counts the leases granted on the key.
	Attempts int
	// Fingerprint is the payload fingerprint the key was first seen with
	// ("" when none was checked).
	Fingerprint string
	// LeaseLeft is what the latest lease has left when State is
	// StateInProgress; zero when it expired or in any other state.
	LeaseLeft time.Duration
	// Created is when the record was made; Ended when it got its latest
	// outcome (zero until then). Stores that do not keep one leave it
	// zero.
	Created, Ended time.Time
	// ExpiresIn is how long until the record is deleted; while a lease is
	// held, the heartbeat keeps pushing it out.
	ExpiresIn time.Duration
	// Value is the stored result when State is StateCompleted.
	Value []byte
	// Error is the stored error text when State is StateFailed.
	Error string
	// Location says where the record lives, in the store's own terms
	// (the Redis key, or the table and row), for looking at it directly.
	Location string
}

// Live reports whether r holds a lease that has not expired: another
// process may be running the operation right now.
func (r Record) Live() bool { return r.State == StateInProgress && r.LeaseLeft > 0 }

// Admin is what operators' tools need from a Store besides the lease
// methods: reading a record by key and deleting it. Every Store of this
// module implements it.
//
// Forgetting a record is the one way to make completed or failed work run
// again: the next delivery of the key runs as a first one. It is never
// needed in normal operation; forgetting the record of a live lease lets a
// second process run the operation while the first still does.
type Admin interface {
	// Inspect returns key's record, or an error wrapping ErrNotFound.
	Inspect(ctx context.Context, key string) (Record, error)
	// Forget deletes key's record if it is still in state with fence, as
	// an earlier Inspect saw it: compare-and-delete, so that work that
	// moved on meanwhile (a failed record retried and completed, say) is
	// never forgotten by mistake. It returns an error wrapping ErrNotFound
	// when there is no record, ErrChanged when the record is not the one
	// seen (nothing deleted). RedisStore leaves a tombstone for a second
	// that keeps only the fence, so that a record made again at once gets
	// a higher one; to every method it is no record.
	Forget(ctx context.Context, key string, state State, fence int64) error
}
