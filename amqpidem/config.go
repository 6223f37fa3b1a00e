package amqpidem

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Defaults applied by Config.withDefaults, in one place.
const (
	// DefaultLeaseTTL is how long a lease lasts between heartbeats.
	DefaultLeaseTTL = 30 * time.Second
	// DefaultRetention is the idempotency window: how long a completed or
	// failed outcome is remembered.
	DefaultRetention = 24 * time.Hour
	// DefaultMaxAttempts is how many executions a key gets before it is
	// dead-lettered.
	DefaultMaxAttempts = 5
	// DefaultInProgressDelay is how long a duplicate waits before it is
	// delivered again while another consumer holds the key's lease.
	DefaultInProgressDelay = 5 * time.Second
	// DefaultUnavailableDelay is how long a message waits before it is
	// delivered again when the store or the dead-letter target cannot be
	// reached.
	DefaultUnavailableDelay = 5 * time.Second
)

// MissingKeyPolicy says what to do with a message that has no usable
// idempotency key.
type MissingKeyPolicy int

const (
	// DeadLetterMissingKey dead-letters the message with reason
	// "missing key". The default.
	DeadLetterMissingKey MissingKeyPolicy = iota
	// ProcessMissingKey runs the handler without idempotency: no lease,
	// no stored outcome, every delivery executes. Retries and
	// dead-lettering still apply, counted by the attempt header.
	ProcessMissingKey
)

// FailedDuplicatePolicy says what to do with a duplicate of work that
// failed terminally.
type FailedDuplicatePolicy int

const (
	// DeadLetterFailedDuplicate dead-letters the duplicate (without running
	// it) with the stored error. The default.
	DeadLetterFailedDuplicate FailedDuplicatePolicy = iota
	// AckFailedDuplicate acknowledges and drops the duplicate; the first
	// copy was already dead-lettered.
	AckFailedDuplicate
)

// Config configures the processing of one queue. The zero value of every
// field but Queue is valid and documented.
type Config struct {
	// Queue is the queue consumed. Required. It names the dead-letter
	// queue ("<Queue>.dlq") and the delay queues ("<Queue>.delay.<ms>").
	Queue string
	// Endpoint names the inbox whose records this consumer keeps: a
	// message's record is kept under StoreKey(Endpoint, key), so two
	// consumers with different endpoints never see each other's records,
	// even on one store. Default Queue: each queue is its own inbox, and an
	// event fanned out to two queues runs once on each.
	//
	// Consumers of several queues that must share one inbox (a message
	// completed through one queue is a duplicate on the other) set the same
	// Endpoint explicitly. Do so only when the queues carry the same
	// operations: with a shared inbox, whichever queue's consumer takes the
	// key first runs it and every other queue acks it as a duplicate, and a
	// publisher to one queue can pre-complete or conflict message ids of
	// the other. At most 200 bytes, no NUL byte.
	Endpoint string
	// QueueType is the type of Queue: "classic" (the default) or
	// "quorum". It picks the delay queues of delayed requeues: a quorum
	// work queue gets quorum delay queues with at-least-once
	// dead-lettering, so that a requeued copy is not lost on its way back.
	// A Consumer fills it in from QueueArgs["x-queue-type"] when empty; a
	// queue that is quorum by other means (a custom Declare, a policy, the
	// virtual host's default queue type) must say so here, or its delay
	// queues are classic. The dead-letter queue "<Queue>.dlq" is declared
	// classic; declare it yourself (or set DeadLetterExchange) for another
	// type.
	QueueType string

	// LeaseTTL is the lease duration; the heartbeat renews it about every
	// LeaseTTL/3 while the handler runs. Default DefaultLeaseTTL.
	LeaseTTL time.Duration
	// Retention is the idempotency window. Default DefaultRetention.
	Retention time.Duration
	// Backoff makes a fresh backoff.BackOff for one delivery; the n-th
	// NextBackOff is the delay before retry n. backoff.Stop means "no
	// more retries": the message is dead-lettered. Default:
	// Exponential(time.Second, 5*time.Minute).
	Backoff func() backoff.BackOff
	// MaxAttempts is how many executions a key gets, crashes included,
	// before it is dead-lettered. Default DefaultMaxAttempts.
	MaxAttempts int
	// InProgressDelay is how long a duplicate waits while another consumer
	// holds the key. It is not counted as an attempt. Default
	// DefaultInProgressDelay.
	InProgressDelay time.Duration
	// UnavailableDelay is the requeue delay when the store cannot be
	// reached (and FailOpen is false) or a dead letter cannot be routed.
	// Default DefaultUnavailableDelay.
	UnavailableDelay time.Duration

	// Key extracts the idempotency key. Default MessageID.
	Key KeyFunc
	// MissingKey is the policy for messages without a usable key.
	// Default DeadLetterMissingKey.
	MissingKey MissingKeyPolicy
	// FailedDuplicate is the policy for duplicates of failed work.
	// Default DeadLetterFailedDuplicate.
	FailedDuplicate FailedDuplicatePolicy
	// SkipFingerprint turns off the payload check: by default a key seen
	// again with a different body is a "key conflict" and dead-lettered.
	SkipFingerprint bool
	// FailOpen runs the handler without idempotency when the store cannot
	// be reached: only when the store's error wraps lock.ErrUnavailable (a
	// network error, a timeout, a server that is loading or read-only).
	// Errors of one key's record (lock.ErrBadRecord, lock.ErrKeyCollision)
	// never fail open: the record exists and may be completed; such a
	// message is requeued after UnavailableDelay and dead-lettered after
	// MaxAttempts tries. Default false: fail closed, requeue with a delay.
	FailOpen bool
	// MaxResultSize limits a handler's result in bytes; a result over it
	// fails the message terminally ("result too large"). The stored value
	// is the result plus at most ResultOverhead bytes (which say where a
	// duplicate's reply may go), so MaxResultSize + ResultOverhead must not
	// exceed the store's own limit; NewConsumer and Wrap refuse a larger
	// value when the store tells its limit (a MaxResultSize() int method,
	// as lock's stores have). Default: the store's limit (or
	// lock.DefaultMaxResultSize) minus ResultOverhead.
	MaxResultSize int

	// DeadLetterExchange is where dead letters go. Default "" (the default
	// exchange), with DeadLetterRoutingKey "<Queue>.dlq", a durable queue
	// declared on demand.
	DeadLetterExchange string
	// DeadLetterRoutingKey is the dead letters' routing key. Default
	// "<Queue>.dlq".
	DeadLetterRoutingKey string

	// ConsumerName is written into dead letters' headers. Default: host
	// name and process id.
	ConsumerName string
	// Logger receives one record per message outcome. Nil discards.
	Logger *slog.Logger
	// Observer is told every outcome, for metrics. Nil: none.
	Observer Observer
}

