package amqpidem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// attemptsExhausted sets the execution's attempt, the record's or the
// message's own count when that is higher (a record lost: expired,
// evicted, forgotten by a restart, restarts its count; the message's
// copies do not), and reports whether it is past MaxAttempts: the
// delivery then failed, settled.
func (f *flight) attemptsExhausted() bool {
	f.attempt = max(f.lease.Attempt, f.h.attempt+1)
	f.ev.Attempt = f.attempt
	if f.attempt <= f.p.cfg.MaxAttempts {
		return false
	}
	f.arrived()
	f.freeSlot()
	f.fail("attempts exhausted", fmt.Errorf("%d executions started, at most %d allowed (earlier ones crashed or lost their lease)",
		f.attempt-1, f.p.cfg.MaxAttempts))
	return true
}

// notStarted settles a delivery shut down, or whose lease was lost
// (cause), before its handler started, its keep-alive stopped: this
// attempt never ran, so it is taken back.
func (f *flight) notStarted(stopping bool, cause error) {
	f.arrived()
	f.freeSlot()
	f.cancel()
	if stopping || f.ctx.Err() != nil {
		f.requeue(Abandoned, "shutdown", 0, cmp.Or(cause, errNotStarted))
		return
	}
	f.requeue(Abandoned, "lease lost", MinInProgressDelay, cause)
}

// run executes the handler under the kept lease and settles the delivery
// by what the handler returned (completed, or failed). A batch consumer's
// flights take runKept instead.
func (f *flight) run() {
	p := f.p
	if f.attemptsExhausted() {
		return
	}
	f.hctx, f.keep = p.keeper.Keep(f.ctx, f.lease)
	if stopping := p.isStopping(); stopping || f.hctx.Err() != nil {
		cause := context.Cause(f.hctx)
		f.stopKeep()
		f.notStarted(stopping, cause)
		return
	}
	if p.cfg.HandlerTimeout > 0 {
		var cancel context.CancelFunc
		f.hctx, cancel = context.WithTimeoutCause(f.hctx, p.cfg.HandlerTimeout, ErrHandlerTimeout)
		defer cancel()
	}
	f.x = execution{
		info:   Info{Queue: p.cfg.Queue, Key: f.ev.Key, Attempt: f.attempt, Fence: f.lease.Fence},
		outbox: outbox{idBase: f.storeKey, maxMessages: p.cfg.MaxStaged, maxBytes: p.outboxBytes, noStore: p.amender == nil, inject: p.stageInject()},
	}
	x := &f.x
	f.hctx = withExecution(f.hctx, x)
	if c, ok := p.handler.(Completer); ok {
		f.runCompleter(c, &x.outbox)
		return
	}
	result, err := f.timeHandler(func() ([]byte, error) { return call(f.hctx, p.handler, f.handlerDelivery()) })
	f.freeSlot()
	staged := x.outbox.seal()
	switch {
	case err == nil && len(result) > p.cfg.MaxResultSize:
		f.stopKeep()
		f.fail("result too large", fmt.Errorf("%w: %d bytes, at most %d allowed", lock.ErrResultTooLarge, len(result), p.cfg.MaxResultSize))
	case err == nil:
		f.complete(result, staged)
	default:
		f.failed(err)
	}
}

