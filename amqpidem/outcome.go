package amqpidem

import (
	"context"
	"fmt"
	"time"
)

// Outcome is what became of one delivery.
type Outcome int

// The outcomes, one per row of the broker mapping.
const (
	// Completed: the handler ran and succeeded; the record is completed
	// and the message acked.
	Completed Outcome = iota + 1
	// Duplicate: the key was already completed; acked without running
	// (the stored reply re-sent if the message has ReplyTo).
	Duplicate
	// Busy: another consumer holds the key's lease; requeued with
	// InProgressDelay, not counted as an attempt.
	Busy
	// Retried: the handler failed, retryably; requeued after the queue's
	// backoff.
	Retried
	// DeadLettered: a terminal failure (permanent error, attempts
	// exhausted, key conflict, missing key, failed duplicate); published
	// to the dead-letter target and acked.
	DeadLettered
	// Dropped: a duplicate of failed work, acked per
	// AckFailedDuplicate.
	Dropped
	// Abandoned: the execution could not finish (lease lost, shutdown,
	// broker or store unavailable); the message is requeued or left for
	// the broker to redeliver, and its result, if any, discarded.
	Abandoned
	// OutboxGivenUp: the work is completed, but this delivery gave up on
	// one or more of the messages it staged (Stage), or an earlier
	// execution staged, after the broker refused each MaxAttempts times
	// (Event.Outbox.Returned); acked, with Reason "staged message given
	// up". Those messages stay in the record (OutboxReturned) for an
	// operator to publish again. Final, like Completed and Duplicate.
	OutboxGivenUp
)

// String returns the outcome in lower case, as logged.
func (o Outcome) String() string {
	switch o {
	case Completed:
		return "completed"
	case Duplicate:
		return "duplicate"
	case Busy:
		return "busy"
	case Retried:
		return "retried"
	case DeadLettered:
		return "dead_lettered"
	case Dropped:
		return "dropped"
	case Abandoned:
		return "abandoned"
	case OutboxGivenUp:
		return "outbox_given_up"
	}
	return fmt.Sprintf("outcome(%d)", int(o))
}

// Event describes one processed delivery.
type Event struct {
	Queue    string  // Config.Queue
	Consumer string  // Config.ConsumerName
	Key      string  // the idempotency key; empty when the message had none
	Outcome  Outcome // what became of the delivery
	// Reason says why: always for Busy, Retried, DeadLettered, Dropped,
	// Abandoned and OutboxGivenUp ("attempts exhausted", "lease lost", ...); for Completed
	// and Duplicate only when something was out of the ordinary ("no
	// key", "store unavailable, failing open", "reply not re-sent",
	// "reply given up"). Reasons are fixed strings of amqpidem's (a
	// bounded set, fit for a metric label), never the handler's error.
	Reason  string
	Attempt int   // the lease's attempt, or the key's attempts so far; zero without a key
	Fence   int64 // the lease's fencing token, or the key's latest; zero without a key
	// Delay is how long the copy waits before it is delivered again, for
	// Busy, Retried and Abandoned: in its delay queue, or, when that could
	// not be published to, in this consumer before the copy goes straight
	// back. Zero when it went back at once (shutdown, a nack).
	Delay   time.Duration
	Handler time.Duration // how long the handler ran; zero if it did not run
	Total   time.Duration // the whole processing time, acks included
	Err     error         // the handler's or the infrastructure's error, if any
	// Outbox counts what this delivery did with staged messages (Stage).
	Outbox OutboxCounts
	// Published is when the message was first published: its
	// HeaderTimestampMillis header (Publisher and RabbitMQ's
	// message_timestamp plugin set it), else its timestamp property (whole
	// seconds); zero without either. Copies keep both, so time since
	// Published includes requeue delays.
	Published time.Time
}

// OutboxCounts is what one delivery did with the messages handlers staged
// (Stage), in an Event.
type OutboxCounts struct {
	// Staged is how many messages the handler staged in this delivery's
	// execution and had stored with its outcome.
	Staged int
	// Published is how many staged messages this delivery published, each
	// confirmed by the broker: its own execution's, or, for a duplicate,
	// those an earlier execution stored whose publishing had not ended
	// (Republished counts those).
	Published   int
	Republished int
	// Returned is how many staged messages this delivery gave up on,
	// returned or refused by the broker MaxAttempts times; they stay in
	// the record (OutboxReturned).
	Returned int
}

// Observer is told of every processed delivery, for metrics. Observe is
// called synchronously from the processing goroutine, after the delivery
// was settled (a Consumer may fold an ack into a multiple ack sent up to
// 20 ms later), and must be fast and safe for concurrent use.
type Observer interface {
	Observe(ctx context.Context, e Event)
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(ctx context.Context, e Event)

// Observe calls f(ctx, e).
func (f ObserverFunc) Observe(ctx context.Context, e Event) { f(ctx, e) }
