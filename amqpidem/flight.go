package amqpidem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

// flight is one delivery on its way through the processor, from its
// arrival to its settlement: the delivery, what its headers say (read
// once: see head), the Event that records what happens to it, and what
// it holds on the way (a gate slot, a lease, the lease's keep-alive). Its
// methods are the steps, in this file by the decisions they make and in
// run.go, settle.go and lease.go by what they do:
//
//	arrive    its turn at the gate, its key, the store's lookup
//	answer    the store's answer: duplicate, busy, conflict, failed, or run
//	run       the handler under a kept lease, then complete or failed
//	settle    ack, requeue (after a delay), dead letter, reply
//
// A flight lives for one call of processor.process, on its goroutine, and
// is not safe for concurrent use; that is why it may carry the call's
// contexts, as an http.Request does.
type flight struct {
	p *processor
	b broker
	// ctx is the delivery's context: the caller's values and trace span,
	// done when the handlers must stop (shutdown, forced).
	ctx context.Context
	// calm is context.WithoutCancel(ctx), once made (calmCtx).
	calm context.Context
	d    *amqp.Delivery
	// h is what the delivery's headers say: its attempt and publish time
	// from its arrival on (arrivalHeaders), the rest once head read them.
	h  headers
	ev Event
	// storeKey is the key of the delivery's record (StoreKey), once it
	// has one.
	storeKey string
	// lease is the lease Acquire granted, once the answer was Acquired.
	lease lock.Lease
	// attempt is the execution's attempt once it runs: the record's
	// count or the message's, whichever is higher.
	attempt int
	// hctx is the handler's context once it runs; keep stops the lease's
	// keep-alive (nil when none runs). A batch consumer's flight has its
	// lease kept without a context of its own (runKept): kept, with hctx
	// the flight as a context of its own (handlerCtx), and lost and
	// cancelRun, guarded by its batcher's lossMu, say why the lease was
	// lost (nil while kept) and how to cancel the batch run the flight
	// is in (nil when in none).
	hctx      context.Context
	keep      func()
	kept      heartbeat.Kept
	keptCtx   heartbeat.Kept // kept, never reset, for hctx (handlerCtx)
	lost      error
	cancelRun context.CancelCauseFunc
	// ownCtx and cancelOwn are hctx's own context once one is needed
	// (handlerCtx.own): a Done asked for, the lease lost, or the keep
	// stopped (ended); guarded, with ended, by its batcher's lossMu.
	ownCtx    context.Context
	cancelOwn context.CancelCauseFunc
	// out is what its batch came to, for a batch consumer's flight
	// (runBatched); batchTimedOut says that HandlerTimeout cut off the
	// batch it ran in alone.
	out batchOut
	// ready is done once its batch's leader found out final: a flight
	// whose record committed in one part of a split batch settles then,
	// not after the rest of the split (whose runs may outlast its
	// outbox claim). released says the leader marked it done (the
	// leader's own field). A WaitGroup, part of the flight, rather than a
	// channel, an allocation per message.
	ready sync.WaitGroup
	// acq is its request in a lease batch (acquireBatched), and hd the
	// delivery its handler gets (handlerDelivery's copy): a batch
	// consumer's flights use only the first, the others only the second,
	// so each is allocated with the flight that uses it (newFlight,
	// newJob), or on first use.
	acq *acquireCall
	hd  *amqp.Delivery
	// x is its execution (run, runUnkeyed: the handler's context; a
	// batch consumer's flight's x only gives its Info to hctx, runKept):
	// part of the flight, already on the heap, rather than an allocation
	// of its own. The handler may keep it, or hd, after it returns; they
	// keep the flight, never reused, alive with them.
	x execution

	// The flags, together (no padding after each): ended goes with
	// ownCtx, batchTimedOut with out, released with ready. leaseBatched:
	// its lease was asked for in a lease batch, and it has not told its
	// batcher yet that it is no longer on its way to a run batch
	// (arrived). slotHeld: it holds a slot of its processor's gate
	// (freeSlot); never without a gate.
	ended, batchTimedOut, released, leaseBatched, slotHeld bool
}

// soloFlight and batchFlight are a flight with the part that only its
// kind of processor uses (see flight.acq), in one allocation.
type (
	soloFlight struct {
		flight
		hd amqp.Delivery
	}
	batchFlight struct {
		flight
		acq acquireCall
	}
)

// newFlight returns a zero flight for p, with its hd or its acq.
func (p *processor) newFlight() *flight {
	if p.batchesLeases() {
		f := new(batchFlight)
		f.flight.acq = &f.acq
		return &f.flight
	}
	f := new(soloFlight)
	f.flight.hd = &f.hd
	return &f.flight
}

