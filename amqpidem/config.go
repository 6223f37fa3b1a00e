package amqpidem

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/amqpidem/amqpidem/lock"
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
	// be reached. Default false: fail closed, requeue with a delay.
	FailOpen bool
	// MaxResultSize limits a stored result in bytes; a handler result over
	// it fails the message terminally. Default lock.DefaultMaxResultSize.
	// It must not exceed the store's own limit.
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
	case c.Retention < 0:
		return fmt.Errorf("amqpidem: Config.Retention %v must not be negative", c.Retention)
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
	if c.MaxResultSize == 0 {
		c.MaxResultSize = lock.DefaultMaxResultSize
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
