package lock

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Limits on what a Store accepts. They keep every record small enough that
// one Redis round trip stays cheap and that no caller can fill memory with a
// single message.
const (
	// MaxKeyLen is the longest idempotency key, in bytes, a Store accepts.
	MaxKeyLen = 1024
	// MaxFingerprintLen is the longest payload fingerprint, in bytes.
	MaxFingerprintLen = 128
	// DefaultMaxResultSize is the default limit on a stored result, in bytes.
	DefaultMaxResultSize = 64 << 10
	// MinTTL is the shortest lease TTL a Store accepts. Redis keeps lease
	// deadlines in milliseconds, and a lease's local Deadline is
	// DeadlineSlack short of its TTL: a 1 ms lease would end as it began.
	MinTTL = 2 * time.Millisecond
	// DeadlineSlack is how much earlier than start+TTL a store's deadline
	// for a lease may be, start being the local time just before the
	// request that set it was sent: Redis starts a lease, and renews one,
	// from its current millisecond rounded down (the scripts'
	// floor(usec/1000), a native SET ... PX), up to a millisecond before
	// the moment it runs. Lease.Deadline, and package heartbeat's estimate
	// after each Extend, subtract it.
	DeadlineSlack = time.Millisecond
)

// Errors returned by Store implementations. Callers compare with errors.Is;
// the returned errors wrap these with the key that caused them.
var (
	// ErrLeaseLost means the lease is no longer held by the caller: another
	// owner took it over, or the record moved on (completed, failed,
	// released, expired from Redis). Nothing was changed.
	ErrLeaseLost = errors.New("lock: lease lost")
	// ErrInvalidKey means the idempotency key is empty or longer than MaxKeyLen.
	ErrInvalidKey = errors.New("lock: invalid key")
	// ErrInvalidTTL means a lease TTL or retention is negative or too short.
	ErrInvalidTTL = errors.New("lock: invalid ttl")
	// ErrInvalidFingerprint means the payload fingerprint is longer than
	// MaxFingerprintLen.
	ErrInvalidFingerprint = errors.New("lock: invalid fingerprint")
	// ErrResultTooLarge means a result passed to Complete is larger than the
	// store's MaxResultSize.
	ErrResultTooLarge = errors.New("lock: result too large")
	// ErrUnavailable means the store could not be reached or did not answer
	// in time: a network error, a timeout, a closed client, or a server
	// that says "not now" (LOADING, READONLY, MASTERDOWN, CLUSTERDOWN,
	// TRYAGAIN, BUSY). The call may or may not have taken effect. The
	// returned error wraps both this and the original error.
	ErrUnavailable = errors.New("lock: store unavailable")
	// ErrBadRecord means the record of this one key cannot be used: the
	// Redis key holds another type (WRONGTYPE), a record of an unknown
	// format version, or bytes that do not decode. Other keys are not
	// affected; retrying does not help until the key is repaired or
	// expires.
	ErrBadRecord = errors.New("lock: record unusable")
	// ErrKeyCollision means two different keys mapped to the same record.
	// With 128-bit key hashes it is not expected to happen; the store
	// refuses rather than mixing two operations' state.
	ErrKeyCollision = errors.New("lock: key hash collision")
)

// Status is what Acquire found for a key.
type Status int

// The answers of Acquire.
const (
	// Acquired: the caller holds a lease and should run the operation.
	Acquired Status = iota + 1
	// Completed: the operation already succeeded; Result holds its result.
	Completed
	// Failed: the operation failed terminally; Error holds the stored error.
	Failed
	// InProgress: another owner holds a live lease; Remaining says how long
	// it has left, by the server's clock.
	InProgress
	// Conflict: the key was first seen with a different payload fingerprint.
	Conflict
)

// String returns the status in lower case, as used in logs.
func (s Status) String() string {
	switch s {
	case Acquired:
		return "acquired"
	case Completed:
		return "completed"
	case Failed:
		return "failed"
	case InProgress:
		return "in_progress"
	case Conflict:
		return "conflict"
	}
	return fmt.Sprintf("status(%d)", int(s))
}

// Request asks a Store for a lease on one idempotency key.
type Request struct {
	// Key is the idempotency key: 1 to MaxKeyLen bytes, any bytes allowed.
	Key string
	// Fingerprint identifies the payload (a hash of the body, say). When
	// both it and the stored fingerprint are non-empty and differ, Acquire
	// answers Conflict. Empty disables the check for this call.
	Fingerprint string
	// TTL is the lease duration, cut to whole milliseconds (the server's
	// unit). Zero means the store's default; below MinTTL is
	// ErrInvalidTTL.
	TTL time.Duration
	// Retention is how long the record outlives its last change (the
	// idempotency window). Zero means the store's default; negative, or
	// between 0 and 1ms, is ErrInvalidTTL.
	Retention time.Duration
}

