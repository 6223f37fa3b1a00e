package amqpidem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// Defaults of ConsumerConfig.
const (
	// DefaultPrefetch is the channel's QoS prefetch count.
	DefaultPrefetch = 32
)

// ErrConsumerClosed is returned by Run after Shutdown.
var ErrConsumerClosed = errors.New("amqpidem: consumer closed")

// ConsumerConfig configures a Consumer. Zero values are documented and
// defaulted in one place.
type ConsumerConfig struct {
	// Config is the per-queue processing configuration. Config.Queue is
	// required.
	Config

	// URL is the AMQP URL to dial, e.g. amqp://guest:guest@127.0.0.1:5672/.
	// Required unless Dial is set. Percent-encode the reserved characters
	// of its user name and password ('%' as %25, '/' as %2F, '#' as %23,
	// '?' as %3F, '@' as %40, ':' as %3A): a URL that does not parse ends
	// Run at once. amqpidem never logs or returns its password.
	URL string
	// Dial opens a connection; it overrides URL (for TLS or custom
	// amqp.Config). The Consumer keeps two: one it consumes on, dialled
	// again on every reconnection, and one it publishes its copies on,
	// dialled when first needed and again once it has closed. Leave
	// amqp.Config.Recovery nil: the Consumer reconnects itself, and a
	// connection that recovers by itself ends Run with ErrAutoRecovery.
	// Shutdown, Run's context and a copy's settle timeout do not wait for
	// a Dial that hangs (a broker that accepts and never answers): its
	// goroutine is left to return, and the connection it returns then is
	// closed. Give it a timeout (amqp.DefaultDial's 30 s is the default of
	// amqp.DialConfig). The URL's own dial is given up at once, its socket
	// closed.
	Dial func() (*amqp.Connection, error)
	// Prefetch is the QoS prefetch count. Default DefaultPrefetch.
	Prefetch int
	// Concurrency bounds the deliveries being worked on at once, from
	// taking the lease to the handler's return: at most Concurrency
	// handlers run, and at most Concurrency leases are taken ahead of a
	// handler's end. Default Prefetch.
	// Deliveries start in delivery order: with Concurrency 1, one after the
	// other in queue order (requeued copies go to the back of the queue).
	// Storing the outcome and settling the delivery happen after the slot
	// is given back, and a duplicate gives it back right after its lookup.
	// Handlers still running from a connection that died hold their
	// slots until they return.
	Concurrency int
	// QueueArgs are the arguments the default declaration gives the queue,
	// e.g. amqp.Table{"x-queue-type": "quorum"}. Ignored when Declare is set.
	QueueArgs amqp.Table
	// Declare declares the topology on every (re)connection, before
	// consuming. Default: declare Queue durable with QueueArgs.
	Declare func(ch *amqp.Channel) error
	// Reconnect makes the backoff between reconnection attempts; a
	// backoff.Stop ends Run with the last error. Default: exponential,
	// 100 ms to 10 s, forever, each wait randomized by ±50% (backoff's
	// default: a wait at the cap is 5 to 15 s). A refusal that reconnecting cannot cure
	// (wrong credentials, a queue declared with other arguments: see
	// Consumer.Run) ends Run at once, whatever Reconnect says.
	Reconnect func() backoff.BackOff
	// ConsumerTag names the AMQP consumer. Default: "amqpidem.", the
	// consumer name and a random suffix.
	ConsumerTag string

	// BatchSize is the most deliveries a batch consumer (NewBatchConsumer)
	// gives its handler at once; a batch never holds more than
	// Concurrency. Default DefaultBatchSize. NewConsumer ignores it.
	BatchSize int
	// BatchWait is how long a batch consumer's batch waits for more
	// deliveries once its first is ready to run: a batch runs when it has
	// BatchSize deliveries or BatchWait has passed, whichever comes
	// first. It bounds the latency batching adds: with a store that
	// takes leases in batches (lock.BatchAcquirer, or a handler that is a
	// BatchLeaseTaker), a delivery waits up
	// to BatchWait for its lease's batch, then up to a fifth of it for
	// its handler's: none once no delivery is on its way there from a
	// lease batch, longer (up to BatchWait) only while deliveries of an
	// answered lease batch are still on their way, so that one lease
	// batch is not split in two. Default DefaultBatchWait. NewConsumer
	// ignores it.
	BatchWait time.Duration
}

