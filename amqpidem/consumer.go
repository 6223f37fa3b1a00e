package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"sync"
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
	// Required unless Dial is set.
	URL string
	// Dial opens a connection; it overrides URL (for TLS or custom
	// amqp.Config).
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
	Concurrency int
	// QueueArgs are the arguments the default declaration gives the queue,
	// e.g. amqp.Table{"x-queue-type": "quorum"}. Ignored when Declare is set.
	QueueArgs amqp.Table
	// Declare declares the topology on every (re)connection, before
	// consuming. Default: declare Queue durable with QueueArgs.
	Declare func(ch *amqp.Channel) error
	// Reconnect makes the backoff between reconnection attempts; a
	// backoff.Stop ends Run with the last error. Default: exponential,
	// 100 ms to 10 s, forever.
	Reconnect func() backoff.BackOff
	// ConsumerTag names the AMQP consumer. Default: "amqpidem.", the
	// consumer name and a random suffix.
	ConsumerTag string
}

func (c ConsumerConfig) validate() error {
	switch {
	case c.URL == "" && c.Dial == nil:
		return errors.New("amqpidem: ConsumerConfig.URL is required (or Dial)")
	case c.Prefetch < 0:
		return fmt.Errorf("amqpidem: ConsumerConfig.Prefetch %d must not be negative", c.Prefetch)
	case c.Concurrency < 0:
		return fmt.Errorf("amqpidem: ConsumerConfig.Concurrency %d must not be negative", c.Concurrency)
	}
	return c.Config.Validate()
}

func (c ConsumerConfig) withDefaults() ConsumerConfig {
	if c.Dial == nil {
		url := c.URL
		c.Dial = func() (*amqp.Connection, error) { return amqp.Dial(url) }
	}
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
// Consumer is safe for concurrent use; Run once, Shutdown any number of
// times.
type Consumer struct {
	cfg  ConsumerConfig
	proc processor

	base     context.Context // handlers' parent; cancelled to force them to stop
	cancel   context.CancelFunc
	stopping chan struct{}
	stopOnce sync.Once
	done     chan struct{}
	running  chan struct{} // closed when Run starts
	runOnce  sync.Once
}

// NewConsumer returns a Consumer running h on cfg.Queue with store. It makes
// no network call; Run connects.
func NewConsumer(store lock.Store, cfg ConsumerConfig, h Handler) (*Consumer, error) {
	if err := cfg.validate(); err != nil {
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
	cfg = cfg.withDefaults()
	stopping := make(chan struct{})
	proc.gate, proc.stopping = newGate(cfg.Concurrency), stopping
	base, cancel := context.WithCancel(context.Background())
	c := &Consumer{
		cfg: cfg, proc: proc, base: base, cancel: cancel,
		stopping: stopping, done: make(chan struct{}), running: make(chan struct{}),
	}
	cleanUpWhenUnreachable(c, proc.keeper, nil) // Run closes its sessions' publishers
	return c, nil
}

// Run consumes until Shutdown is called or ctx is done, reconnecting after
// failures. It returns ErrConsumerClosed after Shutdown, ctx.Err() when ctx
// ends (in-flight handlers are cancelled and their messages go back to the
// queue, as with Shutdown), or the last connection error when Reconnect
// says stop. Run may be called once.
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

	bo := c.cfg.Reconnect()
	for {
		err := c.session(ctx)
		if c.isStopping() {
			return ErrConsumerClosed
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			return err
		}
		c.proc.cfg.Logger.WarnContext(ctx, "amqpidem: connection lost; reconnecting",
			"queue", c.cfg.Queue, "error", err, "wait", wait)
		if errors.Is(err, errConsumed) {
			bo.Reset() // it worked for a while: start the backoff over
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-c.stopping:
			t.Stop()
			return ErrConsumerClosed
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
}

// errConsumed marks a session that consumed before it ended.
var errConsumed = errors.New("amqpidem: session ended")

// session runs one connection: it returns when the connection or channel
// closes, or when the consumer stops. Deliveries in flight are waited for
// before it returns, so that the next session starts clean.
func (c *Consumer) session(ctx context.Context) error {
	conn, err := c.cfg.Dial()
	if err != nil {
		return fmt.Errorf("amqpidem: dial: %w", err)
	}
	defer conn.Close()
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))

	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("amqpidem: open channel: %w", err)
	}
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return fmt.Errorf("amqpidem: qos: %w", err)
	}
	if err := c.cfg.Declare(ch); err != nil {
		return fmt.Errorf("amqpidem: declare: %w", err)
	}
	deliveries, err := ch.Consume(c.cfg.Queue, c.cfg.ConsumerTag, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("amqpidem: consume %q: %w", c.cfg.Queue, err)
	}
	pub := newPublisher(conn, c.cfg.QueueType)
	defer pub.close()
	c.proc.cfg.Logger.InfoContext(ctx, "amqpidem: consuming", "queue", c.cfg.Queue,
		"prefetch", c.cfg.Prefetch, "concurrency", c.cfg.Concurrency)

	// Acks go through acks, which folds them into multiple acks on this
	// channel; what it holds is sent once the handlers are done.
	acks := newAcker(ch)
	defer acks.flush()
	// Every delivery goes to a worker at once; the processor's gate lets
	// Concurrency of them in at a time, in delivery order. Workers
	// are started as needed, at most Prefetch of them (the broker sends
	// no more unacked deliveries than that), and live as long as the
	// session: a fresh goroutine per delivery would grow its stack anew
	// each time, a cost that showed in make bench's CPU profile.
	type job struct {
		d *amqp.Delivery
		t *ticket
	}
	work := make(chan job)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(work)
	workers := 0
	dispatch := func(j job) {
		select {
		case work <- j:
			return
		default:
		}
		if workers == c.cfg.Prefetch {
			work <- j
			return
		}
		workers++
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.proc.process(c.base, pub, j.d, j.t)
			for j := range work {
				c.proc.process(c.base, pub, j.d, j.t)
			}
		}()
	}
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return c.closedErr(connClosed, chClosed)
			}
			d.Acknowledger = acks
			if c.isStopping() {
				c.giveBack(pub, &d)
				c.drain(ch, acks, pub, deliveries)
				return nil
			}
			dispatch(job{&d, c.proc.gate.enter()}) // tickets in delivery order
		case <-c.stopping:
			c.drain(ch, acks, pub, deliveries)
			return nil
		case <-ctx.Done():
			c.drain(ch, acks, pub, deliveries)
			return ctx.Err()
		}
	}
}