// Validate reports the first invalid field, by name.
func (c Config) Validate() error {
	switch {
	case c.Queue == "":
		return errors.New("amqpidem: Config.Queue is required")
	case len(c.Queue) > 200:
		return fmt.Errorf("amqpidem: Config.Queue is %d bytes; at most 200 leave room for the .dlq and .delay suffixes", len(c.Queue))
	case c.LeaseTTL < 0 || (c.LeaseTTL > 0 && c.LeaseTTL < 10*time.Millisecond):
		return fmt.Errorf("amqpidem: Config.LeaseTTL %v must be zero (default %v) or at least 10ms", c.LeaseTTL, DefaultLeaseTTL)
	case c.Retention < 0 || (c.Retention > 0 && c.Retention < time.Millisecond):
		// Below a millisecond the store would keep nothing: idempotency off.
		return fmt.Errorf("amqpidem: Config.Retention %v must be zero (default %v) or at least 1ms", c.Retention, DefaultRetention)
	case len(c.Endpoint) > 200 || strings.IndexByte(c.Endpoint, 0) >= 0:
		return fmt.Errorf("amqpidem: Config.Endpoint must be at most 200 bytes with no NUL byte")
	case c.Endpoint == "" && strings.IndexByte(c.Queue, 0) >= 0:
		return fmt.Errorf("amqpidem: Config.Queue contains a NUL byte; set Config.Endpoint to name its records")
	case c.QueueType != "" && c.QueueType != queueClassic && c.QueueType != queueQuorum:
		return fmt.Errorf("amqpidem: Config.QueueType %q must be \"classic\" or \"quorum\"", c.QueueType)
	case c.MaxAttempts < 0:
		return fmt.Errorf("amqpidem: Config.MaxAttempts %d must not be negative", c.MaxAttempts)
	case c.InProgressDelay < 0:
		return fmt.Errorf("amqpidem: Config.InProgressDelay %v must not be negative", c.InProgressDelay)
	case c.UnavailableDelay < 0:
		return fmt.Errorf("amqpidem: Config.UnavailableDelay %v must not be negative", c.UnavailableDelay)
	case c.MissingKey != DeadLetterMissingKey && c.MissingKey != ProcessMissingKey:
		return fmt.Errorf("amqpidem: Config.MissingKey %d is not a policy", c.MissingKey)
	case c.FailedDuplicate != DeadLetterFailedDuplicate && c.FailedDuplicate != AckFailedDuplicate:
		return fmt.Errorf("amqpidem: Config.FailedDuplicate %d is not a policy", c.FailedDuplicate)
	case c.MaxResultSize < 0:
		return fmt.Errorf("amqpidem: Config.MaxResultSize %d must not be negative", c.MaxResultSize)
	}
	return nil
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	if c.Endpoint == "" {
		c.Endpoint = c.Queue
	}
	if c.QueueType == "" {
		c.QueueType = queueClassic
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.Retention == 0 {
		c.Retention = DefaultRetention
	}
	if c.Backoff == nil {
		c.Backoff = defaultBackoff
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.InProgressDelay == 0 {
		c.InProgressDelay = DefaultInProgressDelay
	}
	if c.UnavailableDelay == 0 {
		c.UnavailableDelay = DefaultUnavailableDelay
	}
	if c.Key == nil {
		c.Key = MessageID
	}
	if c.DeadLetterRoutingKey == "" {
		c.DeadLetterRoutingKey = c.Queue + ".dlq"
	}
	if c.ConsumerName == "" {
		c.ConsumerName = defaultConsumerName()
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// defaultBackoff is Config.Backoff's default.
var defaultBackoff = Exponential(time.Second, 5*time.Minute)

// Exponential returns a Config.Backoff factory: the first retry after
// initial, each next one twice as long, capped at max, with 10% jitter. It
// never says stop; Config.MaxAttempts ends the retries.
func Exponential(initial, max time.Duration) func() backoff.BackOff {
	return func() backoff.BackOff {
		b := backoff.NewExponentialBackOff()
		b.InitialInterval = initial
		b.Multiplier = 2
		b.RandomizationFactor = 0.1
		b.MaxInterval = max
		b.MaxElapsedTime = 0
		b.Reset()
		return b
	}
}

// retryDelay is the delay before retry n (n >= 1) from a fresh backoff;
// ok is false when the backoff says stop.
func (c Config) retryDelay(n int) (d time.Duration, ok bool) {
	b := c.Backoff()
	for range max(n, 1) {
		if d = b.NextBackOff(); d == backoff.Stop {
			return 0, false
		}
	}
	return d, true
}
