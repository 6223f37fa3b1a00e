package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

// settleTimeout bounds the store and broker calls that settle a delivery
// after its handler returned, even when the caller's context is done.
const settleTimeout = 10 * time.Second

// broker is what the processor needs from RabbitMQ besides the delivery's
// own ack: confirmed publishes of copies. *publisher is the real one.
type broker interface {
	// publish publishes a staged message, sharing a channel with other
	// publishes in flight (see publisher).
	publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error
	// publishAlone publishes one of the consumer's own messages (a dead
	// letter, a reply) alone on its channel (see publisher.publishAlone).
	publishAlone(ctx context.Context, exchange, key string, msg amqp.Publishing) error
	declare(ctx context.Context, name string, args amqp.Table, refresh bool) error
	forget(name string)
	// requeue publishes msg, a copy of a delivery, to come back to queue
	// after delay (through a delay queue), or at once when delay is zero.
	requeue(ctx context.Context, queue string, msg amqp.Publishing, delay time.Duration) error
}

// processor maps one delivery to a store transition and a broker action.
// It is shared by Wrapper and Consumer; safe for concurrent use. Each
// delivery's way through it is a flight (flight.go).
type processor struct {
	cfg     Config
	store   lock.Store // given, wrapped to report its calls to a StoreObserver
	given   lock.Store // the store as NewConsumer or Wrap was given it
	keeper  *heartbeat.Keeper
	handler Handler
	// taker is handler when it takes its leases itself (LeaseTaker).
	taker LeaseTaker
	// batch, for a batch consumer (NewBatchConsumer), gathers the
	// deliveries to run into batches; handler then runs a message without
	// a lease as a batch of one.
	batch *batcher
	// userKey is set when Config.Key is the user's: it is called under
	// recover (the default, MessageID, cannot panic).
	userKey bool
	// amender amends records (the outbox's states), through store; nil
	// when the given store cannot.
	amender lock.Amender
	// valueLimit is the most bytes the store keeps in one record's value;
	// outboxBytes, what staged messages may take of it.
	valueLimit, outboxBytes int
	// shortRetention is set once a lease whose retention is too short for
	// its TTL was reported (checkRetention).
	shortRetention *atomic.Bool

	// gate, when set, bounds the deliveries being decided or run at once
	// (a Consumer's Concurrency) and lets them in in delivery order. A
	// delivery takes a slot before its lease, so that at most Concurrency
	// leases whose handler has not finished are held (and attempts
	// counted) at once, and gives it back as soon as it needs it no more:
	// right after Acquire when there is nothing to run, right after the
	// handler otherwise, so that the store and broker calls that settle it
	// do not hold a slot (its lease is held until its outcome is stored).
	gate *gate
	// stopping, when closed, sends deliveries still waiting for a slot
	// back to their queue unprocessed.
	stopping <-chan struct{}
	// wake, when closed, ends the in-process waits of requeue delays (a
	// Wrapper's Shutdown; a Consumer's stopping does it for a Consumer).
	wake <-chan struct{}
}

// newProcessor checks the configuration and starts a keeper.
func newProcessor(store lock.Store, cfg Config, h Handler) (processor, error) {
	if store == nil {
		return processor{}, errors.New("amqpidem: nil store")
	}
	if h == nil {
		return processor{}, errors.New("amqpidem: nil handler")
	}
	if err := cfg.Validate(); err != nil {
		return processor{}, err
	}
	if c, ok := h.(Completer); ok && !sameStore(c.CompleterStore(), store) {
		return processor{}, errors.New("amqpidem: the handler completes records in another store than the one given (a Completer's CompleterStore must be the Consumer's or Wrapper's store)")
	}
	userKey := cfg.Key != nil
	cfg = cfg.withDefaults()
	limit, known := lock.DefaultMaxResultSize, false
	if s, ok := store.(interface{ MaxResultSize() int }); ok {
		limit, known = s.MaxResultSize(), true
	}
	switch {
	case cfg.MaxResultSize == 0 && limit <= ResultOverhead:
		return processor{}, fmt.Errorf("amqpidem: the store keeps results of at most %d bytes, not even the %d bytes amqpidem adds", limit, ResultOverhead)
	case cfg.MaxResultSize == 0:
		cfg.MaxResultSize = limit - ResultOverhead
	case known && cfg.MaxResultSize > limit-ResultOverhead:
		// Complete would refuse such a result after the handler ran.
		return processor{}, fmt.Errorf("amqpidem: Config.MaxResultSize %d is above what the store keeps: %d bytes less the %d amqpidem adds (ResultOverhead)",
			cfg.MaxResultSize, limit, ResultOverhead)
	}
	given := store
	if o, ok := cfg.Observer.(StoreObserver); ok && wantsStore(o) {
		store = &observedStore{Store: store, queue: cfg.Queue, obs: o, log: cfg.Logger}
	}
	var amender lock.Amender
	if _, ok := given.(lock.Amender); ok {
		amender, _ = store.(lock.Amender) // an observedStore forwards it
	}
	keeper, err := heartbeat.New(store, heartbeat.Config{SafetyMargin: cfg.SafetyMargin, Logger: cfg.Logger})
	if err != nil {
		return processor{}, err
	}
	taker, _ := h.(LeaseTaker)
	return processor{cfg: cfg, store: store, given: given, keeper: keeper, handler: h, taker: taker, userKey: userKey,
		amender: amender, valueLimit: limit, outboxBytes: outboxLimit(limit, cfg.MaxStaged), shortRetention: new(atomic.Bool)}, nil
}

