package amqpidem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
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
	publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error
	declare(ctx context.Context, name string, args amqp.Table, refresh bool) error
	forget(name string)
	requeue(ctx context.Context, queue string, d *amqp.Delivery, delay time.Duration, extra amqp.Table) error
}

// processor maps one delivery to a store transition and a broker action.
// It is shared by Wrapper and Consumer; safe for concurrent use.
type processor struct {
	cfg     Config
	store   lock.Store // given, wrapped to report its calls to a StoreObserver
	given   lock.Store // the store as NewConsumer or Wrap was given it
	keeper  *heartbeat.Keeper
	handler Handler

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

// slot is a delivery's hold on one of the gate's slots; nil without a gate.
type slot struct {
	g    *gate
	held bool
}

// free gives the slot back, once; a no-op on nil.
func (s *slot) free() {
	if s != nil && s.held {
		s.held = false
		s.g.release()
	}
}

// errNotStarted is the cause given when a delivery goes back to its queue
// before its handler started.
var errNotStarted = errors.New("amqpidem: consumer stopping before the handler started")

// process runs the whole decision for d and settles it: ack, delayed
// requeue, dead letter, or, when ctx ends first, a copy straight back to
// the queue so that it is delivered again. t is d's ticket of p.gate (nil
// without a gate). It returns what happened.
func (p *processor) process(ctx context.Context, b broker, d *amqp.Delivery, t *ticket) (ev Event) {
	start := time.Now()
	ev.Queue, ev.Consumer = p.cfg.Queue, p.cfg.ConsumerName
	ev.Published = publishedAt(d)
	ctx = p.startTrace(ctx, d)
	defer func() {
		ev.Total = time.Since(start)
		p.report(ctx, ev)
	}()

	key, err := p.key(d)
	if err == nil {
		ev.Key = key
	}

	var sl *slot
	if t != nil {
		if !p.gate.wait(ctx, p.stopping, t) {
			// Stopping before this delivery's turn: back to the queue,
			// no lease taken, nothing run.
			p.requeue(ctx, b, d, &ev, Abandoned, "shutdown", 0, cmp.Or(ctx.Err(), errNotStarted))
			return ev
		}
		sl = &slot{g: p.gate, held: true}
		defer sl.free()
	}

	if err != nil {
		if errors.Is(err, ErrNoKey) && p.cfg.MissingKey == ProcessMissingKey {
			if expired(d, time.Now()) {
				p.deadLetterExpired(ctx, b, d, &ev, sl)
				return ev
			}
			p.runUnkeyed(ctx, b, d, &ev, "no key", sl)
			return ev
		}
		sl.free()
		reason := "missing key"
		if errors.Is(err, ErrInvalidKey) {
			reason = "invalid key"
		}
		p.deadLetter(ctx, b, d, &ev, reason, err)
		return ev
	}

	req := lock.Request{Key: StoreKey(p.cfg.Endpoint, key), TTL: p.cfg.LeaseTTL, Retention: p.cfg.Retention}
	req.Fingerprint = p.fingerprint(d)
	res, err := p.store.Acquire(ctx, req)
	if err != nil {
		if p.cfg.FailOpen && ctx.Err() == nil && errors.Is(err, lock.ErrUnavailable) {
			p.runUnkeyed(ctx, b, d, &ev, "store unavailable, failing open", sl)
			return ev
		}
		sl.free()
		switch {
		case errors.Is(err, lock.ErrInvalidKey):
			p.deadLetter(ctx, b, d, &ev, "invalid key", err)
		case ctx.Err() != nil:
			p.requeue(ctx, b, d, &ev, Abandoned, "shutdown", 0, err)
		case errors.Is(err, lock.ErrBadRecord) || errors.Is(err, lock.ErrKeyCollision):
			p.recordFault(ctx, b, d, &ev, err)
		default:
			p.requeue(ctx, b, d, &ev, Abandoned, "store unavailable", p.cfg.UnavailableDelay, err)
		}
		return ev
	}
	ev.Attempt, ev.Fence = max(res.Attempts, p.headerAttempt(d)), res.Fence
	if res.Status != lock.Acquired {
		sl.free() // nothing to run: later deliveries go on
	}

	switch res.Status {
	case lock.Completed:
		result, replyOK := decodeResult(res.Value, d.ReplyTo)
		if d.ReplyTo != "" && !replyOK {
			// The result was made for another ReplyTo, or none: a
			// duplicate does not get to choose where it goes.
			ev.Reason = "reply not re-sent"
			ev.Err = fmt.Errorf("amqpidem: stored reply not re-sent to %q: the result was not made for that reply-to", d.ReplyTo)
		} else if err := p.reply(ctx, b, d, result, &ev); err != nil {
			p.replyFailed(ctx, b, d, &ev, Duplicate, err)
			return ev
		}
		p.ack(d, &ev, Duplicate)
	case lock.Failed:
		failed := errors.New(res.Error)
		pending := d.Headers[HeaderDeadLetterPending] != nil
		if p.cfg.FailedDuplicate == AckFailedDuplicate && !pending && !d.Redelivered {
			ev.Reason, ev.Err = "failed duplicate", failed
			p.ack(d, &ev, Dropped)
			return ev
		}
		// A redelivered copy may be the first one, whose dead letter was
		// never confirmed; a pending one surely is: dead-letter it rather
		// than risk losing it. The header only ever sends a message to the
		// dead-letter queue that the record says failed; the reason comes
		// from the record, not from the header.
		reason := "failed duplicate"
		if pending {
			reason = storedReason(res.Error)
		}
		p.deadLetter(ctx, b, d, &ev, reason, failed)
	case lock.InProgress:
		p.requeue(ctx, b, d, &ev, Busy, "in progress elsewhere", p.busyDelay(res.Remaining), nil)
	case lock.Conflict:
		p.deadLetter(ctx, b, d, &ev, "key conflict",
			fmt.Errorf("key %q was first seen with a different payload", key))
	case lock.Acquired:
		if expired(d, time.Now()) {
			// Not run: the attempt its Acquire counted is taken back.
			if p.cancel(ctx, res.Lease) {
				ev.Attempt = max(res.Attempts-1, p.headerAttempt(d))
			}
			p.deadLetterExpired(ctx, b, d, &ev, sl)
			return ev
		}
		if mark, ok := d.Headers[HeaderDeadLetterPending]; ok {
			// A copy whose dead letter is due (its failure may not have
			// been stored, or its dead letter could not be routed) is not
			// run again: the header can only bring a dead letter closer.
			sl.free()
			text, _ := mark.(string)
			reason := storedReason(text)
			if reason == "failed duplicate" {
				reason = "dead letter pending"
			}
			p.fail(ctx, b, d, &ev, res.Lease, reason, fmt.Errorf("dead letter pending: %s", headerText(text)))
			return ev
		}
		p.run(ctx, b, d, &ev, res.Lease, sl)
	default:
		p.requeue(ctx, b, d, &ev, Abandoned, "unexpected store answer", p.cfg.UnavailableDelay,
			fmt.Errorf("status %v", res.Status))
	}
	return ev
}

// deadLetterExpired dead-letters d, whose HeaderExpiresAt has passed
// (expired): its publisher gave it an expiration that requeues have
// outlived. It is not run, and not dropped either. Only a run is stopped
// so: a duplicate of completed work is still acked as one.
func (p *processor) deadLetterExpired(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, sl *slot) {
	sl.free()
	at := time.UnixMilli(int64(headerInt(d.Headers, HeaderExpiresAt))).UTC()
	p.deadLetter(ctx, b, d, ev, "expired", fmt.Errorf("expired at %s (%s)", at.Format(time.RFC3339Nano), HeaderExpiresAt))
}

// key returns d's idempotency key, checked against what the store takes.
// A KeyFunc that panics, or a key too long for the store, is ErrInvalidKey:
// such a message is never run unkeyed, whatever MissingKey says.
func (p *processor) key(d *amqp.Delivery) (key string, err error) {
	defer func() {
		if v := recover(); v != nil {
			key, err = "", fmt.Errorf("%w: the key function panicked: %v", ErrInvalidKey, v)
		}
	}()
	key, err = p.cfg.Key(d)
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

// headerAttempt is the number of executions d's HeaderAttempt claims,
// clamped to [0, MaxAttempts]. A publisher can forge the header, so it may
// only bring a dead letter closer (its executions count with the record's),
// never allow more executions than the record does. A dead letter moved
// back to the queue (it carries HeaderError, which only dead letters do)
// starts afresh: its count is what got it dead-lettered.
func (p *processor) headerAttempt(d *amqp.Delivery) int {
	if d.Headers[HeaderError] != nil {
		return 0
	}
	return min(max(headerInt(d.Headers, HeaderAttempt), 0), p.cfg.MaxAttempts)
}

// recordFault settles a delivery whose key's record cannot be used
// (lock.ErrBadRecord, lock.ErrKeyCollision): it is not run, unkeyed or
// otherwise, since the record may say the work is done. It is requeued
// after UnavailableDelay, counting tries in HeaderAttempt, and dead-lettered
// once MaxAttempts tries were made.
func (p *processor) recordFault(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, err error) {
	ev.Attempt = p.headerAttempt(d) + 1
	if ev.Attempt >= p.cfg.MaxAttempts {
		p.deadLetter(ctx, b, d, ev, "record unusable", err)
		return
	}
	p.requeue(ctx, b, d, ev, Abandoned, "record unusable", p.cfg.UnavailableDelay, err)
}

// run executes the handler under a kept lease and records its outcome.
func (p *processor) run(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, lease lock.Lease, sl *slot) {
	// The attempt is the record's, or the message's own count when that is
	// higher: a record lost (expired, evicted, forgotten by a restart)
	// restarts its count, the message's copies do not.
	attempt := max(lease.Attempt, p.headerAttempt(d)+1)
	ev.Attempt = attempt
	if attempt > p.cfg.MaxAttempts {
		sl.free()
		p.fail(ctx, b, d, ev, lease, "attempts exhausted",
			fmt.Errorf("%d executions started, at most %d allowed (earlier ones crashed or lost their lease)", attempt-1, p.cfg.MaxAttempts))
		return
	}

	hctx, stop := p.keeper.Keep(ctx, lease)
	defer stop()
	if stopping := p.isStopping(); stopping || hctx.Err() != nil {
		// Shut down, or the lease already lost, before the handler
		// started: this attempt never ran, so it is taken back.
		cause := context.Cause(hctx)
		stop()
		sl.free()
		if p.cancel(ctx, lease) {
			ev.Attempt = attempt - 1
		}
		if stopping || ctx.Err() != nil {
			p.requeue(ctx, b, d, ev, Abandoned, "shutdown", 0, cmp.Or(cause, errNotStarted))
			return
		}
		p.requeue(ctx, b, d, ev, Abandoned, "lease lost", MinInProgressDelay, cause)
		return
	}
	if p.cfg.HandlerTimeout > 0 {
		var cancel context.CancelFunc
		hctx, cancel = context.WithTimeoutCause(hctx, p.cfg.HandlerTimeout, ErrHandlerTimeout)
		defer cancel()
	}
	hctx = withInfo(hctx, Info{Queue: p.cfg.Queue, Key: ev.Key, Attempt: attempt, Fence: lease.Fence})
	if c, ok := p.handler.(Completer); ok {
		p.runCompleter(ctx, hctx, b, d, ev, c, lease, attempt, sl, stop)
		return
	}
	result, err := p.callHandler(hctx, ev, d)
	sl.free()

	if err == nil && len(result) > p.cfg.MaxResultSize {
		stop()
		p.fail(ctx, b, d, ev, lease, "result too large",
			fmt.Errorf("%w: %d bytes, at most %d allowed", lock.ErrResultTooLarge, len(result), p.cfg.MaxResultSize))
		return
	}
	if err == nil {
		// Complete is compare-and-set on owner and fence: if the lease was
		// lost, it fails and the result is discarded. If the keeper only
		// could not confirm the lease but nobody took it over, the result
		// is still the only one and is kept.
		if err := p.complete(ctx, lease, encodeResult(d.ReplyTo, result)); err != nil {
			if errors.Is(err, lock.ErrResultTooLarge) {
				// Terminal: storing it again cannot work, and a requeue
				// would run the handler again once the lease expired.
				stop()
				p.fail(ctx, b, d, ev, lease, "result too large", err)
				return
			}
			// The lease is held until it expires (store unavailable) or
			// by someone else (lost): its next delivery waits for it as a
			// busy duplicate.
			reason, delay := "store unavailable", p.cfg.UnavailableDelay
			if errors.Is(err, lock.ErrLeaseLost) {
				reason, delay = "lease lost", MinInProgressDelay
			}
			stop() // renewing it would only delay its expiry
			p.requeue(ctx, b, d, ev, Abandoned, reason, delay, err)
			return
		}
		stop()
		if err := p.reply(ctx, b, d, result, ev); err != nil {
			// The result is stored: the redelivery is a duplicate and
			// sends the stored reply.
			p.replyFailed(ctx, b, d, ev, Completed, err)
			return
		}
		p.ack(d, ev, Completed)
		return
	}
	p.handlerFailed(ctx, hctx, b, d, ev, lease, attempt, stop, err)
}

// runCompleter is run's second half for a Completer, which completes the
// record itself, in the transaction of its effects: it runs c and settles
// d.
func (p *processor) runCompleter(ctx, hctx context.Context, b broker, d *amqp.Delivery, ev *Event, c Completer, lease lock.Lease, attempt int, sl *slot, stop func()) {
	var valued, tooLarge bool // value was called; it refused the result
	value := func(result []byte) ([]byte, error) {
		valued = true
		if len(result) > p.cfg.MaxResultSize {
			tooLarge = true
			return nil, fmt.Errorf("%w: %d bytes, at most %d allowed", lock.ErrResultTooLarge, len(result), p.cfg.MaxResultSize)
		}
		return encodeResult(d.ReplyTo, result), nil
	}
	result, err := p.timeHandler(hctx, ev, func() ([]byte, error) {
		return recovered(func() ([]byte, error) { return c.HandleComplete(hctx, handlerDelivery(d), lease, value) })
	})
	sl.free()
	switch {
	case err == nil:
		stop()
		if err := p.reply(ctx, b, d, result, ev); err != nil {
			p.replyFailed(ctx, b, d, ev, Completed, err)
			return
		}
		p.ack(d, ev, Completed)
	case tooLarge && !IsPermanent(err):
		stop()
		p.fail(ctx, b, d, ev, lease, "result too large", err)
	case valued && errors.Is(err, lock.ErrLeaseLost):
		// The completion found another owner: everything rolled back, and
		// the record decides the next delivery.
		stop()
		p.requeue(ctx, b, d, ev, Abandoned, "lease lost", MinInProgressDelay, err)
	case errors.Is(err, lock.ErrUnavailable) && !IsPermanent(err):
		// Not committed, or committed with the answer lost. In the second
		// case the record is completed and refuses the release, and the
		// redelivery is acked as a duplicate.
		stop()
		p.release(ctx, lease)
		p.requeue(ctx, b, d, ev, Abandoned, "store unavailable", p.cfg.UnavailableDelay, err)
	default:
		p.handlerFailed(ctx, hctx, b, d, ev, lease, attempt, stop, err)
	}
}

// handlerFailed settles d after its handler returned err: lease lost or
// shutdown, a stale fence, a retry with backoff, or a terminal failure.
func (p *processor) handlerFailed(ctx, hctx context.Context, b broker, d *amqp.Delivery, ev *Event, lease lock.Lease, attempt int, stop func(), err error) {
	timedOut := errors.Is(context.Cause(hctx), ErrHandlerTimeout)
	if hctx.Err() != nil && !IsPermanent(err) && !timedOut {
		// The handler was stopped (lease lost or unconfirmed, shutdown):
		// its failure says nothing about the message.
		cause := context.Cause(hctx)
		stop()
		p.release(ctx, lease)
		if ctx.Err() != nil {
			p.requeue(ctx, b, d, ev, Abandoned, "shutdown", 0, cause)
			return
		}
		p.requeue(ctx, b, d, ev, Abandoned, "lease lost", MinInProgressDelay, cause)
		return
	}
	if errors.Is(err, ErrStale) && !IsPermanent(err) {
		// The handler's own store saw a newer fence: another execution
		// of this key got further. This one is no attempt; the record
		// decides the next delivery (a duplicate once that execution
		// completed, busy while it runs).
		stop()
		if p.cancel(ctx, lease) {
			ev.Attempt = attempt - 1
		}
		p.requeue(ctx, b, d, ev, Abandoned, "stale fence", MinInProgressDelay, err)
		return
	}

	reason := "handler error"
	if timedOut {
		reason = "handler timeout"
		err = fmt.Errorf("%w after %v: %w", ErrHandlerTimeout, p.cfg.HandlerTimeout, err)
	}
	if !IsPermanent(err) && attempt < p.cfg.MaxAttempts {
		if delay, ok := p.cfg.retryDelay(attempt); ok {
			stop()
			p.release(ctx, lease)
			p.requeue(ctx, b, d, ev, Retried, reason, delay, err)
			return
		}
	}
	reason = "permanent failure"
	if !IsPermanent(err) {
		reason = "attempts exhausted"
	}
	stop()
	p.fail(ctx, b, d, ev, lease, reason, err)
}

// fingerprint is what the payload check compares for d (see
// Config.Fingerprint); empty for no check.
func (p *processor) fingerprint(d *amqp.Delivery) string {
	switch {
	case p.cfg.SkipFingerprint:
		return ""
	case p.cfg.Fingerprint == nil:
		return fingerprint(d.Body)
	}
	if b := p.cfg.Fingerprint(d); b != nil {
		return fingerprint(b)
	}
	return ""
}

// busyDelay is how long a duplicate waits while another consumer holds
// its key, whose lease has remaining left by the store's clock: until a
// little after that lease would expire, within [MinInProgressDelay,
// InProgressDelay].
func (p *processor) busyDelay(remaining time.Duration) time.Duration {
	return min(max(remaining+remaining/10, MinInProgressDelay), max(p.cfg.InProgressDelay, MinInProgressDelay))
}

// complete stores the result, even if ctx was cancelled meanwhile (the
// work is done), retrying for up to settleTimeout (see settle).
func (p *processor) complete(ctx context.Context, lease lock.Lease, result []byte) error {
	return settle(ctx, func(ctx context.Context) error { return p.store.Complete(ctx, lease, result) })
}

// settle makes a store call that settles a lease (Complete, Fail) even if
// ctx was cancelled meanwhile, and tries it again for up to settleTimeout
// while it fails with anything but an answer: nil, lock.ErrLeaseLost or
// lock.ErrResultTooLarge.
func settle(ctx context.Context, call func(context.Context) error) error {
	final := func(err error) bool {
		return err == nil || errors.Is(err, lock.ErrLeaseLost) || errors.Is(err, lock.ErrResultTooLarge)
	}
	err := call(context.WithoutCancel(ctx))
	if final(err) {
		return err
	}
	sctx, cancel := settleContext(ctx)
	defer cancel()
	wait := 20 * time.Millisecond
	for {
		select {
		case <-sctx.Done():
			return err
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
		if err = call(sctx); final(err) {
			return err
		}
	}
}

// fail records a terminal failure and dead-letters the message.
func (p *processor) fail(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, lease lock.Lease, reason string, cause error) {
	text := reason + ": " + cause.Error()
	if err := settle(ctx, func(ctx context.Context) error { return p.store.Fail(ctx, lease, text) }); err != nil {
		if errors.Is(err, lock.ErrLeaseLost) {
			// Someone took the key over: its new holder decides.
			p.requeue(ctx, b, d, ev, Abandoned, "lease lost", MinInProgressDelay, errors.Join(cause, err))
			return
		}
		// Fail may have landed with its reply lost. The copy goes back
		// marked pending, so that if the record says failed when it comes
		// back it is dead-lettered, whatever FailedDuplicate says; if Fail
		// did not land, the key runs again once the lease expires.
		p.requeueMarked(ctx, b, d, ev, Abandoned, "store unavailable", p.cfg.InProgressDelay,
			errors.Join(cause, err), reason+": "+cause.Error())
		return
	}
	p.deadLetter(ctx, b, d, ev, reason, cause)
}

// failureReasons are the reasons a record's stored error can start with.
var failureReasons = []string{"permanent failure", "attempts exhausted", "result too large"}

// storedReason is the reason a failed record's error text (or a pending
// mark's text) gives, or "failed duplicate".
func storedReason(text string) string {
	for _, r := range failureReasons {
		if strings.HasPrefix(text, r+": ") {
			return r
		}
	}
	return "failed duplicate"
}

// release gives a lease back so that a retry need not wait for it to
// expire. A failure only delays that retry by up to the lease TTL.
func (p *processor) release(ctx context.Context, lease lock.Lease) {
	sctx, cancel := settleContext(ctx)
	defer cancel()
	if err := p.store.Release(sctx, lease); err != nil && !errors.Is(err, lock.ErrLeaseLost) {
		p.cfg.Logger.WarnContext(ctx, "amqpidem: release failed; the retry waits for the lease to expire",
			"queue", p.cfg.Queue, "key", lease.Key, "fence", lease.Fence, "error", err)
	}
}

// cancel gives back a lease whose handler never started, and the attempt
// it counted; it reports whether it did. A failure only delays the next
// delivery by up to the lease TTL, and that attempt stays counted.
func (p *processor) cancel(ctx context.Context, lease lock.Lease) bool {
	sctx, cancel := settleContext(ctx)
	defer cancel()
	err := p.store.Cancel(sctx, lease)
	if err != nil && !errors.Is(err, lock.ErrLeaseLost) {
		p.cfg.Logger.WarnContext(ctx, "amqpidem: cancel failed; the next delivery waits for the lease to expire",
			"queue", p.cfg.Queue, "key", lease.Key, "fence", lease.Fence, "error", err)
	}
	return err == nil
}

// runUnkeyed runs the handler with no lease and no stored outcome, in sl,
// which it frees when the handler returns.
func (p *processor) runUnkeyed(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, why string, sl *slot) {
	attempt := p.headerAttempt(d) + 1
	ev.Attempt = attempt
	if attempt > p.cfg.MaxAttempts {
		sl.free()
		p.deadLetter(ctx, b, d, ev, "attempts exhausted",
			fmt.Errorf("%d executions started, at most %d allowed", attempt-1, p.cfg.MaxAttempts))
		return
	}
	hctx := withInfo(ctx, Info{Queue: p.cfg.Queue, Attempt: attempt})
	if p.cfg.HandlerTimeout > 0 {
		var cancel context.CancelFunc
		hctx, cancel = context.WithTimeoutCause(hctx, p.cfg.HandlerTimeout, ErrHandlerTimeout)
		defer cancel()
	}
	result, err := p.callHandler(hctx, ev, d)
	sl.free()
	if err == nil {
		if err := p.reply(ctx, b, d, result, ev); err != nil {
			// Nothing stored to send again: a retry would run the
			// handler again, so the reply is lost and logged.
			ev.Err = errors.Join(ev.Err, err)
		}
		ev.Reason = why
		p.ack(d, ev, Completed)
		return
	}
	if ctx.Err() != nil && !IsPermanent(err) {
		p.requeue(ctx, b, d, ev, Abandoned, "shutdown", 0, err)
		return
	}
	reason := "handler error"
	if errors.Is(context.Cause(hctx), ErrHandlerTimeout) {
		reason = "handler timeout"
		err = fmt.Errorf("%w after %v: %w", ErrHandlerTimeout, p.cfg.HandlerTimeout, err)
	}
	if !IsPermanent(err) && attempt < p.cfg.MaxAttempts {
		if delay, ok := p.cfg.retryDelay(attempt); ok {
			p.requeue(ctx, b, d, ev, Retried, reason, delay, err)
			return
		}
	}
	reason = "permanent failure"
	if !IsPermanent(err) {
		reason = "attempts exhausted"
	}
	p.deadLetter(ctx, b, d, ev, reason, err)
}

// requeue publishes a copy of d to come back after delay (at once when
// delay is zero), then acks d. Returning a message this way, rather than
// with a nack, keeps it off a quorum queue's delivery limit. A copy that
// cannot be published never spins: see sendBack.
func (p *processor) requeue(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, o Outcome, reason string, delay time.Duration, cause error) {
	p.requeueMarked(ctx, b, d, ev, o, reason, delay, cause, "")
}

// replyFailed settles d, whose result is stored but whose reply could not
// be sent: requeued after UnavailableDelay so that its redelivery, a
// duplicate, sends the stored reply, at most MaxAttempts times (counted in
// HeaderReplyTries); then the reply is given up, logged, and d acked as
// o, so that the copy does not cycle until its record expires and the
// work runs again.
func (p *processor) replyFailed(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, o Outcome, err error) {
	tries := min(max(headerInt(d.Headers, HeaderReplyTries), 0), p.cfg.MaxAttempts) + 1
	if tries >= p.cfg.MaxAttempts {
		ev.Reason = "reply given up"
		ev.Err = errors.Join(ev.Err, fmt.Errorf("amqpidem: reply to %q not sent after %d tries: %w", d.ReplyTo, tries, err))
		p.cfg.Logger.ErrorContext(ctx, "amqpidem: reply given up; the result stays stored",
			"queue", p.cfg.Queue, "key", ev.Key, "reply_to", d.ReplyTo, "tries", tries, "error", err)
		p.ack(d, ev, o)
		return
	}
	p.requeueWith(ctx, b, d, ev, Abandoned, "reply not sent", p.cfg.UnavailableDelay, err, "", amqp.Table{HeaderReplyTries: int64(tries)})
}

// requeueMarked is requeue with the copy marked HeaderDeadLetterPending
// (pending is the mark's text) when pending is set or d carries the mark.
func (p *processor) requeueMarked(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, o Outcome, reason string, delay time.Duration, cause error, pending string) {
	p.requeueWith(ctx, b, d, ev, o, reason, delay, cause, pending, nil)
}

// requeueWith is requeueMarked with more headers on the copy.
func (p *processor) requeueWith(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, o Outcome, reason string, delay time.Duration, cause error, pending string, more amqp.Table) {
	ev.Reason, ev.Delay = reason, delay
	ev.Err = errors.Join(ev.Err, cause)
	extra := amqp.Table{HeaderAttempt: int64(max(ev.Attempt, p.headerAttempt(d))), HeaderReason: reason}
	for k, v := range more {
		extra[k] = v
	}
	if v, ok := d.Headers[HeaderDeadLetterPending]; ok && pending == "" {
		pending, _ = v.(string)
		pending = cmp.Or(pending, "pending")
	}
	if pending != "" {
		extra[HeaderDeadLetterPending] = headerText(pending)
	}
	p.inject(ctx, extra)
	if p.sendBack(ctx, b, d, ev, delay, extra) {
		p.ack(d, ev, o)
	}
}

// sendBack publishes a copy of d, with extra headers, to come back after
// delay; it reports whether it did, or else has nacked d with requeue.
//
// When the copy cannot be published (a delay queue declared elsewhere
// with other arguments, a broker refusing publishes), d is held for the
// delay it was to wait anyway (at most UnavailableDelay, less on shutdown),
// then sent straight back to the queue, and only if that fails too is it
// nacked with requeue. A persistent failure so costs one try per message
// per delay, never a hot loop, and a nack (which a quorum queue counts
// against its delivery limit) only when nothing can be published at all.
// With Config.DelayInProcess every delay is waited here.
func (p *processor) sendBack(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, delay time.Duration, extra amqp.Table) bool {
	if delay > 0 && p.cfg.DelayInProcess {
		// Config.DelayInProcess: the delivery waits here, unacked, and
		// its copy goes straight back. If its channel dies meanwhile, the
		// broker has already delivered it again: no copy then.
		start := time.Now()
		if !p.hold(ctx, d, delay) {
			p.nackRequeue(d, ev, ev.Reason+"; channel closed during the wait", nil)
			return false
		}
		ev.Delay = min(delay, time.Since(start)) // less when cut short
		delay = 0
	}
	sctx, cancel := settleContext(ctx)
	defer cancel()
	err := b.requeue(sctx, p.cfg.Queue, d, delay, extra)
	if err == nil {
		return true
	}
	ev.Err = errors.Join(ev.Err, err)
	if delay > 0 {
		p.cfg.Logger.ErrorContext(ctx, "amqpidem: delayed requeue failed; the message waits here, then goes straight back to the queue",
			"queue", p.cfg.Queue, "key", ev.Key, "delay", delay, "error", err)
		p.sleep(ctx, min(delay, p.cfg.UnavailableDelay))
		sctx, cancel := settleContext(ctx)
		defer cancel()
		if err = b.requeue(sctx, p.cfg.Queue, d, 0, extra); err == nil {
			return true // it waited its delay here instead
		}
		ev.Err = errors.Join(ev.Err, err)
	}
	p.nackRequeue(d, ev, ev.Reason+"; requeue failed", nil)
	return false
}

// sleep waits d, or less if ctx ends or the consumer begins stopping.
func (p *processor) sleep(ctx context.Context, d time.Duration) {
	p.wait(ctx, d, nil)
}

// hold is sleep for a delivery held unacked during its delay: it reports
// false, at once, if the delivery's channel dies meanwhile (the broker
// then delivers it again), true when the wait ends otherwise.
func (p *processor) hold(ctx context.Context, d *amqp.Delivery, delay time.Duration) bool {
	var dead <-chan struct{} // nil, never ready, unless a Consumer's acker says
	if a, ok := d.Acknowledger.(*acker); ok {
		dead = a.dead
	}
	return p.wait(ctx, delay, dead)
}

// wait waits d, or less if ctx ends, the consumer begins stopping or wake
// is closed; it reports false, at once, if dead is closed first.
func (p *processor) wait(ctx context.Context, d time.Duration, dead <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-dead:
		return false
	case <-t.C:
	case <-ctx.Done():
	case <-p.stopping:
	case <-p.wake:
	}
	return true
}

// deadLetter publishes d with fault headers to the dead-letter target,
// then acks it. An unroutable target never loses the message: it is
// requeued, marked to be dead-lettered again.
func (p *processor) deadLetter(ctx context.Context, b broker, d *amqp.Delivery, ev *Event, reason string, cause error) {
	ev.Reason = reason
	ev.Err = errors.Join(ev.Err, cause)
	sctx, cancel := settleContext(ctx)
	defer cancel()
	msg := deadLetterOf(d, amqp.Table{
		HeaderReason:   reason,
		HeaderError:    headerText(cause.Error()),
		HeaderAttempt:  int64(max(ev.Attempt, p.headerAttempt(d))),
		HeaderConsumer: p.cfg.ConsumerName,
		HeaderKey:      headerText(ev.Key),
		HeaderEndpoint: p.cfg.Endpoint,
	})
	delete(msg.Headers, HeaderDeadLetterPending)
	p.inject(ctx, msg.Headers)
	exchange, key := p.cfg.DeadLetterExchange, p.cfg.DeadLetterRoutingKey
	ownQueue := exchange == "" && key == p.cfg.Queue+".dlq"
	var err error
	for try := 0; try < 2; try++ {
		if ownQueue {
			if err = b.declare(sctx, key, p.cfg.DeadLetterQueueArgs, false); err != nil {
				break
			}
		}
		if err = b.publish(sctx, exchange, key, msg); err == nil || !errors.Is(err, ErrUnroutable) || !ownQueue {
			break
		}
		b.forget(key) // someone deleted our dead-letter queue: declare it again
	}
	if err != nil {
		p.cfg.Logger.ErrorContext(ctx, "amqpidem: dead letter not delivered; requeued to try again",
			"queue", p.cfg.Queue, "key", ev.Key, "exchange", exchange, "routing_key", key, "error", err)
		p.requeueMarked(ctx, b, d, ev, Abandoned, reason, p.cfg.UnavailableDelay, err, reason+": "+cause.Error())
		return
	}
	p.ack(d, ev, DeadLettered)
}

// reply sends result to d's ReplyTo, if any, with d's CorrelationId,
// within settleTimeout even if ctx is done (the result is stored). A reply
// queue that no longer exists (the client gave up) is not an error:
// nobody will ever read the reply, so it is noted in ev and dropped; only a
// publish that may succeed later returns an error.
func (p *processor) reply(ctx context.Context, b broker, d *amqp.Delivery, result []byte, ev *Event) error {
	if d.ReplyTo == "" {
		return nil
	}
	sctx, cancel := settleContext(ctx)
	defer cancel()
	msg := amqp.Publishing{
		CorrelationId: d.CorrelationId,
		ContentType:   d.ContentType,
		Timestamp:     time.Now(),
		Body:          result,
	}
	if p.cfg.Tracer != nil {
		msg.Headers = amqp.Table{}
		p.inject(ctx, msg.Headers)
	}
	err := b.publish(sctx, "", d.ReplyTo, msg)
	if errors.Is(err, ErrUnroutable) {
		ev.Err = errors.Join(ev.Err, fmt.Errorf("amqpidem: reply to %q dropped: %w", d.ReplyTo, err))
		return nil
	}
	return err
}

// ack acknowledges d on its own channel.
func (p *processor) ack(d *amqp.Delivery, ev *Event, o Outcome) {
	ev.Outcome = o
	if err := d.Ack(false); err != nil {
		// The channel is gone; the broker will deliver d again and the
		// record, already settled, makes that a duplicate.
		ev.Err = errors.Join(ev.Err, fmt.Errorf("amqpidem: ack: %w", err))
	}
}

// nackRequeue nacks d with requeue: the broker delivers it again at once.
// It is the last resort when no copy can be published: a quorum queue
// counts the nack against its delivery limit, as it counts a crash.
func (p *processor) nackRequeue(d *amqp.Delivery, ev *Event, reason string, cause error) {
	ev.Outcome, ev.Reason, ev.Delay = Abandoned, reason, 0
	ev.Err = errors.Join(ev.Err, cause)
	if err := d.Nack(false, true); err != nil {
		ev.Err = errors.Join(ev.Err, fmt.Errorf("amqpidem: nack: %w", err))
	}
}

// report logs ev and tells the observer.
func (p *processor) report(ctx context.Context, ev Event) {
	level := slog.LevelDebug // completed, duplicate, busy: nothing to look at
	switch {
	case ev.Outcome == DeadLettered || ev.Err != nil && ev.Outcome != Retried && ev.Outcome != Abandoned:
		level = slog.LevelWarn
	case ev.Outcome == Retried || ev.Outcome == Abandoned || ev.Outcome == Dropped || ev.Err != nil:
		level = slog.LevelInfo
	}
	if p.cfg.Logger.Enabled(ctx, level) {
		attrs := []slog.Attr{
			slog.String("queue", ev.Queue), slog.String("consumer", ev.Consumer), slog.String("key", ev.Key),
			slog.String("outcome", ev.Outcome.String()), slog.Int("attempt", ev.Attempt),
			slog.Int64("fence", ev.Fence), slog.Duration("handler", ev.Handler), slog.Duration("total", ev.Total),
		}
		if ev.Reason != "" {
			attrs = append(attrs, slog.String("reason", ev.Reason))
		}
		if ev.Delay > 0 {
			attrs = append(attrs, slog.Duration("delay", ev.Delay))
		}
		if ev.Err != nil {
			attrs = append(attrs, slog.Any("error", ev.Err))
		}
		p.cfg.Logger.LogAttrs(ctx, level, "amqpidem: message "+ev.Outcome.String(), attrs...)
	}
	if p.cfg.Tracer != nil {
		p.endTrace(ctx, ev)
	}
	if p.cfg.Observer != nil {
		p.observe(ctx, ev)
	}
}

// endTrace tells the Tracer that the delivery was settled.
func (p *processor) endTrace(ctx context.Context, ev Event) {
	defer p.recoverHook(ctx, "Tracer.End")
	p.cfg.Tracer.End(ctx, ev)
}

// callHandler runs the handler on d, timed into ev.Handler, and tells a
// HandlerObserver.
func (p *processor) callHandler(hctx context.Context, ev *Event, d *amqp.Delivery) ([]byte, error) {
	return p.timeHandler(hctx, ev, func() ([]byte, error) { return call(hctx, p.handler, handlerDelivery(d)) })
}

// timeHandler runs f, a handler's call that recovers its panics, timed
// into ev.Handler, and tells a HandlerObserver.
func (p *processor) timeHandler(hctx context.Context, ev *Event, f func() ([]byte, error)) ([]byte, error) {
	info, _ := FromContext(hctx)
	p.handlerStarted(hctx, info)
	t0 := time.Now()
	result, err := f()
	ev.Handler = time.Since(t0)
	p.handlerEnded(hctx, info)
	return result, err
}

// observe tells the Observer of ev; a panic in it is logged, not spread.
func (p *processor) observe(ctx context.Context, ev Event) {
	defer func() {
		if v := recover(); v != nil {
			p.cfg.Logger.ErrorContext(ctx, "amqpidem: Observer panicked", "queue", ev.Queue, "key", ev.Key,
				"panic", v, "stack", string(debug.Stack()))
		}
	}()
	p.cfg.Observer.Observe(ctx, ev)
}

// settleContext is for the calls that settle a delivery: they must run
// even when ctx was cancelled (shutdown), within settleTimeout.
func settleContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
}

// headerInt reads an integer header of any AMQP integer type; 0 if absent
// or of another type.
func headerInt(h amqp.Table, name string) int {
	n, _ := headerInt64(h[name])
	return int(n)
}