// runCompleter is run's second half for a Completer, which completes the
// record itself, in the transaction of its effects, with the value
// amqpidem makes of the result and what the handler staged in o: it runs
// c and settles the delivery.
func (f *flight) runCompleter(c Completer, o *outbox) {
	// What value saw: that it was called, that it refused the result, and
	// what it returned to be stored. One object, for the closure.
	var v struct {
		valued, tooLarge bool
		stored           []byte
		staged           int
	}
	replyTo, limit, valueLimit, ttl := f.d.ReplyTo, f.p.cfg.MaxResultSize, f.p.valueLimit, f.lease.TTL
	value := func(result []byte) ([]byte, error) {
		v.valued = true
		staged := o.seal()
		stored := encodeValue(replyTo, result, staged, claimFrom(time.Now(), ttl))
		if len(result) > limit || len(stored) > valueLimit {
			v.tooLarge = true
			return nil, fmt.Errorf("%w: a result of %d bytes (at most %d allowed) and %d staged messages make %d bytes, at most %d allowed",
				lock.ErrResultTooLarge, len(result), limit, len(staged), len(stored), valueLimit)
		}
		v.stored, v.staged = stored, len(staged)
		return stored, nil
	}
	result, err := f.timeHandler(func() ([]byte, error) {
		return recovered(func() ([]byte, error) { return c.HandleComplete(f.hctx, f.handlerDelivery(), f.lease, value) })
	})
	o.seal()
	f.freeSlot()
	switch {
	case err == nil: // completed in its transaction
		f.stopKeep()
		f.ev.Outbox.Staged = v.staged
		if v.staged > 0 {
			f.p.checkRetention(f.ctx, f.lease)
		}
		if v.staged > 0 && !f.dispatch(v.stored, f.lease.Fence, true) {
			return
		}
		f.replyAndAck(result, Completed)
	case v.tooLarge && !IsPermanent(err):
		f.stopKeep()
		f.fail("result too large", err)
	case v.valued && errors.Is(err, lock.ErrLeaseLost):
		// The completion found another owner: everything rolled back, and
		// the record decides the next delivery.
		f.stopKeep()
		f.requeue(Abandoned, "lease lost", MinInProgressDelay, err)
	case errors.Is(err, lock.ErrLeaseLost) && !IsPermanent(err):
		// The lease ended before the completion (pgstore's lease held by
		// a transaction whose session the server ended): nothing
		// committed. The release records the attempt, unless someone took
		// the key over; the record decides the next delivery.
		f.stopKeep()
		f.release()
		f.requeue(Abandoned, "lease lost", MinInProgressDelay, err)
	case errors.Is(err, lock.ErrUnavailable) && !IsPermanent(err):
		// Not committed, or committed with the answer lost. In the second
		// case the record is completed and refuses the release, and the
		// redelivery is acked as a duplicate.
		f.stopKeep()
		f.release()
		f.requeue(Abandoned, "store unavailable", f.p.cfg.UnavailableDelay, err)
	default:
		f.failed(err)
	}
}

// failed settles the delivery after its handler returned err: lease lost
// or shutdown, a stale fence, a retry with backoff, or a terminal failure.
func (f *flight) failed(err error) {
	stopped := f.hctx.Err() != nil && !IsPermanent(err) && !f.timedOut()
	switch {
	case stopped:
		// The handler was stopped (lease lost or unconfirmed, shutdown):
		// its failure says nothing about the message.
		cause := context.Cause(f.hctx)
		f.arrived()
		f.stopKeep()
		f.release()
		if f.ctx.Err() != nil {
			f.requeue(Abandoned, "shutdown", 0, cause)
			return
		}
		f.requeue(Abandoned, "lease lost", MinInProgressDelay, cause)
	case errors.Is(err, ErrStale) && !IsPermanent(err):
		// The handler's own store saw a newer fence: another execution
		// of this key got further. This one is no attempt; the record
		// decides the next delivery (a duplicate once that execution
		// completed, busy while it runs).
		f.stopKeep()
		f.cancel()
		f.requeue(Abandoned, "stale fence", MinInProgressDelay, err)
	default:
		j := f.judge(err)
		f.stopKeep()
		if j.retry {
			f.release()
			f.requeue(Retried, j.reason, j.delay, j.err)
			return
		}
		f.fail(j.reason, j.err)
	}
}