// handlerDelivery is the delivery as its handler gets it: a copy whose
// Ack, Nack and Reject refuse (see handlerDelivery), kept in the flight.
func (f *flight) handlerDelivery() *amqp.Delivery {
	if f.hd == nil {
		f.hd = new(amqp.Delivery)
	}
	*f.hd = *f.d
	f.hd.Acknowledger = refuseAck{}
	return f.hd
}

// calmCtx is the context of the calls that settle the delivery, which
// must run even when ctx was cancelled (shutdown): ctx without its
// cancellation, made once per flight, or once per session for a
// Consumer's deliveries without a Tracer (fly).
func (f *flight) calmCtx() context.Context {
	if f.calm == nil {
		f.calm = context.WithoutCancel(f.ctx)
	}
	return f.calm
}

// freeSlot gives the delivery's slot of the processor's gate back, once;
// a no-op when it holds none.
func (f *flight) freeSlot() {
	if f.slotHeld {
		f.slotHeld = false
		f.p.gate.release()
	}
}

// stopKeep stops the lease's keep-alive, if one runs: renewing a lease
// whose outcome is being settled would only delay its expiry. It cancels
// the handler's context (a single message's Keep context, or a batch
// consumer's flight's handlerCtx).
func (f *flight) stopKeep() {
	if f.keep != nil {
		f.keep()
		f.keep = nil
	}
	f.kept.Stop()
	f.kept = heartbeat.Kept{}
	if c, ok := f.hctx.(*handlerCtx); ok {
		c.end()
	}
}

// head returns what the delivery's headers say, in full: it reads them
// (parseHeaders) the first time a step asks. A duplicate of completed
// work needs only what arrivalHeaders read, and is spared the rest.
func (f *flight) head() *headers {
	if !f.h.parsed {
		f.h = f.p.parseHeaders(f.d)
	}
	return &f.h
}

// errNotStarted is the cause given when a delivery goes back to its queue
// before its handler started.
var errNotStarted = errors.New("amqpidem: consumer stopping before the handler started")

// arrive takes the delivery through its turn at the gate (t, nil without
// one), its key and the store's lookup, and settles it by what they say.
func (f *flight) arrive(t *ticket) {
	p := f.p
	key, keyErr := p.key(f.d)
	f.ev.Key = key
	if t != nil {
		if !p.gate.wait(f.ctx, p.stopping, t) {
			// Stopping before this delivery's turn: back to the queue,
			// no lease taken, nothing run.
			f.requeue(Abandoned, "shutdown", 0, cmp.Or(f.ctx.Err(), errNotStarted))
			return
		}
		f.slotHeld = true
	}
	if err := p.replyRefused(f.d.ReplyTo); err != nil {
		f.freeSlot()
		f.deadLetter("reply-to refused", err) // not run: no lease, no record
		return
	}
	if keyErr != nil {
		f.noKey(keyErr)
		return
	}
	f.storeKey = StoreKey(p.cfg.Endpoint, key)
	req := lock.Request{Key: f.storeKey, TTL: p.cfg.LeaseTTL, Retention: p.cfg.Retention}
	fp, err := p.fingerprint(f.d)
	if err != nil {
		f.freeSlot()
		f.deadLetter("invalid key", err)
		return
	}
	req.Fingerprint = fp
	f.leaseBatched = p.batchesLeases()
	// Whatever way it goes, it is counted as on its way to a run batch no
	// more once it has gone (arrived does it sooner on each way).
	defer f.arrived()
	var res lock.Result
	if f.leaseBatched {
		if f.acq == nil {
			f.acq = new(acquireCall)
		}
		f.acq.req, f.acq.d = req, f.d
		res, err = p.acquireBatched(f.ctx, f.acq)
	} else {
		res, err = p.acquire(f.ctx, req, f.d)
	}
	if err != nil {
		f.arrived()
		f.noAnswer(err)
		return
	}
	f.answer(&res)
}