// maxPrefetch is the largest QoS prefetch count: the field is 16 bits.
const maxPrefetch = 1<<16 - 1

// Validate reports the first invalid field, by name: the connection's
// own fields, then the embedded Config's (Config.Validate). NewConsumer
// calls it.
func (c ConsumerConfig) Validate() error {
	switch {
	case c.URL == "" && c.Dial == nil:
		return errors.New("amqpidem: ConsumerConfig.URL is required (or Dial)")
	case c.Prefetch < 0:
		return fmt.Errorf("amqpidem: ConsumerConfig.Prefetch %d must not be negative", c.Prefetch)
	case c.Prefetch > maxPrefetch:
		return fmt.Errorf("amqpidem: ConsumerConfig.Prefetch %d is above %d, the largest prefetch count AMQP carries", c.Prefetch, maxPrefetch)
	case c.Concurrency < 0:
		return fmt.Errorf("amqpidem: ConsumerConfig.Concurrency %d must not be negative", c.Concurrency)
	case c.BatchSize < 0:
		return fmt.Errorf("amqpidem: ConsumerConfig.BatchSize %d must not be negative", c.BatchSize)
	case c.BatchWait < 0:
		return fmt.Errorf("amqpidem: ConsumerConfig.BatchWait %v must not be negative", c.BatchWait)
	}
	return c.Config.Validate()
}

func (c ConsumerConfig) withDefaults() ConsumerConfig {
	if c.Prefetch == 0 {
		c.Prefetch = DefaultPrefetch
	}
	if c.Concurrency == 0 {
		c.Concurrency = c.Prefetch
	}
	if c.Declare == nil {
		queue, args := c.Queue, c.QueueArgs
		c.Declare = func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclare(queue, true, false, false, false, args)
			return err
		}
	}
	if c.ConsumerTag == "" {
		// Ours, not the client library's: Shutdown must name it to cancel.
		c.ConsumerTag = "amqpidem." + c.ConsumerName + "." + randomSuffix()
	}
	if c.Reconnect == nil {
		c.Reconnect = func() backoff.BackOff {
			b := backoff.NewExponentialBackOff()
			b.InitialInterval = 100 * time.Millisecond
			b.MaxInterval = 10 * time.Second
			b.MaxElapsedTime = 0
			b.Reset()
			return b
		}
	}
	return c
}

// Consumer runs the delivery loop for one queue: it connects, declares the
// topology, sets QoS, consumes with manual acks, runs the handler for each
// delivery with bounded concurrency through the same processing as
// Wrapper, and reconnects with backoff when the connection or channel dies.
// A delivery is only ever acked on the channel it came from.
//
// The copies it publishes (delayed requeues, dead letters, replies) go out
// on a connection of its own, dialled with the same Dial when first needed
// and again once it has closed, as RabbitMQ advises: a broker short of
// memory or disk blocks the connections that publish, and a consuming
// connection that published would have its acks blocked with it. A
// connection.blocked notification is logged at warn level, with the
// broker's reason, and its end at info level. A copy whose confirm does
// not come while the connection is blocked gives up at its settle timeout
// (the delivery is then held and sent back, or nacked); the channel it
// gave up is closed in the background, and Run's end closes the
// publishing connection within a second, so that a blocked broker holds
// up neither.
//
// When the consuming connection or channel dies, the Consumer reconnects
// without waiting for the handlers in flight: the broker has put their
// deliveries back in the queue already. Those handlers run on, their
// context not cancelled, still counting against Concurrency; their
// outcome is stored as usual (completed, or failed), but their ack fails
// on the closed channel. The broker's redelivery is then acked as a
// duplicate of the stored outcome, or requeued as busy while the lease is
// still held. A delivery of the dead channel still waiting for a slot is
// not started at all, and neither acked nor requeued: the broker delivers
// it again. (One that got its slot just before, and is taking its lease,
// goes on as an in-flight one.)
//
// Consumer is safe for concurrent use; Run once, Shutdown any number of
// times.
type Consumer struct {
	cfg  ConsumerConfig
	proc processor
	// ownDeclare is set when ConsumerConfig.Declare was the user's.
	ownDeclare bool
	// dial dials the consuming connection (see connect); ownDial is set
	// when it is amqpidem's own (ConsumerConfig.URL), which stopping
	// interrupts.
	dial    dialFunc
	ownDial bool
	pubConn *pubConn   // the connection copies are published on
	pub     *publisher // publishes on pubConn, for every session

	force    context.Context // cancelled to force the handlers to stop
	cancel   context.CancelFunc
	stopping chan struct{}
	stopOnce sync.Once
	done     chan struct{}
	running  chan struct{} // closed when Run starts
	runOnce  sync.Once
	// consuming is set while a session consumes (see Ready).
	consuming atomic.Bool

	// tasks counts the goroutines Run starts: the workers that run the
	// handlers (of every session, dead or alive), the cleanups of dead
	// sessions, the watchers of the consuming connections' blocked
	// notifications, the store check. Run waits for all of them.
	tasks sync.WaitGroup
}