// closedErr explains why the deliveries channel closed.
func (c *Consumer) closedErr(connClosed, chClosed <-chan *amqp.Error) error {
	for _, n := range []<-chan *amqp.Error{chClosed, connClosed} {
		select {
		case e, ok := <-n:
			if ok && e != nil {
				return fmt.Errorf("%w: %v", errConsumed, e)
			}
		default:
		}
	}
	return fmt.Errorf("%w: deliveries closed", errConsumed)
}

// drain cancels the AMQP consumer and hands back, unprocessed, the
// deliveries that were already on their way.
func (c *Consumer) drain(ch *amqp.Channel, acks *acker, pub *publisher, deliveries <-chan amqp.Delivery) {
	_ = ch.Cancel(c.cfg.ConsumerTag, false)
	timeout := time.NewTimer(5 * time.Second)
	defer timeout.Stop()
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return
			}
			d.Acknowledger = acks
			c.giveBack(pub, &d)
		case <-timeout.C:
			return // closing the channel returns the rest to the queue
		}
	}
}

// giveBack returns a delivery that was never processed to its queue: a
// copy, then an ack, so that a quorum queue does not count the return
// against its delivery limit; a nack with requeue if the copy fails.
func (c *Consumer) giveBack(pub *publisher, d *amqp.Delivery) {
	ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
	defer cancel()
	if err := pub.requeue(ctx, c.cfg.Queue, d, 0, amqp.Table{HeaderReason: "shutdown"}); err != nil {
		_ = d.Nack(false, true)
		return
	}
	_ = d.Ack(false)
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
// started back to the queue, lets the handlers in flight finish until ctx
// is done, then cancels the rest: their messages go back to the queue (a
// confirmed copy, then an ack; a nack with requeue only if the copy fails)
// and their leases are released. It then stops the
// keeper and returns ctx.Err() if handlers had to be cancelled. A handler
// that ignores its context delays Shutdown until it returns. Shutdown is
// idempotent and may be called before, during or after Run.
func (c *Consumer) Shutdown(ctx context.Context) error {
	c.stopOnce.Do(func() { close(c.stopping) })
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
	return errors.Join(err, c.proc.keeper.Shutdown(kctx))
}