// answer settles the delivery by the store's answer res: the rows of the
// outcome table (package documentation) that the record decides.
func (f *flight) answer(res *lock.Result) {
	p := f.p
	f.ev.Attempt, f.ev.Fence = max(res.Attempts, f.h.attempt), res.Fence
	if res.Status != lock.Acquired {
		f.arrived()
		f.freeSlot() // nothing to run: later deliveries go on
	} else {
		f.lease = res.Lease
	}
	switch {
	case res.Status == lock.Completed: // duplicate of completed work
		f.duplicate(res)
	case res.Status == lock.Failed && f.dropFailed(): // duplicate of failed work, acked by policy
		f.drop(res.Error)
	case res.Status == lock.Failed: // duplicate of failed work
		f.deadLetter(f.failedReason(res.Error), errors.New(res.Error))
	case res.Status == lock.InProgress: // another consumer holds a live lease
		f.requeueBusy("in progress elsewhere", res.Remaining)
	case res.Status == lock.Conflict: // same key, different payload
		f.deadLetter("key conflict", fmt.Errorf("key %q was first seen with a different payload", f.ev.Key))
	case res.Status != lock.Acquired:
		f.requeue(Abandoned, "unexpected store answer", p.cfg.UnavailableDelay, fmt.Errorf("status %v", res.Status))
	case f.head().expired(time.Now()): // expired: not run, its attempt taken back
		f.arrived()
		f.cancel()
		f.deadLetterExpired()
	case f.head().pending: // its dead letter is due: failed without running
		f.arrived()
		f.freeSlot()
		f.fail(f.pendingReason(), fmt.Errorf("dead letter pending: %s", f.head().pendingText))
	case p.batch != nil: // new key, or a retry: run it in a batch
		f.runKept()
	default: // new key, or a retry: run it
		f.run()
	}
}

// dropFailed reports whether a duplicate of failed work is acked rather
// than dead-lettered: AckFailedDuplicate says so, and the copy is not
// pending or redelivered. A redelivered copy may be the first one, whose
// dead letter was never confirmed; a pending one surely is: it is
// dead-lettered rather than risk losing it.
func (f *flight) dropFailed() bool {
	return f.p.cfg.FailedDuplicate == AckFailedDuplicate && !f.head().pending && !f.d.Redelivered
}

// failedReason is the reason a duplicate of failed work, whose record
// holds stored, is dead-lettered with: the header only ever sends a
// message to the dead-letter queue that the record says failed, and the
// reason of a pending one comes from the record, not from the header.
func (f *flight) failedReason(stored string) string {
	if f.head().pending {
		return storedReason(stored)
	}
	return "failed duplicate"
}

// pendingReason is the reason a pending copy is failed with when its key
// is free: the header can only bring a dead letter closer.
func (f *flight) pendingReason() string {
	if r := storedReason(f.head().pendingText); r != "failed duplicate" {
		return r
	}
	return "dead letter pending"
}

// noKey settles a delivery without a usable key: run unkeyed when
// MissingKey says so (unless expired), else dead-lettered.
func (f *flight) noKey(err error) {
	switch {
	case errors.Is(err, ErrNoKey) && f.p.cfg.MissingKey == ProcessMissingKey && f.head().expired(time.Now()):
		f.deadLetterExpired()
	case errors.Is(err, ErrNoKey) && f.p.cfg.MissingKey == ProcessMissingKey:
		f.runUnkeyed("no key")
	case errors.Is(err, ErrInvalidKey):
		f.freeSlot()
		f.deadLetter("invalid key", err)
	default:
		f.freeSlot()
		f.deadLetter("missing key", err)
	}
}

// noAnswer settles a delivery whose lookup failed with err: the store
// unreachable (requeued, or run unkeyed with FailOpen), the key refused,
// the key's record unusable, the call panicked, or a shutdown.
func (f *flight) noAnswer(err error) {
	p := f.p
	if p.cfg.FailOpen && f.ctx.Err() == nil && errors.Is(err, lock.ErrUnavailable) {
		f.runUnkeyed("store unavailable, failing open")
		return
	}
	f.freeSlot()
	switch {
	case errors.Is(err, lock.ErrInvalidKey):
		f.deadLetter("invalid key", err)
	case f.ctx.Err() != nil:
		f.requeue(Abandoned, "shutdown", 0, err)
	case errors.Is(err, lock.ErrBadRecord) || errors.Is(err, lock.ErrKeyCollision):
		f.recordFault("record unusable", err)
	case errors.As(err, new(*PanicError)):
		// It may panic again on every copy (a poison message): retried
		// as a record fault, not forever.
		f.recordFault("acquire panic", err)
	default:
		f.requeue(Abandoned, "store unavailable", p.cfg.UnavailableDelay, err)
	}
}

// recordFault settles a delivery whose key's record cannot be used
// (lock.ErrBadRecord, lock.ErrKeyCollision: reason "record unusable") or
// whose lookup panicked ("acquire panic"): it is not run, unkeyed or
// otherwise, since the record may say the work is done. It is requeued
// after UnavailableDelay, counting tries in HeaderAttempt, and dead-lettered
// once MaxAttempts tries were made.
func (f *flight) recordFault(reason string, err error) {
	f.ev.Attempt = f.h.attempt + 1
	if f.ev.Attempt >= f.p.cfg.MaxAttempts {
		f.deadLetter(reason, err)
		return
	}
	f.requeue(Abandoned, reason, f.p.cfg.UnavailableDelay, err)
}