// Lease is a held claim on one key. It is a value: copies refer to the same
// claim. Owner and Fence together identify it; every write a Store accepts
// from a lease is compare-and-set on both.
type Lease struct {
	// Key is the idempotency key the lease is for.
	Key string
	// Owner is a random token unique to the Acquire call that made the lease.
	Owner string
	// Fence is the fencing token. While the key's record exists, each new
	// lease's fence is strictly higher than the last one's, whatever the
	// clocks do. It is the higher of the last fence + 1 and the store's
	// clock in microseconds (Redis TIME; Config.Now for MemoryStore); a
	// RedisStore record made without a script starts at the first
	// microsecond of the millisecond after its creation. So a record that
	// was lost (expired after its retention, evicted, forgotten by a
	// restart or a failover) and made again still hands out a higher fence
	// as long as the clock granting the new lease is past the lost fence
	// (Admin.Forget keeps the fence a while for that). A clock stepped
	// back, or a failover to a server whose clock is behind, can break
	// that. Downstream writes that remember the highest fence they saw can
	// reject a stale holder.
	Fence int64
	// Attempt counts the leases granted on the key, this one included
	// (1 for the first execution). Takeovers of expired leases count. A
	// lost record takes its count with it: the next lease is attempt 1.
	Attempt int
	// TTL is the lease duration used for Acquire and every Extend.
	TTL time.Duration
	// Retention is the record's idempotency window.
	Retention time.Duration
	// Deadline is a conservative local estimate of when the lease expires:
	// the local time just before the request that set the server's
	// deadline was sent, plus TTL, less DeadlineSlack (the server's
	// rounding down to its millisecond). The server's deadline is never
	// earlier.
	Deadline time.Time

	rkey string // the record's Redis key, if a RedisStore issued the lease
	// made is set when a RedisStore's native Acquire made the record for
	// the lease (a format 2 record; fp is its fingerprint): the lease's
	// outcome can then be written without decoding the record (finish.lua).
	made bool
	fp   string
}

// Result is Acquire's answer.
type Result struct {
	// Status says which of the other fields are set.
	Status Status
	// Lease is the granted lease when Status is Acquired.
	Lease Lease
	// Value is the stored result when Status is Completed.
	Value []byte
	// Error is the stored error text when Status is Failed.
	Error string
	// Remaining is the time left on the other owner's lease, by the
	// server's clock, when Status is InProgress.
	Remaining time.Duration
	// Attempts is the number of leases granted on the key so far. For
	// Acquired it equals Lease.Attempt.
	Attempts int
	// Fence is the latest fencing token of the key.
	Fence int64
}

// Store keeps one record per idempotency key and hands out leases on it.
// Fences strictly increase per key while its record exists; they come
// from the store's clock in microseconds, so that a record lost and made
// again still gives higher fences unless that clock is behind the lost
// fence (see Lease.Fence). Attempts restart at 1 with a new record.
//
// Per key the record moves: absent → in progress (owner, fence, lease
// deadline, attempts, fingerprint) → completed (result) or failed (error).
// Release takes an in-progress record back to "not running" while keeping
// its attempt count and fence; Cancel does the same but takes back the
// attempt its Acquire counted (the fence stays raised). A record expires
// Retention after its last change; a record in progress lives at least
// TTL+Retention.
//
// Implementations are safe for concurrent use. Every method is safe to retry
// after a network error: a retried Acquire that finds its own owner token
// answers Acquired, and a retried Complete, Fail, Release or Cancel that
// finds its own write answers nil (a retried Cancel takes back no second
// attempt).
type Store interface {
	// Acquire takes a lease on req.Key, or reports why it could not.
	Acquire(ctx context.Context, req Request) (Result, error)
	// Extend renews each lease for its TTL, in one round trip where the
	// store can. It returns one error per lease, in order: nil,
	// ErrLeaseLost, or the transport error. A renewed lease's new
	// deadline is at least start+TTL-DeadlineSlack, where start is the
	// local time before the call.
	Extend(ctx context.Context, leases ...Lease) []error
	// Complete stores result and marks the record completed. A lease that
	// is no longer held gets ErrLeaseLost and changes nothing.
	Complete(ctx context.Context, lease Lease, result []byte) error
	// Fail marks the record failed for good with the error text reason
	// (cut to the store's MaxResultSize). ErrLeaseLost as for Complete.
	Fail(ctx context.Context, lease Lease, reason string) error
	// Release gives the lease up without an outcome (a retryable failure):
	// the next Acquire gets a new lease with a higher fence and attempt.
	// ErrLeaseLost as for Complete.
	Release(ctx context.Context, lease Lease) error
	// Cancel undoes an Acquire whose work never started: the lease is given up
	// as by Release, and the attempt it counted is taken back. The fence stays
	// raised, so no later lease reuses it. ErrLeaseLost as for Complete.
	Cancel(ctx context.Context, lease Lease) error
}