// checkRetention logs an error, the first time, when l, a lease under
// which messages were staged, has a retention shorter than minRetention
// of its TTL: its record may expire before a copy that waited for the
// claim on those messages comes back, and a copy after a crash would run
// the handler again. Validate refuses it when Config sets both; otherwise
// one of them is the store's.
func (p *processor) checkRetention(ctx context.Context, l lock.Lease) {
	if l.Retention <= 0 || l.Retention >= minRetention(l.TTL) || p.shortRetention.Swap(true) {
		return
	}
	p.cfg.Logger.ErrorContext(ctx, "amqpidem: retention too short for the lease TTL: a record whose handler staged messages may expire "+
		"before a copy may publish them, and a copy after a crash then runs the handler again; "+
		"make Retention at least twice the lease TTL and a second (Config.Retention, Config.LeaseTTL, or the store's configuration)",
		"queue", p.cfg.Queue, "retention", l.Retention, "lease_ttl", l.TTL)
}

// acquire takes the lease of d for req: from the handler when it is a
// LeaseTaker (reported to a StoreObserver as the store's acquire), else
// from the store (batchesLeases: acquireBatched instead). A panic of either is an error wrapping a *PanicError.
func (p *processor) acquire(ctx context.Context, req lock.Request, d *amqp.Delivery) (res lock.Result, err error) {
	if p.taker == nil {
		defer recoverAcquire(&res, &err, "the store's Acquire")
		return p.store.Acquire(ctx, req)
	}
	start := time.Now()
	func() {
		defer recoverAcquire(&res, &err, "LeaseTaker.AcquireLease")
		res, err = p.taker.AcquireLease(ctx, req, d)
	}()
	if o, ok := p.store.(*observedStore); ok {
		o.taken(ctx, start, err)
	}
	return res, err
}

// batchesLeases reports whether p takes leases in batches
// (acquireBatched): a batch consumer or Wrapper with a store that is a
// lock.BatchAcquirer or a handler that is a BatchLeaseTaker, and no
// LeaseTaker.
func (p *processor) batchesLeases() bool {
	return p.taker == nil && p.batch != nil && (p.batch.ba != nil || p.batch.bt != nil)
}

// recoverAcquire turns a panic of what, the call that takes a lease, into
// an error wrapping a *PanicError in *err (and no answer in *res).
func recoverAcquire(res *lock.Result, err *error, what string) {
	if v := recover(); v != nil {
		*res = lock.Result{}
		*err = fmt.Errorf("amqpidem: %s panicked: %w", what, &PanicError{Value: v, Stack: debug.Stack()})
	}
}

// sameStore reports whether a and b are the same store. Stores of a type
// that cannot be compared (a struct holding a map, say) are never the same,
// rather than a panic.
func sameStore(a, b lock.Store) (same bool) {
	defer func() {
		if recover() != nil {
			same = false
		}
	}()
	return a == b
}

// process runs the whole decision for d and settles it: ack, delayed
// requeue, dead letter, or, when ctx ends first, a copy straight back to
// the queue so that it is delivered again. t is d's ticket of p.gate (nil
// without a gate). It returns what happened, once it was logged and
// reported.
func (p *processor) process(ctx context.Context, b broker, d *amqp.Delivery, t *ticket) Event {
	return p.fly(p.newFlight(), ctx, nil, b, d, t)
}

// fly is process with the flight f, a zero flight of the caller's (a
// Consumer's is part of the delivery's job: one allocation for both), and
// calm, when not nil, context.WithoutCancel(ctx) made once for many
// deliveries (a Consumer's session): the context of the calls that settle
// the delivery (see flight.calmCtx).
func (p *processor) fly(f *flight, ctx, calm context.Context, b broker, d *amqp.Delivery, t *ticket) Event {
	start := time.Now()
	f.p, f.b, f.d = p, b, d
	f.h = arrivalHeaders(d.Headers, p.cfg.MaxAttempts)
	f.ev.Queue, f.ev.Consumer = p.cfg.Queue, p.cfg.ConsumerName
	f.ev.Published = publishedAt(d, &f.h)
	f.ctx = p.startTrace(ctx, d)
	if p.cfg.Tracer == nil {
		f.calm = calm // f.ctx is ctx
	}
	f.arrive(t)
	f.stopKeep() // whatever a step left running,
	f.freeSlot() // or held
	f.ev.Total = time.Since(start)
	p.report(f.ctx, &f.ev)
	return f.ev
}

