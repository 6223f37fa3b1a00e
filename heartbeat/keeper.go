package heartbeat

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// Errors used as the cancellation cause of a kept context; read it with
// context.Cause and compare with errors.Is.
var (
	// ErrLeaseUnconfirmed means no extension of the lease was confirmed
	// before its local deadline minus the safety margin: the store is
	// slow, paused or unreachable, and the lease may run out while the
	// handler still works. The cause wraps it with the key, the local
	// deadline, and how long the running extension has gone unanswered or
	// the last transport error.
	ErrLeaseUnconfirmed = errors.New("heartbeat: lease extension not confirmed before deadline")
	// ErrClosed means the Keeper was shut down while the lease was kept,
	// or Keep was called after Shutdown.
	ErrClosed = errors.New("heartbeat: keeper closed")
	// ErrInvalidLease means Keep was given a lease it cannot keep: no
	// key or one too long, a TTL below lock.MinTTL or not longer than the
	// safety margin, or no deadline; or the store refused to extend it
	// with lock.ErrInvalidKey or lock.ErrInvalidTTL. The cause wraps it
	// with the reason.
	ErrInvalidLease = errors.New("heartbeat: invalid lease")
)

// Keeper keeps leases alive: it extends every kept lease about every TTL/3
// and cancels the lease's context when the lease is lost, when an extension
// is not confirmed in time, or when the Keeper shuts down.
//
// A Keeper owns exactly two goroutines however many leases it keeps: a loop
// that watches every deadline and batches due extensions, and an extender
// that makes one store.Extend call at a time, so that a store call that
// hangs never delays a deadline check.
//
// Keeper is safe for concurrent use.
type Keeper struct {
	store lock.Store
	cfg   Config

	mu       sync.Mutex
	entries  map[*entry]struct{} // kept leases; guarded by mu
	closed   bool                // guarded by mu
	nextWake time.Time           // when the loop will look next; guarded by mu
	sentAt   time.Time           // start of the running Extend call; guarded by mu

	wake    chan struct{} // nudges the loop to an earlier wake; buffered 1
	batches chan *batch   // loop → extender; buffered 1
	results chan *batch   // extender → loop; buffered 1

	quit       chan struct{}   // closed by the first Shutdown, once its leases were told
	baseCtx    context.Context // parent of every Extend call's context
	cancelBase context.CancelFunc
	loopDone   chan struct{}
	extDone    chan struct{}
}

// entry is one kept lease. Fields after ctx are guarded by Keeper.mu.
//
// For Keep, it is also the context Keep returns: ctx, carrying the entry
// as the lease (LeaseFromContext), as context.WithValue(ctx, leaseKey{},
// e) would, without a context of its own to allocate. For KeepWith, it
// has no context (cancel and ctx nil): to is told instead (lose).
type entry struct {
	k      *Keeper
	lease  lock.Lease
	margin time.Duration
	to     LossHandler // KeepWith's; nil for Keep's
	cancel context.CancelCauseFunc
	ctx    context.Context

	deadline time.Time // confirmed conservative local deadline
	due      time.Time // next extension is due
	early    time.Time // the extension may join a batch from here on
	inFlight bool      // part of the batch the extender is running
	lastErr  error     // last transport error, for the cause
}

// batch is one Extend call: its leases, the local time just before the call
// and, once done, the answers.
type batch struct {
	entries []*entry
	leases  []lock.Lease
	bound   time.Time // earliest deadline in the batch
	start   time.Time
	errs    []error
}