// NewConsumer returns a Consumer running h on cfg.Queue with store. It makes
// no network call; Run connects.
//
// A Completer (pgstore's TxHandler) holds a connection of its store for
// as long as it runs: on a store with a bounded pool (ConnPool) of no more
// connections than Concurrency, NewConsumer returns an error wrapping
// ErrPoolTooSmall, since the heartbeat could not renew the leases of
// handlers holding every connection. Run warns at start when a plain
// handler's store pool is that small (its store calls wait for one
// another), and when Concurrency is above Prefetch (no more than
// Prefetch handlers ever run at once).
func NewConsumer(store lock.Store, cfg ConsumerConfig, h Handler) (*Consumer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := checkPool(store, h, cmp.Or(cfg.Concurrency, cfg.Prefetch, DefaultPrefetch)); err != nil {
		return nil, err
	}
	if t, ok := cfg.QueueArgs["x-queue-type"].(string); ok && cfg.QueueType == "" {
		cfg.QueueType = t
	}
	proc, err := newProcessor(store, cfg.Config, h)
	if err != nil {
		return nil, err
	}
	cfg.Config = proc.cfg
	ownDeclare := cfg.Declare != nil
	ownDial := cfg.Dial == nil
	dial := urlDial(cfg.URL)
	if !ownDial {
		dial = userDial(cfg.Dial)
	}
	cfg = cfg.withDefaults()
	stopping := make(chan struct{})
	proc.gate, proc.stopping = newGate(cfg.Concurrency), stopping
	force, cancel := context.WithCancel(context.Background())
	pc := newPubConn(dial, ownDial, proc.cfg.Logger, cfg.Queue)
	pc.abort = force.Done() // forced to stop: copies wait for no dial
	pub := newPublisher(pc, proc.cfg.QueueType)
	pub.delayArgs = proc.cfg.DelayQueueArgs
	c := &Consumer{
		cfg: cfg, proc: proc, ownDeclare: ownDeclare, dial: dial, ownDial: ownDial, pubConn: pc, pub: pub,
		force: force, cancel: cancel,
		stopping: stopping, done: make(chan struct{}), running: make(chan struct{}),
	}
	cleanUpWhenUnreachable(c, proc.keeper, pub) // Run closes the publishing connection
	return c, nil
}