// isStopping reports whether the consumer began stopping (never, without
// a gate).
func (p *processor) isStopping() bool {
	select {
	case <-p.stopping:
		return true
	default:
		return false
	}
}

// key returns d's idempotency key, checked against what the store takes.
// A KeyFunc that panics, or a key too long for the store, is ErrInvalidKey:
// such a message is never run unkeyed, whatever MissingKey says.
func (p *processor) key(d *amqp.Delivery) (string, error) {
	var key string
	var err error
	if p.userKey {
		key, err = p.callKey(d)
	} else {
		key, err = MessageID(d)
	}
	switch limit := lock.MaxKeyLen - len(p.cfg.Endpoint) - 1; {
	case err != nil:
		return "", err
	case key == "":
		return "", fmt.Errorf("%w: the key function returned an empty key", ErrNoKey)
	case len(key) > limit:
		return "", fmt.Errorf("%w: key is %d bytes, at most %d allowed", ErrInvalidKey, len(key), limit)
	}
	return key, nil
}

// callKey calls the user's KeyFunc, turning a panic into ErrInvalidKey.
func (p *processor) callKey(d *amqp.Delivery) (key string, err error) {
	defer func() {
		if v := recover(); v != nil {
			key, err = "", fmt.Errorf("%w: the key function panicked: %v", ErrInvalidKey, v)
		}
	}()
	return p.cfg.Key(d)
}

// fingerprint is what the payload check compares for d (see
// Config.Fingerprint); empty for no check. A Fingerprint that panics is
// ErrInvalidKey, as a KeyFunc's panic is: the message cannot be checked,
// and a panic would take down every consumer that takes it.
func (p *processor) fingerprint(d *amqp.Delivery) (fp string, err error) {
	switch {
	case p.cfg.SkipFingerprint:
		return "", nil
	case p.cfg.Fingerprint == nil:
		return fingerprint(d.Body), nil
	}
	defer func() {
		if v := recover(); v != nil {
			fp, err = "", fmt.Errorf("%w: the fingerprint function panicked: %v", ErrInvalidKey, v)
		}
	}()
	if b := p.cfg.Fingerprint(d); b != nil {
		return fingerprint(b), nil
	}
	return "", nil
}

// retryDelay is the delay before the retry of delivery dl, whose execution
// n failed with err: a RetryAfterError's, else Config.RetryDelay's, else
// Config.Backoff's (see Config.retryDelay); ok is false for no more
// retries. A RetryDelay or Backoff that panics is logged at error level
// and retries after UnavailableDelay: MaxAttempts still ends the retries.
func (p *processor) retryDelay(ctx context.Context, n int, err error, dl *amqp.Delivery) (d time.Duration, ok bool) {
	if d, ok := retryAfter(err); ok {
		return d, true
	}
	defer func() {
		if v := recover(); v != nil {
			p.cfg.Logger.ErrorContext(ctx, "amqpidem: Config.RetryDelay or Backoff panicked; retrying after UnavailableDelay",
				"queue", p.cfg.Queue, "panic", v, "stack", string(debug.Stack()))
			d, ok = p.cfg.UnavailableDelay, true
		}
	}()
	if p.cfg.RetryDelay != nil {
		d = p.cfg.RetryDelay(n, err, dl)
		return max(d, 0), d >= 0
	}
	return p.cfg.retryDelay(n)
}

// busyDelay is how long a duplicate waits while another consumer holds
// its key, whose lease has remaining left by the store's clock, when the
// duplicate has waited so busy times before (HeaderBusy): until a little
// after that lease would expire, but no longer than MinInProgressDelay
// doubled busy times, so that a duplicate right behind work about to
// finish looks again soon, and one behind a long job ever less often;
// within [MinInProgressDelay, InProgressDelay].
func (p *processor) busyDelay(remaining time.Duration, busy int) time.Duration {
	step := MinInProgressDelay << min(max(busy, 0), maxBusyDoublings)
	return min(max(min(remaining+remaining/10, step), MinInProgressDelay), max(p.cfg.InProgressDelay, MinInProgressDelay))
}

// maxBusyDoublings bounds busyDelay's doublings: 250ms·2^8 is 64s, past
// any InProgressDelay worth its name.
const maxBusyDoublings = 8

// settleContext is for the calls that settle a delivery: they must run
// even when ctx was cancelled (shutdown), within settleTimeout.
func settleContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
}

// calmContext is settleContext for calm, a context that is never
// cancelled already (flight.calmCtx): it spares the allocation of
// another context.WithoutCancel.
func calmContext(calm context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(calm, settleTimeout)
}