// New returns a Keeper that extends leases through store and starts its two
// goroutines; stop them with Shutdown. It returns an error when store is nil
// or cfg is invalid.
func New(store lock.Store, cfg Config) (*Keeper, error) {
	if store == nil {
		return nil, errors.New("heartbeat: nil store")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	baseCtx, cancelBase := context.WithCancel(context.Background())
	k := &Keeper{
		store:      store,
		cfg:        cfg.withDefaults(),
		entries:    make(map[*entry]struct{}),
		wake:       make(chan struct{}, 1),
		batches:    make(chan *batch, 1),
		results:    make(chan *batch, 1),
		quit:       make(chan struct{}),
		baseCtx:    baseCtx,
		cancelBase: cancelBase,
		loopDone:   make(chan struct{}),
		extDone:    make(chan struct{}),
	}
	go k.loop()
	go k.extender()
	return k, nil
}

// Keep starts keeping lease alive and returns a context for the handler that
// carries the lease (see LeaseFromContext) and a stop function.
//
// The context is cancelled, with a cause readable by context.Cause, when:
//   - an extension reports the lease lost: the cause wraps lock.ErrLeaseLost
//     (seen within one extension interval, about TTL/3);
//   - no extension was confirmed by the lease's local deadline minus the
//     safety margin: the cause wraps ErrLeaseUnconfirmed;
//   - the Keeper shuts down: the cause is ErrClosed;
//   - parent is done: the cause is parent's.
//
// The lease's local deadline starts at lease.Deadline and is only moved, after
// a confirmed extension, to the local time just before that Extend call was
// sent plus lease.TTL, less lock.DeadlineSlack. Deadlines are compared with time.Now, so
// lease.Deadline should come from a store whose clock is time.Now (the
// default). The keeper stops extending once the context is done.
//
// Call stop when the handler returns, before or after Complete, Fail or
// Release (those do not need the lease kept; a lease has more than the safety
// margin left while its context is live). stop unregisters the lease and
// cancels the context with context.Canceled, so give Complete a context not
// derived from the returned one. stop is idempotent and cheap.
//
// Keep on a closed Keeper returns a context already cancelled with ErrClosed;
// a lease it cannot keep (see ErrInvalidLease) or one already past its
// deadline minus the margin gives a cancelled context too. Keep never panics
// on a bad lease.
func (k *Keeper) Keep(parent context.Context, lease lock.Lease) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(parent)
	e := &entry{
		k:        k,
		lease:    lease,
		margin:   k.cfg.margin(lease.TTL),
		cancel:   cancel,
		ctx:      ctx,
		deadline: lease.Deadline,
	}
	ctx = e
	stop := func() {
		k.remove(e)
		cancel(nil)
	}
	if err := e.check(); err != nil {
		cancel(err)
		return ctx, stop
	}
	if e.ctx.Err() != nil {
		return ctx, stop
	}
	if err := k.start(e); err != nil {
		cancel(err)
	}
	return ctx, stop
}

// LossHandler is told when a lease kept by KeepWith can no longer be
// counted on.
type LossHandler interface {
	// LeaseLost is called at most once per KeepWith call, with the cause
	// Keep's context would be cancelled with: wrapping lock.ErrLeaseLost,
	// ErrLeaseUnconfirmed or ErrInvalidLease, or ErrClosed. It is called
	// on one of the Keeper's goroutines (or Shutdown's), which wait for
	// it (it runs on a goroutine of its own that they wait for): it must
	// return quickly. While a call the Keeper's loop made runs, that loop
	// checks no deadline and extends no lease, of any KeepWith or Keep
	// call: a handler that blocks for longer than the shortest TTL's
	// margin lets the other leases run out unextended, their holders
	// untold. It may call the lease's Kept.Stop, and Keep or KeepWith
	// (a panic is recovered and logged with its stack, the caller's bug,
	// as is a runtime.Goexit); a call of Shutdown waits for the handler
	// itself (see Shutdown). Calls for different leases may run at once
	// (the loop's and Shutdown's), and one may come before KeepWith has
	// returned (a Shutdown racing with it, a deadline already close). A
	// lease stopped before
	// the Keeper found it lost is never reported; but a Stop racing with
	// that finding may return before, or while, LeaseLost is called: a
	// handler must ignore a call for work it has finished.
	LeaseLost(cause error)
}

// Kept is a lease kept by KeepWith. The zero Kept keeps nothing.
type Kept struct {
	e *entry
}