// NewBatchConsumer returns a Consumer running h on batches of cfg.Queue's
// deliveries, with store (see docs/batches.md in the repository).
//
// Each delivery goes its own way up to its handler, as with NewConsumer:
// its key, fingerprint and lease are taken (with a store that is a
// lock.BatchAcquirer, as pgstore's and lock's are, the leases of up to BatchSize
// deliveries arriving within BatchWait in one call, or, with a handler
// that is a BatchLeaseTaker, as pgstore's BatchTxHandler is, in one call
// of its AcquireLeaseBatch; otherwise one store call each, made
// concurrently), and a duplicate, a
// conflict, a busy key, a failed or expired one is settled on its own,
// as the outcome table of the package documentation says. The deliveries
// whose handler is to run then wait, their leases kept by the heartbeat,
// until BatchSize of them are ready or BatchWait has passed since the
// first, and h gets them together: the new deliveries only. Each is then
// settled by its own BatchResult, as a single message's outcome (see
// BatchHandler for a batch's error, which splits the batch). A
// BatchCompleter (pgstore's BatchTxHandler) completes the records of the
// batch in its own transaction, once; otherwise the records are
// completed after h returns: in one call when the store is a
// lock.BatchCompleter (lock's RedisStore and MemoryStore), else one
// store call per message.
//
// Prefetch defaults to four times BatchSize (at most 65535) and
// Concurrency then to twice BatchSize: two batches run or gather, with
// their leases, while the broker has already sent the deliveries of the
// next two, not leased yet, rather than waiting for an ack to send more
// (docs/performance.md: with twice BatchSize, the rate on a quorum queue
// was 0.77 of this default's in one make bench run). A Prefetch set
// without Concurrency gives Concurrency = Prefetch, as for NewConsumer.
// At most Concurrency over BatchSize batches (rounded up) run at once;
// one ready beyond that waits for a running one to end, gathering
// meanwhile. A message processed without a lease (ProcessMissingKey,
// FailOpen) runs as a batch of its own.
func NewBatchConsumer(store lock.Store, cfg ConsumerConfig, h BatchHandler) (*Consumer, error) {
	if h == nil {
		return nil, errors.New("amqpidem: nil batch handler")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	bc, _ := h.(BatchCompleter)
	if bc != nil && !sameStore(bc.CompleterStore(), store) {
		return nil, errors.New("amqpidem: the batch handler completes records in another store than the one given (a BatchCompleter's CompleterStore must be the Consumer's store)")
	}
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultBatchSize)
	cfg.BatchWait = cmp.Or(cfg.BatchWait, DefaultBatchWait)
	if cfg.Prefetch == 0 {
		cfg.Prefetch = min(4*cfg.BatchSize, maxPrefetch)
		if cfg.Concurrency == 0 {
			cfg.Concurrency = min(2*cfg.BatchSize, cfg.Prefetch)
		}
	}
	if err := checkBatchPool(store, bc, batchesAtOnce(cmp.Or(cfg.Concurrency, cfg.Prefetch), cfg.BatchSize)); err != nil {
		return nil, err
	}
	slots := make(chan struct{}, batchesAtOnce(cmp.Or(cfg.Concurrency, cfg.Prefetch), cfg.BatchSize))
	c, err := NewConsumer(store, cfg, batchOnly{h: h, slots: slots})
	if err != nil {
		return nil, err
	}
	ba, _ := store.(lock.BatchAcquirer)
	bt, _ := h.(BatchLeaseTaker)
	c.proc.batch = &batcher{h: h, bc: bc, ba: ba, bt: bt, size: cfg.BatchSize, wait: cfg.BatchWait, slots: slots}
	return c, nil
}

// storeCheckTimeout bounds the store check Run makes at start.
const storeCheckTimeout = 5 * time.Second