// runUnkeyed runs the handler with no lease and no stored outcome (why
// says why: no key, or failing open), in the delivery's slot, which it
// frees when the handler returns, and settles the delivery.
func (f *flight) runUnkeyed(why string) {
	p := f.p
	f.attempt = f.h.attempt + 1
	f.ev.Attempt = f.attempt
	if f.attempt > p.cfg.MaxAttempts {
		f.arrived()
		f.freeSlot()
		f.deadLetter("attempts exhausted", fmt.Errorf("%d executions started, at most %d allowed", f.attempt-1, p.cfg.MaxAttempts))
		return
	}
	f.x = execution{
		info:   Info{Queue: p.cfg.Queue, Attempt: f.attempt},
		outbox: outbox{maxMessages: p.cfg.MaxStaged, maxBytes: p.outboxBytes, inject: p.stageInject()},
	}
	x := &f.x
	f.hctx = withExecution(f.ctx, x)
	if p.cfg.HandlerTimeout > 0 {
		var cancel context.CancelFunc
		f.hctx, cancel = context.WithTimeoutCause(f.hctx, p.cfg.HandlerTimeout, ErrHandlerTimeout)
		defer cancel()
	}
	result, err := f.timeHandler(func() ([]byte, error) { return call(f.hctx, p.handler, f.handlerDelivery()) })
	f.freeSlot()
	staged := x.outbox.seal()
	if err == nil && len(staged) > 0 {
		// No record to keep them in: published now, at least once; a
		// failure is the execution's, retried as a handler error.
		f.ev.Outbox.Staged = len(staged)
		if perr := f.publishUnkeyed(staged); perr != nil {
			err = fmt.Errorf("amqpidem: staged message not published: %w", perr)
		}
	}
	switch {
	case err == nil:
		if err := f.reply(result); err != nil {
			// Nothing stored to send again: a retry would run the
			// handler again, so the reply is lost and logged.
			f.ev.Err = errors.Join(f.ev.Err, err)
		}
		f.ev.Reason = why
		f.ack(Completed)
	case f.ctx.Err() != nil && !IsPermanent(err):
		f.requeue(Abandoned, "shutdown", 0, err)
	default:
		j := f.judge(err)
		if j.retry {
			f.requeue(Retried, j.reason, j.delay, j.err)
			return
		}
		f.deadLetter(j.reason, j.err)
	}
}

// judgement is what a failed execution comes to: retried after delay, or
// a terminal failure, with the reason and the error to record.
type judgement struct {
	reason string
	err    error
	retry  bool
	delay  time.Duration
}

// judge decides what the handler's error err comes to, by the
// execution's attempt: a retry with the queue's backoff while attempts
// are left and the error is not Permanent, else a terminal failure
// ("permanent failure" or "attempts exhausted"). A handler cut off by
// HandlerTimeout is a "handler timeout" retry. Call it before the lease's
// keep-alive stops, which cancels the handler's context.
func (f *flight) judge(err error) judgement {
	j := judgement{reason: "handler error", err: err}
	if f.timedOut() {
		j.reason = "handler timeout"
		j.err = fmt.Errorf("%w after %v: %w", ErrHandlerTimeout, f.p.cfg.HandlerTimeout, err)
	}
	if !IsPermanent(j.err) && f.attempt < f.p.cfg.MaxAttempts {
		if delay, ok := f.p.retryDelay(f.ctx, f.attempt, j.err, f.d); ok {
			j.retry, j.delay = true, delay
			return j
		}
	}
	j.reason = "attempts exhausted"
	if IsPermanent(j.err) {
		j.reason = "permanent failure"
	}
	return j
}

// timedOut reports whether HandlerTimeout cut the handler off.
func (f *flight) timedOut() bool {
	return f.batchTimedOut || errors.Is(context.Cause(f.hctx), ErrHandlerTimeout)
}

// timeHandler runs h, a handler's call that recovers its panics, timed
// into the Event, and tells a HandlerObserver.
func (f *flight) timeHandler(h func() ([]byte, error)) ([]byte, error) {
	info, _ := FromContext(f.hctx)
	f.p.handlerStarted(f.hctx, info)
	t0 := time.Now()
	result, err := h()
	f.ev.Handler = time.Since(t0)
	f.p.handlerEnded(f.hctx, info)
	return result, err
}