// KeepWith keeps lease alive as Keep does, with the same schedule, the
// same extension calls (one Extend call per tick for every lease due,
// kept by Keep or by KeepWith) and the same guarantees, but without a
// context of its own: where Keep would cancel its context, KeepWith calls
// h.LeaseLost with the same cause. It is for a caller that runs many
// leases' work under one context of its own (a batch), which it cancels
// from h, and spares a context per lease. A lease's parent context is the
// caller's to watch: KeepWith has none.
//
// Stop the returned Kept once the work is done, as Keep's stop function:
// the Keeper then forgets the lease, extends it no more, and does not
// call h for it.
//
// It returns an error, and keeps nothing, where Keep would return a
// context already cancelled: the error is that context's cause (a lease
// it cannot keep, ErrInvalidLease; one past its deadline minus the
// margin, ErrLeaseUnconfirmed; a closed Keeper, ErrClosed). A nil h is an
// error too.
func (k *Keeper) KeepWith(lease lock.Lease, h LossHandler) (Kept, error) {
	if h == nil {
		return Kept{}, errors.New("heartbeat: KeepWith: nil LossHandler")
	}
	e := &entry{
		k:        k,
		lease:    lease,
		margin:   k.cfg.margin(lease.TTL),
		to:       h,
		deadline: lease.Deadline,
	}
	if err := e.check(); err != nil {
		return Kept{}, err
	}
	if err := k.start(e); err != nil {
		return Kept{}, err
	}
	return Kept{e: e}, nil
}

// Stop stops keeping the lease: the Keeper forgets it at once, extends it
// no more, and calls its LossHandler no more (see LossHandler for a call
// already under way). Stop is idempotent and cheap; on the zero Kept it
// does nothing.
func (kp Kept) Stop() {
	if kp.e != nil {
		kp.e.k.remove(kp.e)
	}
}

// Value returns, for the key LeaseFromContext looks up, the kept lease
// (nil for any other key, and on the zero Kept): a context type of the
// caller's that carries a KeepWith lease answers its Value calls with it
// first, so that LeaseFromContext finds the lease, its deadline the
// latest confirmed, as in a context from Keep.
func (kp Kept) Value(key any) any {
	if kp.e == nil || key != (leaseKey{}) {
		return nil
	}
	return kp.e
}

// start schedules e's first extension and registers it, or returns why
// it cannot: its deadline minus the margin passed already, or k is
// closed.
func (k *Keeper) start(e *entry) error {
	now := time.Now()
	if !now.Before(e.cancelAt()) {
		return e.lateToKeep()
	}
	iv := e.interval()
	e.due = e.deadline.Add(-e.lease.TTL + iv)
	e.early = e.due.Add(-iv / 2)

	k.mu.Lock()
	if k.closed {
		k.mu.Unlock()
		return ErrClosed
	}
	k.entries[e] = struct{}{}
	nudge := e.due.Before(k.nextWake) || e.cancelAt().Before(k.nextWake)
	k.mu.Unlock()
	if nudge {
		select {
		case k.wake <- struct{}{}:
		default:
		}
	}
	return nil
}

// Len returns the number of leases being kept.
func (k *Keeper) Len() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.entries)
}

// Shutdown stops the Keeper: every kept context is cancelled with ErrClosed,
// the running Extend call (if any) gets a cancelled context, and Shutdown
// waits for both goroutines to return or for ctx to be done, returning
// ctx.Err() in that case. A store whose Extend ignores its context keeps the
// extender goroutine until the call returns; it exits then without touching
// any lease. Shutdown is idempotent; later calls wait the same way (for
// the first call's LossHandlers too: the goroutines end after them).
//
// A LossHandler that calls Shutdown waits for the Keeper, which waits for
// it: that call returns ctx.Err() once ctx is done, never before, and the
// Keeper's goroutines end only after the handler returned. Call it on a
// goroutine of its own.
func (k *Keeper) Shutdown(ctx context.Context) error {
	// Not a sync.Once: a LossHandler that the first call runs may call
	// Shutdown, which must then wait (with its ctx) rather than block in
	// Do for good.
	k.mu.Lock()
	first := !k.closed
	k.closed = true
	entries := k.entries
	if first {
		k.entries = make(map[*entry]struct{})
	}
	k.mu.Unlock()
	if first {
		for e := range entries {
			e.lose(ErrClosed)
		}
		k.cancelBase()
		close(k.quit)
	}
	for _, done := range []chan struct{}{k.loopDone, k.extDone} {
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// remove unregisters e, if it is registered.
func (k *Keeper) remove(e *entry) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.entries, e)
}