// Run consumes until Shutdown is called or ctx is done, reconnecting after
// failures. It returns ErrConsumerClosed after Shutdown, ctx.Err() when ctx
// ends (in-flight handlers are cancelled and their messages go back to the
// queue, as with Shutdown; wrapping the last attempt's error too when ctx
// ended while Run was still trying to connect and consume), or the last
// connection error when Reconnect
// says stop. Run may be called once. It returns once every handler it
// started has returned, those of connections that died included.
//
// The handlers' context carries ctx's values (trace spans, loggers), not
// its cancellation: ctx ending cancels them as said above, and so does
// Shutdown's deadline.
//
// A refusal by the broker that the next connection would meet again ends
// Run at once, logged at error level, with an error that says what to fix
// and wraps the broker's *amqp.Error:
//
//   - ACCESS_REFUSED (403) on dial, amqp.ErrCredentials and amqp.ErrSASL
//     included: wrong user name or password, no shared authentication
//     mechanism, or no access to the vhost;
//   - NOT_ALLOWED (530) on dial: the vhost does not exist, or the user
//     has no permissions on it (but a connection limit reached is
//     transient);
//   - ACCESS_REFUSED (403) while declaring or consuming the queue: the
//     user lacks permissions on it, or another connection uses it
//     exclusively;
//   - PRECONDITION_FAILED (406) from Declare, QoS or consume, typically a
//     queue that exists with arguments other than QueueArgs;
//   - NOT_FOUND (404) on the consumed queue: it does not exist (a custom
//     Declare that does not declare it).
//
// So does a URL that does not parse (an unescaped '%', '#', '/' or '?'
// in its password, typically): its error names the URL with the password
// hidden and quotes nothing of it.
//
// Shutdown and ctx are heard while a connection is dialled and set up: a
// broker that accepts the connection and never answers holds up neither
// (see ConsumerConfig.Dial).
//
// A login refused without a word (RabbitMQ closes the socket:
// amqp.ErrCredentials) looks the same as a broker going down in the
// middle of the handshake, so it ends Run when the next attempt is refused
// too. Every other failure (connection refused or reset,
// CONNECTION_FORCED (320) from a broker restart, timeouts, a channel that
// dies while consuming) is transient: Run logs it at warn level with the
// attempt number and reconnects after Reconnect's backoff.
//
// If store has a method Check(context.Context) error (lock.RedisStore
// has: it warns when Redis may evict records), Run calls it once at start,
// for at most 5 s, while it connects. An error is logged at error level
// and does not end Run: until the store answers, deliveries are requeued
// (Config.FailOpen aside).
func (c *Consumer) Run(ctx context.Context) error {
	started := false
	c.runOnce.Do(func() { started = true; close(c.running) })
	if !started {
		return errors.New("amqpidem: Consumer.Run called twice")
	}
	defer close(c.done)
	// Run is the keeper's last user: however Run ends, Shutdown or not,
	// the keeper's goroutines end with it.
	defer func() {
		kctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
		defer cancel()
		_ = c.proc.keeper.Shutdown(kctx)
	}()
	if c.isStopping() {
		return ErrConsumerClosed
	}
	stopCtx := context.AfterFunc(ctx, c.cancel) // ctx ending forces handlers to stop
	defer stopCtx()
	// The handlers' parent: ctx's values without its cancellation,
	// cancelled when they are forced to stop.
	base, cancelBase := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelBase()
	stopBase := context.AfterFunc(c.force, cancelBase)
	defer stopBase()

	checkCtx, endCheck := context.WithTimeout(ctx, storeCheckTimeout)
	defer func() {
		endCheck()
		c.tasks.Wait() // every session's handlers have settled
		c.pub.close()
		c.pubConn.close()
		c.pub.wait() // its channels' closes end with the connection
	}()
	c.checkStore(checkCtx)
	c.warnSizes(ctx)

	log := c.proc.cfg.Logger
	bo := c.cfg.Reconnect()
	attempt := 0
	refused := false // the last attempt's login was refused without a word
	for {
		err := c.session(ctx, base)
		if c.isStopping() {
			return ErrConsumerClosed
		}
		if ctx.Err() != nil {
			return ended(ctx, err)
		}
		var perm *permanentError
		if errors.As(err, &perm) && (!perm.ambiguous || refused) {
			log.ErrorContext(ctx, "amqpidem: cannot consume; fix the configuration", "queue", c.cfg.Queue, "error", perm.err)
			return perm.err
		}
		refused = perm != nil && perm.ambiguous
		if errors.Is(err, errConsumed) {
			bo.Reset() // it worked for a while: start the backoff over
			attempt = 0
		}
		attempt++
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			log.ErrorContext(ctx, "amqpidem: cannot consume; Reconnect gave up", "queue", c.cfg.Queue,
				"error", err, "attempt", attempt)
			return err
		}
		msg := "amqpidem: cannot consume; retrying"
		if errors.Is(err, errConsumed) {
			msg = "amqpidem: connection lost; reconnecting"
		}
		log.WarnContext(ctx, msg, "queue", c.cfg.Queue, "error", err, "attempt", attempt, "wait", wait)
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-c.stopping:
			t.Stop()
			return ErrConsumerClosed
		case <-ctx.Done():
			t.Stop()
			return ended(ctx, err)
		}
	}
}

// ended is what Run returns when ctx ends after a session that ended
// with last: ctx's error, wrapping last too when no session was
// consuming (it is why Run was still trying), so that the caller sees
// the cause, not only "context deadline exceeded".
func ended(ctx context.Context, last error) error {
	if last == nil || errors.Is(last, errConsumed) || errors.Is(last, context.Canceled) || errors.Is(last, context.DeadlineExceeded) {
		return ctx.Err()
	}
	return fmt.Errorf("%w; the last attempt to consume failed: %w", ctx.Err(), last)
}

