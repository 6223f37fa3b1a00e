package amqpidem

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// Defaults applied by Config.withDefaults, in one place.
const (
	// DefaultLeaseTTL is how long a lease lasts between heartbeats when
	// neither Config.LeaseTTL nor the store's own configuration sets it
	// (lock.Config.LeaseTTL, whose default this is).
	DefaultLeaseTTL = lock.DefaultLeaseTTL
	// DefaultRetention is the idempotency window (how long a completed or
	// failed outcome is remembered) when neither Config.Retention nor the
	// store's configuration sets it (lock.Config.Retention).
	DefaultRetention = lock.DefaultRetention
	// DefaultMaxAttempts is how many executions a key gets before it is
	// dead-lettered.
	DefaultMaxAttempts = 5
	// DefaultInProgressDelay is the longest a duplicate waits before it is
	// delivered again while another consumer holds the key's lease: the
	// default lease TTL, so that a crashed holder's lease is waited out in
	// one step and a long job is not polled more often than its lease
	// would expire.
	DefaultInProgressDelay = 30 * time.Second
	// MinInProgressDelay is the shortest a duplicate waits while another
	// consumer holds the key's lease, however little the lease has left.
	MinInProgressDelay = 250 * time.Millisecond
	// DefaultUnavailableDelay is how long a message waits before it is
	// delivered again when the store or the dead-letter target cannot be
	// reached.
	DefaultUnavailableDelay = 5 * time.Second
	// DefaultMaxStaged is how many messages one execution of a handler
	// may stage (Stage).
	DefaultMaxStaged = 100
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
	// queue ("<Queue>.dlq") and the delay queues: "<Queue>.delay.<ms>" for
	// a classic queue, "<Queue>.delayq.<ms>" for a quorum one (QueueType),
	// <ms> the delay tier (DelayTier: delays rounded to two significant
	// digits, so 4.9 s, 5 s and 5.5 s are three queues).
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
	// LeaseTTL/3 while the handler runs. Zero leaves it to the store: a
	// lock store's Config.LeaseTTL, whose default is DefaultLeaseTTL. Set
	// it in one of the two places; when both are set, this one wins.
	LeaseTTL time.Duration
	// Retention is the idempotency window: how long a completed or failed
	// outcome is remembered, so that a duplicate arriving later is
	// recognised. Zero leaves it to the store (lock.Config.Retention,
	// default DefaultRetention), with the same rule as LeaseTTL.
	//
	// It must be at least twice the lease TTL and a second, whatever the
	// handler: an execution holds a claim on the messages its handler
	// staged (Stage) for a lease TTL from its completion, and a copy that
	// comes back after a crash waits for that claim, requeued for up to
	// 1.1 times the time left (and a delay tier's 5% more); a record gone
	// before then makes the copy run the handler again. Validate refuses
	// a shorter Retention when both are set here; when one of them is
	// left to the store, the first execution that stages messages under
	// such a lease logs an error, once.
	Retention time.Duration
	// SafetyMargin is how long before its lease's deadline (by the local
	// clock) a handler whose lease could not be renewed is cancelled, so
	// that it stops before another consumer can take the key over. It must
	// cover the time a handler takes to notice its context and the clock
	// drift between this host and the store, and exceed the host's
	// scheduling latency, tens of milliseconds on a starved CPU (package
	// heartbeat, "Limits"). Zero: a fifth of the lease
	// TTL (see heartbeat.Config.SafetyMargin). It must be shorter than the
	// lease TTL: a lease no longer than the margin is never run.
	SafetyMargin time.Duration
	// HandlerTimeout bounds one execution of the handler: its context is
	// cancelled after that long, with ErrHandlerTimeout as the cause, and
	// unless the handler still returns a result, the execution counts as a
	// retryable failure (reason "handler timeout"): retried with Backoff,
	// dead-lettered after MaxAttempts. A handler that ignores its context
	// keeps its lease renewed and its concurrency slot until it returns.
	// Zero (the default): no timeout, since a long job must not be cut
	// off by a default; a hung handler then holds its lease until the
	// process stops. Set it to a bound the work can never need.
	HandlerTimeout time.Duration
	// Backoff makes a fresh backoff.BackOff (github.com/cenkalti/backoff/v4;
	// v5's API differs) for one delivery; the n-th
	// NextBackOff is the delay before retry n. backoff.Stop means "no
	// more retries": the message is dead-lettered. A Backoff that panics
	// is logged at error level and the retry waits UnavailableDelay.
	// Default: Exponential(time.Second, 5*time.Minute).
	Backoff func() backoff.BackOff
	// RetryDelay, when set, decides the delay before each retry from the
	// attempt, the handler's error and the delivery, in place of Backoff
	// (a handler's RetryAfter error still wins over it). Default nil:
	// Backoff decides.
	RetryDelay RetryDelayFunc
	// MaxAttempts is how many executions a key gets, crashes included,
	// before it is dead-lettered. Default DefaultMaxAttempts.
	MaxAttempts int
	// InProgressDelay is the longest a duplicate waits while another
	// consumer holds the key. It waits what the holder's lease has left,
	// as the store reports it (and 10% more), but at first only
	// MinInProgressDelay, then twice as long at each look (0.25 s, 0.5 s,
	// 1 s, ...; counted in HeaderBusy), at least MinInProgressDelay and at
	// most InProgressDelay, then is delivered again. A duplicate right
	// behind work that is about to finish is so settled within a second;
	// a live holder renews its lease, so a long job is looked at a few
	// times, then about once per lease TTL; a crashed holder's key is
	// taken over about as soon as its lease expires. It is not counted as
	// an attempt. Default DefaultInProgressDelay.
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
	// Fingerprint picks what the payload check compares: it returns the
	// bytes of d that must be the same in every copy of one key (they are
	// hashed; only the hash is stored). Use it when a producer's retries
	// differ in a field that does not change the operation, such as a
	// timestamp: return the body without it. A nil result skips the check
	// for that message. Default: the whole body. Setting it together with
	// SkipFingerprint is an error. A Fingerprint that panics makes the
	// message's key invalid (ErrInvalidKey): it is dead-lettered, reason
	// "invalid key", never run.
	Fingerprint func(d *amqp.Delivery) []byte
	// FailOpen runs the handler without idempotency when the store cannot
	// be reached: only when the store's error wraps lock.ErrUnavailable (a
	// network error, a timeout, a server that is loading or read-only).
	// Errors of one key's record (lock.ErrBadRecord, lock.ErrKeyCollision)
	// never fail open: the record exists and may be completed; such a
	// message is requeued after UnavailableDelay and dead-lettered after
	// MaxAttempts tries. Default false: fail closed, requeue with a delay.
	FailOpen bool
	// MaxStaged bounds the messages one execution of the handler may stage
	// (Stage): past it, Stage returns ErrOutboxFull. The staged messages
	// and the result together must also fit in what the store keeps in
	// one record (its MaxResultSize; Stage refuses messages past what fits
	// with an empty result). Default DefaultMaxStaged.
	MaxStaged int
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
	// DeadLetterQueueArgs are the arguments amqpidem declares its own
	// dead-letter queue "<Queue>.dlq" with (when DeadLetterExchange and
	// DeadLetterRoutingKey are left to their defaults), e.g.
	// amqp.Table{"x-queue-type": "quorum"}. Default none: a durable
	// classic queue. Changing them for a queue that exists makes its
	// declaration fail (PRECONDITION_FAILED) until the queue is deleted.
	DeadLetterQueueArgs amqp.Table
	// DelayQueueArgs are extra arguments for the delay queues of delayed
	// requeues, e.g. amqp.Table{"x-queue-leader-locator": "balanced"}. The
	// arguments amqpidem sets itself (x-queue-type, x-message-ttl,
	// x-expires, x-overflow and the x-dead-letter-* ones) cannot be
	// overridden; Validate refuses them. Default none.
	DelayQueueArgs amqp.Table
	// DelayInProcess waits out every requeue delay (retries, busy
	// duplicates, an unavailable store) in the consumer instead of in a
	// delay queue: the delivery stays unacknowledged in its queue
	// meanwhile, then a copy is published straight back to the queue and
	// the delivery acked. No delay queue is declared and no broker
	// dead-lettering is involved. Use it on a RabbitMQ cluster whose
	// quorum delay queues can strand copies when a node fails: RabbitMQ
	// 3.10.8 did so in chaos scenarios 13 and 14 (docs/scale.md).
	//
	// A waiting delivery holds one of the Prefetch deliveries the broker
	// sends, not a handler slot: set Concurrency explicitly and Prefetch
	// above it by the retries and busy duplicates that may wait at once.
	// If the delivery's channel closes during the wait (a connection
	// lost, a node down) the broker delivers it again at once, and a
	// Consumer publishes no copy (a Wrapper cannot tell: its copy goes out
	// at the end of the wait, a duplicate); a quorum queue counts that
	// delivery against its delivery limit. Consumer.Shutdown and Wrapper.Shutdown cut waits
	// short and send their copies back at once. A Wrapper's Handle blocks
	// for the wait. Keep delays under the broker's consumer_timeout
	// (30 minutes by default), past which it closes a channel that holds
	// an unacknowledged delivery; the default backoff and InProgressDelay
	// are minutes below it. Default false: delay queues.
	DelayInProcess bool

	// SigningKey, when set (at least MinSigningKey bytes, a random
	// secret), signs the copies the consumer publishes (HeaderSignature,
	// an HMAC of the headers an operator acts on and of the body), so
	// that the CLI given the same key (`amqpidem dlq replay
	// --signing-key`, or AMQPIDEM_SIGNING_KEY) can tell dead letters
	// amqpidem wrote from messages that reached the dead-letter queue
	// another way, with headers a publisher chose: it forgets records
	// (--forget) and republishes to original exchanges
	// (--to-original-exchange) only for signed ones. With it, the
	// original exchange and routing key a delivery's headers name are
	// carried onto its copies only when its signature verifies (else the
	// delivery's own are named). Give every consumer of a queue the same
	// key; changing it makes the copies signed before unverifiable (their
	// original exchange is then the one they came back through). Default
	// none: nothing is signed, and the CLI acts on those headers only
	// with --trust-headers. See docs/security.md.
	SigningKey []byte
	// ReplyTo, when set, are the only reply queues the consumer sends
	// replies to: a message whose ReplyTo is none of them is
	// dead-lettered ("reply-to refused") without running its handler. An
	// entry ending in "*" matches every name that begins with what comes
	// before it, e.g. "amq.rabbitmq.reply-to.*" for direct reply-to
	// (where a client names the pseudo-queue "amq.rabbitmq.reply-to" and
	// the consumer sees "amq.rabbitmq.reply-to." and a suffix).
	// Messages without ReplyTo are not affected. Without it (the
	// default), a reply goes to whatever queue the message names, with
	// the consumer's credentials, as in any AMQP RPC: see the package
	// documentation.
	ReplyTo []string

	// ConsumerName is written into dead letters' headers. Default: host
	// name and process id.
	ConsumerName string
	// Logger receives what amqpidem has to say: warnings and errors (a
	// dead letter, a store or broker that cannot be reached, a lease
	// lost), and one record per message: at debug level for the outcomes
	// that need no attention (completed, duplicate, busy), at info for
	// retries and requeues, at warn for dead letters and errors. Default
	// slog.Default(). To silence it, pass
	// slog.New(slog.DiscardHandler). The store and the heartbeat keeper
	// log with their own Config.Logger; amqpidem gives the keeper this one.
	Logger *slog.Logger
	// Observer is told every outcome, for metrics. Nil: none. An Observer
	// that is also a HandlerObserver is told when handlers start and
	// return; one that is also a StoreObserver, of every store call.
	// Observers combines several.
	Observer Observer
	// Tracer follows each delivery, for distributed tracing: it may give
	// the handler's context a span and add trace headers to the messages
	// handlers stage and the copies amqpidem publishes; a PublishTracer
	// follows each of those publishes too. Nil: none.
	Tracer Tracer
}