// loop watches deadlines and hands due extensions to the extender. It is the
// only goroutine that changes an entry's schedule.
func (k *Keeper) loop() {
	defer close(k.loopDone)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	busy := false // the extender runs a batch
	for {
		var b *batch
		next := k.scan(busy, &b)
		if b != nil {
			busy = true
			k.batches <- b // never blocks: buffered, and the extender is idle
		}
		timer.Reset(time.Until(next))
		select {
		case <-k.quit:
			return
		case <-timer.C:
		case <-k.wake:
		case b := <-k.results:
			busy = false
			k.apply(b)
		}
	}
}

// scan cancels every lease past its deadline minus margin (and drops every
// lease whose context is done), collects the due leases into *out when the
// extender is idle, and returns when to look again.
func (k *Keeper) scan(busy bool, out **batch) time.Time {
	now := time.Now()
	next := now.Add(time.Hour)
	var b *batch
	var lost []*entry

	k.mu.Lock()
	for e := range k.entries {
		if e.ctx != nil && e.ctx.Err() != nil {
			delete(k.entries, e)
			continue
		}
		if cancelAt := e.cancelAt(); !now.Before(cancelAt) {
			delete(k.entries, e)
			lost = append(lost, e)
			continue
		} else if cancelAt.Before(next) {
			next = cancelAt
		}
		if e.inFlight || busy {
			continue
		}
		if !now.Before(e.early) {
			if b == nil {
				b = &batch{bound: e.deadline}
			}
			e.inFlight = true
			b.entries = append(b.entries, e)
			b.leases = append(b.leases, e.lease)
			if e.deadline.Before(b.bound) {
				b.bound = e.deadline
			}
			continue
		}
		if e.due.Before(next) {
			next = e.due
		}
	}
	k.nextWake = next
	var causes []error
	for _, e := range lost {
		causes = append(causes, e.unconfirmed(now, k.sentAt))
	}
	if b != nil {
		b.start = time.Now() // at or before the call is sent
		k.sentAt = b.start
	}
	k.mu.Unlock()

	for i, e := range lost {
		k.cfg.Logger.Warn(e.lossMessage("heartbeat: lease extension not confirmed"),
			keyAttrs(e.lease.Key), "fence", e.lease.Fence, "error", causes[i])
		e.lose(causes[i])
	}
	if b != nil {
		*out = b
	}
	return next
}

// apply records the answers of one Extend call.
func (k *Keeper) apply(b *batch) {
	now := time.Now()
	var lostEntries []*entry
	var lostErrs []error
	var failed int
	var firstErr error

	k.mu.Lock()
	for i, e := range b.entries {
		e.inFlight = false
		if _, ok := k.entries[e]; !ok {
			continue // stopped or cancelled meanwhile
		}
		var err error
		if i < len(b.errs) {
			err = b.errs[i]
		} else {
			err = fmt.Errorf("heartbeat: store answered %d of %d leases", len(b.errs), len(b.entries))
		}
		switch {
		case err == nil:
			// The server renewed the lease from its current
			// millisecond, rounded down: up to DeadlineSlack before
			// b.start.
			if d := b.start.Add(e.lease.TTL - lock.DeadlineSlack); d.After(e.deadline) {
				e.deadline = d
			}
			iv := e.interval()
			e.due = b.start.Add(iv)
			e.early = e.due.Add(-iv / 2)
			e.lastErr = nil
		case errors.Is(err, lock.ErrLeaseLost):
			delete(k.entries, e)
			lostEntries = append(lostEntries, e)
			lostErrs = append(lostErrs, err)
		case errors.Is(err, lock.ErrInvalidKey) || errors.Is(err, lock.ErrInvalidTTL):
			// Retrying cannot help: give the handler the reason now.
			delete(k.entries, e)
			lostEntries = append(lostEntries, e)
			lostErrs = append(lostErrs, fmt.Errorf("%w: %w", ErrInvalidLease, err))
		default:
			e.lastErr = err
			e.due = now.Add(max(e.lease.TTL/retryDivisor, minRetry))
			e.early = e.due
			failed++
			if firstErr == nil {
				firstErr = err
			}
		}
	}
	k.mu.Unlock()

	if failed > 0 {
		k.cfg.Logger.Warn("heartbeat: extending leases failed, retrying",
			"failed", failed, "batch", len(b.entries), "error", firstErr)
	}
	for i, e := range lostEntries {
		k.cfg.Logger.Warn(e.lossMessage("heartbeat: lease cannot be kept"),
			keyAttrs(e.lease.Key), "fence", e.lease.Fence, "error", lostErrs[i])
		e.lose(lostErrs[i])
	}
}

