package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strings"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// What a flight does with its lease in the store once the handler is done
// with it (or never started): complete, fail, release, or cancel it.

// complete stores the handler's result and the messages it staged, even
// if the delivery's context was cancelled meanwhile (the work is done),
// then publishes those, replies and acks. If it cannot store them, the
// delivery is requeued: the lease is held until it expires (store
// unavailable) or by someone else (lost), so its next delivery waits for
// it as a busy duplicate.
func (f *flight) complete(result []byte, staged [][]byte) {
	f.completeValue(result, staged, encodeValue(f.d.ReplyTo, result, staged, f.claim()))
}

// completeValue is complete with the value to store made already: a
// batch's, which its CompleteBatch may have stored with its answer lost.
// Storing the same value again is then answered nil, and its staged
// messages' claim is the one stored.
func (f *flight) completeValue(result []byte, staged [][]byte, value []byte) {
	// Complete is compare-and-set on owner and fence: if the lease was
	// lost, it fails and the result is discarded. If the keeper only could
	// not confirm the lease but nobody took it over, the result is still
	// the only one and is kept.
	err := settle(f.calmCtx(), "Complete", func(ctx context.Context) error { return f.p.store.Complete(ctx, f.lease, value) })
	f.stopKeep() // renewing it would only delay its expiry
	switch {
	case err == nil:
		f.ev.Outbox.Staged = len(staged)
		if len(staged) > 0 {
			f.p.checkRetention(f.ctx, f.lease)
		}
		if len(staged) > 0 && !f.dispatch(value, f.lease.Fence, true) {
			return
		}
		f.replyAndAck(result, Completed)
	case errors.Is(err, lock.ErrResultTooLarge):
		// Terminal: storing it again cannot work, and a requeue would run
		// the handler again once the lease expired.
		f.fail("result too large", err)
	case errors.Is(err, lock.ErrLeaseLost):
		f.requeue(Abandoned, "lease lost", MinInProgressDelay, err)
	default:
		f.requeue(Abandoned, "store unavailable", f.p.cfg.UnavailableDelay, err)
	}
}

// fail records a terminal failure (reason: cause) and dead-letters the
// delivery.
func (f *flight) fail(reason string, cause error) {
	text := reason + ": " + cause.Error()
	err := settle(f.calmCtx(), "Fail", func(ctx context.Context) error { return f.p.store.Fail(ctx, f.lease, text) })
	switch {
	case err == nil:
		f.deadLetter(reason, cause)
	case errors.Is(err, lock.ErrLeaseLost):
		// Someone took the key over: its new holder decides.
		f.requeue(Abandoned, "lease lost", MinInProgressDelay, errors.Join(cause, err))
	default:
		// Fail may have landed with its reply lost. The copy goes back
		// marked pending, so that if the record says failed when it comes
		// back it is dead-lettered, whatever FailedDuplicate says; if Fail
		// did not land, the key runs again once the lease expires.
		f.requeueWith(Abandoned, "store unavailable", f.p.cfg.InProgressDelay, errors.Join(cause, err), pendingMark(text))
	}
}

// release gives the lease back so that a retry need not wait for it to
// expire. A failure only delays that retry by up to the lease TTL.
func (f *flight) release() {
	sctx, cancel := calmContext(f.calmCtx())
	defer cancel()
	err := storeCall("Release", func() error { return f.p.store.Release(sctx, f.lease) })
	if err != nil && !errors.Is(err, lock.ErrLeaseLost) {
		f.p.cfg.Logger.WarnContext(f.ctx, "amqpidem: release failed; the retry waits for the lease to expire",
			"queue", f.p.cfg.Queue, "key", f.ev.Key, "fence", f.lease.Fence, "error", err)
	}
}

// cancel gives back a lease whose handler never started (or whose
// execution does not count: a stale fence), and the attempt it counted,
// which the Event then no longer counts either. A failure only delays the
// next delivery by up to the lease TTL, and that attempt stays counted.
func (f *flight) cancel() {
	sctx, cancel := calmContext(f.calmCtx())
	defer cancel()
	err := storeCall("Cancel", func() error { return f.p.store.Cancel(sctx, f.lease) })
	if err == nil {
		f.ev.Attempt = max(f.lease.Attempt-1, f.h.attempt)
		return
	}
	if !errors.Is(err, lock.ErrLeaseLost) {
		f.p.cfg.Logger.WarnContext(f.ctx, "amqpidem: cancel failed; the next delivery waits for the lease to expire",
			"queue", f.p.cfg.Queue, "key", f.ev.Key, "fence", f.lease.Fence, "error", err)
	}
}

// settle makes a store call that settles a lease or its record
// (Complete, Fail, Amend; what names it) with calm, a context that is never
// cancelled (flight.calmCtx), so that it is made even if the delivery's
// context was cancelled meanwhile, and tries it again for up to
// settleTimeout while it fails with anything but an answer: nil,
// lock.ErrLeaseLost, lock.ErrChanged or lock.ErrResultTooLarge. A call that
// panics is not tried again: its error wraps a *PanicError (callStore),
// and the caller settles the delivery as for a store that did not answer.
func settle(calm context.Context, what string, call func(context.Context) error) error {
	final := func(err error) bool {
		return err == nil || errors.Is(err, lock.ErrLeaseLost) || errors.Is(err, lock.ErrChanged) ||
			errors.Is(err, lock.ErrResultTooLarge) || isPanic(err)
	}
	err := callStore(calm, what, call)
	if final(err) {
		return err
	}
	sctx, cancel := calmContext(calm)
	defer cancel()
	wait := 20 * time.Millisecond
	for {
		select {
		case <-sctx.Done():
			return err
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
		if err = callStore(sctx, what, call); final(err) {
			return err
		}
	}
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

// callStore is storeCall for a call that takes ctx.
func callStore(ctx context.Context, what string, call func(context.Context) error) (err error) {
	defer recoverStore(&err, what)
	return call(ctx)
}

// storeCall runs call, a store method named what, turning a panic into an
// error wrapping a *PanicError: a store's bug (a custom store, a driver's)
// settles the delivery as an unavailable store does, rather than taking
// the process and every delivery in flight down with it.
func storeCall(what string, call func() error) (err error) {
	defer recoverStore(&err, what)
	return call()
}

// isPanic reports whether err wraps a *PanicError.
func isPanic(err error) bool {
	var pe *PanicError
	return errors.As(err, &pe)
}

// recoverStore turns a panic of the store call named what into *err.
func recoverStore(err *error, what string) {
	if v := recover(); v != nil {
		*err = fmt.Errorf("amqpidem: the store's %s panicked: %w", what, &PanicError{Value: v, Stack: debug.Stack()})
	}
}