// minRetention is the shortest Retention that outlasts, with a margin,
// what a copy arriving after the crash of a completed execution waits
// under a lease of ttl: the execution's claim on its staged messages (ttl
// from its completion), requeued as busy for 1.1 times the time left (a
// delay tier adds up to 5%) or MinInProgressDelay.
func minRetention(ttl time.Duration) time.Duration { return 2*ttl + time.Second }

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
	case c.Retention > 0 && c.LeaseTTL > 0 && c.Retention < minRetention(c.LeaseTTL):
		return fmt.Errorf("amqpidem: Config.Retention %v must be at least twice Config.LeaseTTL %v and a second (%v): a completed "+
			"record must outlast the claim its execution holds on the messages its handler staged (a lease TTL from its completion) "+
			"and the wait of a copy that comes back after a crash (up to 1.1 times that claim), or the copy finds the record gone "+
			"and runs the handler again", c.Retention, c.LeaseTTL, minRetention(c.LeaseTTL))
	case len(c.Endpoint) > 200 || strings.IndexByte(c.Endpoint, 0) >= 0:
		return fmt.Errorf("amqpidem: Config.Endpoint must be at most 200 bytes with no NUL byte")
	case c.Endpoint == "" && strings.IndexByte(c.Queue, 0) >= 0:
		return fmt.Errorf("amqpidem: Config.Queue contains a NUL byte; set Config.Endpoint to name its records")
	case c.QueueType != "" && c.QueueType != queueClassic && c.QueueType != queueQuorum:
		return fmt.Errorf("amqpidem: Config.QueueType %q must be \"classic\" or \"quorum\"", c.QueueType)
	case c.MaxAttempts < 0:
		return fmt.Errorf("amqpidem: Config.MaxAttempts %d must not be negative", c.MaxAttempts)
	case c.SafetyMargin < 0:
		return fmt.Errorf("amqpidem: Config.SafetyMargin %v must not be negative", c.SafetyMargin)
	case c.SafetyMargin > 0 && c.LeaseTTL > 0 && c.SafetyMargin >= c.LeaseTTL:
		return fmt.Errorf("amqpidem: Config.SafetyMargin %v must be shorter than Config.LeaseTTL %v", c.SafetyMargin, c.LeaseTTL)
	case c.HandlerTimeout < 0:
		return fmt.Errorf("amqpidem: Config.HandlerTimeout %v must not be negative (zero: no timeout)", c.HandlerTimeout)
	case c.SkipFingerprint && c.Fingerprint != nil:
		return errors.New("amqpidem: Config.SkipFingerprint and Config.Fingerprint are both set; set one")
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
	case c.MaxStaged < 0:
		return fmt.Errorf("amqpidem: Config.MaxStaged %d must not be negative", c.MaxStaged)
	case len(c.SigningKey) > 0 && len(c.SigningKey) < MinSigningKey:
		return fmt.Errorf("amqpidem: Config.SigningKey is %d bytes; use a random secret of at least %d", len(c.SigningKey), MinSigningKey)
	}
	for _, r := range c.ReplyTo {
		if r == "" || r == "*" {
			return fmt.Errorf("amqpidem: Config.ReplyTo entry %q allows nothing or everything: name reply queues, or prefixes ending in *", r)
		}
	}
	if c.DelayInProcess && len(c.DelayQueueArgs) > 0 {
		return errors.New("amqpidem: Config.DelayQueueArgs has no use with DelayInProcess, which declares no delay queue")
	}
	for _, k := range delayArgsOwned {
		if _, ok := c.DelayQueueArgs[k]; ok {
			return fmt.Errorf("amqpidem: Config.DelayQueueArgs sets %q, which amqpidem sets itself", k)
		}
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
	if c.Backoff == nil {
		c.Backoff = defaultBackoff
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.MaxStaged == 0 {
		c.MaxStaged = DefaultMaxStaged
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
		c.Logger = slog.Default()
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