// extender runs one Extend call at a time.
func (k *Keeper) extender() {
	defer close(k.extDone)
	for {
		select {
		case <-k.quit:
			return
		case b := <-k.batches:
			b.errs = k.extend(b)
			select {
			case k.results <- b: // never blocks: buffered, one batch at a time
			case <-k.quit:
				return
			}
		}
	}
}

// extend makes b's Extend call, bounded by b.bound. A store whose Extend
// panics answers an error for every lease of b, as a store that does not
// answer does (the leases are tried again until they cannot be kept),
// rather than taking the process down with every handler it keeps.
func (k *Keeper) extend(b *batch) (errs []error) {
	ctx, cancel := context.WithDeadline(k.baseCtx, b.bound)
	defer cancel()
	defer func() {
		if v := recover(); v != nil {
			k.cfg.Logger.Error("heartbeat: the store's Extend panicked; its leases count as not extended",
				"leases", len(b.leases), "panic", v, "stack", string(debug.Stack()))
			err := fmt.Errorf("heartbeat: the store's Extend panicked: %v", v)
			errs = make([]error, len(b.leases))
			for i := range errs {
				errs[i] = err
			}
		}
	}()
	return k.store.Extend(ctx, b.leases...)
}

// lose tells e's holder, once e is unregistered, that its lease cannot be
// kept: Keep's context is cancelled with cause, KeepWith's LossHandler
// told. A LossHandler that panics is logged with its stack, as the
// caller's bug, rather than taking down the Keeper's goroutine (the
// process) or Shutdown's caller; one that calls runtime.Goexit ends its
// own goroutine only.
func (e *entry) lose(cause error) {
	if e.to == nil {
		e.cancel(cause)
		return
	}
	// On a goroutine of its own, waited for: a handler that calls
	// runtime.Goexit (t.Fatal in a test's handler) ends that goroutine,
	// not the Keeper's loop, which recover could not keep alive.
	var returned, panicked bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			if v := recover(); v != nil {
				panicked = true
				e.k.cfg.Logger.Error("heartbeat: a LossHandler panicked", keyAttrs(e.lease.Key), "fence", e.lease.Fence,
					"cause", cause, "panic", v, "stack", string(debug.Stack()))
			}
		}()
		e.to.LeaseLost(cause)
		returned = true
	}()
	<-done
	if !returned && !panicked {
		e.k.cfg.Logger.Error("heartbeat: a LossHandler called runtime.Goexit (t.Fatal or t.FailNow outside the test's goroutine?)",
			keyAttrs(e.lease.Key), "fence", e.lease.Fence, "cause", cause)
	}
}

// lossMessage is the warning about e's lease lost, what says it (why)
// followed by what lose does about it: a Keep lease's context is
// cancelled ("cancelling handler"), a KeepWith lease's LossHandler told
// (the Keeper cancels nothing; what the handler does is the caller's).
func (e *entry) lossMessage(why string) string {
	if e.to != nil {
		return why + ", telling its LossHandler"
	}
	return why + ", cancelling handler"
}

// check reports why e's lease cannot be kept.
func (e *entry) check() error {
	l := e.lease
	switch {
	case l.Key == "":
		return fmt.Errorf("%w: empty key", ErrInvalidLease)
	case len(l.Key) > lock.MaxKeyLen:
		return fmt.Errorf("%w: key is %d bytes, at most %d allowed", ErrInvalidLease, len(l.Key), lock.MaxKeyLen)
	case l.TTL < lock.MinTTL:
		return fmt.Errorf("%w: key %q: TTL %v is below the minimum %v", ErrInvalidLease, l.Key, l.TTL, lock.MinTTL)
	case e.margin >= l.TTL:
		return fmt.Errorf("%w: key %q: safety margin %v is not shorter than TTL %v", ErrInvalidLease, l.Key, e.margin, l.TTL)
	case l.Deadline.IsZero():
		return fmt.Errorf("%w: key %q: zero deadline (not from Acquire)", ErrInvalidLease, l.Key)
	}
	return nil
}