// checkStore runs the store's Check, if it has one, in the background;
// ctx bounds it.
func (c *Consumer) checkStore(ctx context.Context) {
	s, ok := c.proc.given.(interface{ Check(context.Context) error })
	if !ok {
		return
	}
	c.tasks.Add(1)
	go func() {
		defer c.tasks.Done()
		err := s.Check(ctx)
		if err == nil || errors.Is(ctx.Err(), context.Canceled) {
			return // fine, or Run ended first
		}
		c.proc.cfg.Logger.ErrorContext(ctx, "amqpidem: the store check failed; consuming anyway, deliveries are requeued until the store answers",
			"queue", c.cfg.Queue, "error", err)
	}()
}

func (c *Consumer) isStopping() bool {
	select {
	case <-c.stopping:
		return true
	default:
		return false
	}
}

// Shutdown stops consuming, sends the deliveries whose handler has not
// started back to the queue, lets the handlers in flight (those of earlier,
// dead connections included) finish until ctx is done, then cancels the
// rest: their messages go back to the queue (a confirmed copy, then an
// ack; a nack with requeue only if the copy fails) and their leases are
// released. It then stops the keeper and returns ctx.Err() if handlers had
// to be cancelled. A handler that ignores its context delays Shutdown
// until it returns. Shutdown is idempotent and may be called before,
// during or after Run.
//
// The first call logs, at info level, "amqpidem: shutting down" with the
// handlers in flight (in_flight), and "amqpidem: shut down" with how it
// ended (ended: "handlers finished", or "deadline passed, handlers
// cancelled").
func (c *Consumer) Shutdown(ctx context.Context) error {
	first := false
	c.stopOnce.Do(func() {
		first = true
		c.proc.cfg.Logger.InfoContext(ctx, "amqpidem: shutting down", "queue", c.cfg.Queue, "in_flight", c.proc.gate.held())
		close(c.stopping)
	})
	var err error
	select {
	case <-c.running:
		select {
		case <-c.done:
		case <-ctx.Done():
			err = ctx.Err()
			c.cancel()
			<-c.done
		}
	default: // Run never started
	}
	c.cancel()
	kctx, cancel := settleContext(ctx)
	defer cancel()
	err = errors.Join(err, c.proc.keeper.Shutdown(kctx))
	if first {
		logShutDown(ctx, c.proc.cfg.Logger, c.cfg.Queue, err)
	}
	return err
}

// logShutDown logs the end of a Shutdown that returned err.
func logShutDown(ctx context.Context, log *slog.Logger, queue string, err error) {
	if err == nil {
		log.InfoContext(ctx, "amqpidem: shut down", "queue", queue, "ended", "handlers finished")
		return
	}
	log.InfoContext(ctx, "amqpidem: shut down", "queue", queue, "ended", "deadline passed, handlers cancelled", "error", err)
}

// ErrNotReady is what Ready returns, wrapped with the reason, when the
// Consumer cannot take work now.
var ErrNotReady = errors.New("amqpidem: not ready")

// Ready reports whether c can take work now: a session with the broker is
// consuming Queue, and the store answers. The store is pinged within ctx
// when it has a Ping(context.Context) error method (lock's stores and
// pgstore's do); a store without one is taken to answer. Ready returns nil
// or an error wrapping ErrNotReady that says which does not hold; serve it
// as a readiness check (a Consumer that is reconnecting is alive but not
// ready). It is cheap: one store round trip.
func (c *Consumer) Ready(ctx context.Context) error {
	switch {
	case c.isStopping():
		return fmt.Errorf("%w: consumer of %q stopping", ErrNotReady, c.cfg.Queue)
	case !c.consuming.Load():
		return fmt.Errorf("%w: not consuming %q (not started, or reconnecting to the broker)", ErrNotReady, c.cfg.Queue)
	}
	if s, ok := c.proc.given.(interface{ Ping(context.Context) error }); ok {
		if err := s.Ping(ctx); err != nil {
			return fmt.Errorf("%w: store: %w", ErrNotReady, err)
		}
	}
	return nil
}