// Deadline returns the deadline of the kept context.
func (e *entry) Deadline() (time.Time, bool) { return e.ctx.Deadline() }

// Done returns the kept context's Done channel.
func (e *entry) Done() <-chan struct{} { return e.ctx.Done() }

// Err returns the kept context's error.
func (e *entry) Err() error { return e.ctx.Err() }

// Value returns e for leaseKey, else the kept context's value for key
// (its cancellation cause too, for context.Cause).
func (e *entry) Value(key any) any {
	if key == (leaseKey{}) {
		return e
	}
	return e.ctx.Value(key)
}

// String names the context, as context.WithValue's does.
func (e *entry) String() string {
	return fmt.Sprintf("%v.WithValue(heartbeat lease %q)", e.ctx, e.lease.Key)
}

// cancelAt is when e's context is cancelled unless an extension is confirmed.
func (e *entry) cancelAt() time.Time { return e.deadline.Add(-e.margin) }

// interval is the time from a confirmed extension's start to the next one:
// TTL/3, or half of what the margin leaves if that is shorter, so that a
// failed extension still has time for retries before cancelAt.
func (e *entry) interval() time.Duration {
	return max(min(e.lease.TTL/extendDivisor, (e.lease.TTL-e.margin)/2), time.Millisecond)
}

// unconfirmed is the cancellation cause for a lease past cancelAt at now;
// sentAt is when the running Extend call started.
func (e *entry) unconfirmed(now, sentAt time.Time) error {
	why := ""
	if e.inFlight {
		why += fmt.Sprintf(", extension unanswered for %v", now.Sub(sentAt).Round(time.Millisecond))
	}
	if e.lastErr != nil {
		why += fmt.Sprintf(", last error: %v", e.lastErr)
	}
	return fmt.Errorf("%w: key %q, local deadline %s, margin %v%s",
		ErrLeaseUnconfirmed, e.lease.Key, e.deadline.Format(time.RFC3339Nano), e.margin, why)
}

// lateToKeep is the cause of a lease whose deadline minus the margin had
// passed already when Keep was called: it is ErrLeaseUnconfirmed, but no
// extension was tried, and the error says so (its acquire answered late,
// a store stalled, say), lest an operator look for a failed extension.
func (e *entry) lateToKeep() error {
	return fmt.Errorf("%w: key %q: its local deadline %s (margin %v) had passed before it was kept, no extension tried: "+
		"its acquire answered late, or the handler started late",
		ErrLeaseUnconfirmed, e.lease.Key, e.deadline.Format(time.RFC3339Nano), e.margin)
}

// leaseKey is the context key for the lease.
type leaseKey struct{}

// WithLease returns a copy of ctx that carries lease, for LeaseFromContext.
// Keep does this itself; WithLease is for handlers run without a Keeper
// (tests, or a store call made with a fresh context).
func WithLease(ctx context.Context, lease lock.Lease) context.Context {
	return context.WithValue(ctx, leaseKey{}, lease)
}

// LeaseFromContext returns the lease carried by ctx, if any. For a context
// from Keep, the returned Deadline is the latest confirmed local deadline.
// Downstream writes should carry lease.Fence so that they can reject a stale
// holder.
func LeaseFromContext(ctx context.Context) (lock.Lease, bool) {
	switch v := ctx.Value(leaseKey{}).(type) {
	case *entry:
		v.k.mu.Lock()
		l := v.lease
		l.Deadline = v.deadline
		v.k.mu.Unlock()
		return l, true
	case lock.Lease:
		return v, true
	}
	return lock.Lease{}, false
}

// keyAttrs is how a lease's key is logged: a key of amqpidem's (the
// endpoint, a NUL byte, the message key: amqpidem.StoreKey) as endpoint=
// and key=, as amqpidem's own records log it; any other key as key=.
func keyAttrs(key string) slog.Attr {
	if endpoint, k, ok := strings.Cut(key, "\x00"); ok {
		return slog.Group("", slog.String("endpoint", endpoint), slog.String("key", k))
	}
	return slog.String("key", key)
}
