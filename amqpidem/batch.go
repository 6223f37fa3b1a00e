package amqpidem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

// Defaults of ConsumerConfig's batch fields (NewBatchConsumer).
const (
	// DefaultBatchSize is the most deliveries in one batch.
	DefaultBatchSize = 100
	// DefaultBatchWait is how long a batch waits for more deliveries
	// once its first one is ready to run.
	DefaultBatchWait = 10 * time.Millisecond
)

// BatchResult is a batch handler's answer for one message of its batch,
// as a Handler's return values are for one message: Err nil for success
// (Result stored, and sent to ReplyTo), a retryable error, or a Permanent
// one. Each message is then settled on its own, as the outcome table of
// the package documentation says for a single message.
type BatchResult struct {
	// Result is what is stored for the message, and sent to its ReplyTo,
	// when Err is nil.
	Result []byte
	// Err is the message's failure: retried with backoff, or
	// dead-lettered when Permanent or its attempts are exhausted.
	Err error
}

// BatchHandler handles the new messages of a batch together (see
// NewBatchConsumer). It answers per message, in the order of ds, like
// AWS Lambda's ReportBatchItemFailures: a nil slice means every message
// succeeded with no result; otherwise it must hold one BatchResult per
// delivery. A non-nil error, or a panic, is the batch's: none of its
// messages is taken as done, and the batch is split in halves, each run
// again on its own, down to single messages, whose error is then their
// own (retried with backoff, dead-lettered after MaxAttempts or when
// Permanent). So a poison message costs about log2(len(ds)) reruns of
// its neighbours, not their attempts.
//
// ctx is cancelled when the lease of any message of the batch is lost or
// could not be renewed, when HandlerTimeout passes (it bounds a batch),
// and on a forced shutdown. The deliveries must not be acked (amqpidem
// settles each). FromContext and Stage do not work on a batch's ctx
// itself: DeliveryContext(ctx, d) is the context of the message d, on
// which FromContext gives its Info and Stage stages messages with its
// outcome.
type BatchHandler interface {
	HandleBatch(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error)
}

// BatchHandlerFunc adapts a function to BatchHandler.
type BatchHandlerFunc func(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error)

// HandleBatch calls f.
func (f BatchHandlerFunc) HandleBatch(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error) {
	return f(ctx, ds)
}

// BatchItem is one message of a batch given to a BatchCompleter: its
// delivery and the lease under which its record is to be completed.
type BatchItem struct {
	// Delivery is the message, as the handler gets it (not to be acked).
	Delivery *amqp.Delivery
	// Lease is the lease its record is completed under.
	Lease lock.Lease
}

// BatchCompleter is a BatchHandler that completes the records of a
// batch's messages itself, in the transaction of its effects (pgstore's
// BatchTxHandler), instead of amqpidem completing each after it returns.
//
// HandleBatchComplete handles items and, for each message it answers with
// a nil Err, completes its record under its lease with value(i, result),
// where i is the message's index in items; value refuses (an error
// wrapping lock.ErrResultTooLarge) a result too large to store, which is
// then that message's Err. It returns, like HandleBatch, one BatchResult
// per item (or nil for all done, no results) and a batch error. A nil
// batch error means every record of an item answered with a nil Err was
// completed, with the effects, and committed; a non-nil one means nothing
// was committed, or, wrapping lock.ErrUnavailable, that whether the commit
// landed is unknown (the records tell). A record it found not held by its
// lease any more is a batch error wrapping lock.ErrLeaseLost, nothing
// committed. It never touches the records of items it answered with an
// error: amqpidem settles those.
type BatchCompleter interface {
	BatchHandler
	CompleterStore() lock.Store
	HandleBatchComplete(ctx context.Context, items []BatchItem, value func(i int, result []byte) ([]byte, error)) ([]BatchResult, error)
}

// A BatchLeaseTaker is a BatchCompleter that takes the leases of the
// deliveries gathered for a lease batch itself, so that what holds them
// can be the transaction HandleBatchComplete then commits in: one commit
// per batch instead of two (pgstore's BatchTxHandler). A batch consumer or
// WrapBatch whose handler is one calls AcquireLeaseBatch in place of the
// store's lock.BatchAcquirer AcquireBatch. Its answers mean what
// AcquireBatch's do, and each lease it grants is ended as any other: by
// HandleBatchComplete, or by the store's Complete, Fail, Release or
// Cancel, one of which amqpidem always calls. A batch given to
// HandleBatchComplete holds the leases of one AcquireLeaseBatch call (or
// some of them: the others settled before it ran, or, late for its
// BatchWait, run in a batch of their own). A panic is an error for each
// request, as the store's AcquireBatch's is.
type BatchLeaseTaker interface {
	BatchCompleter
	// AcquireLeaseBatch answers as CompleterStore()'s AcquireBatch(ctx,
	// reqs) does: one result and one error per request, in order; ds[i]
	// is the delivery reqs[i] is for (whether it was redelivered, say).
	AcquireLeaseBatch(ctx context.Context, reqs []lock.Request, ds []*amqp.Delivery) ([]lock.Result, []error)
}

// BatchInfo describes one batch a batch consumer ran, for a
// BatchObserver.
type BatchInfo struct {
	// Queue is the consumer's queue (Config.Queue).
	Queue string
	// Size is how many deliveries the batch gathered: those whose
	// handler was to run.
	Size int
	// Runs is how many times the consumer called its BatchHandler for
	// it: 1, or more when a batch error split it or a lost lease made it
	// run again without some of its messages. A handler that calls your
	// function again within one call counts as one run: pgstore's
	// BatchTxHandler does, without the messages your function answered
	// failed for, so your function may have been called more times than
	// Runs says.
	Runs int
	// Duration is how long the batch took from the end of its gathering
	// to its records' completion (the handler's runs, the transaction,
	// CompleteBatch), before its messages were settled with the broker.
	Duration time.Duration
}

// BatchObserver is an Observer that is also told of every batch a batch
// consumer runs (promamqpidem and otelamqpidem record its size and
// duration). ObserveBatch is called synchronously by the batch's leader
// once the batch has run, before its messages are settled, and must be
// fast; each message is still observed on its own (Observe). A panic in
// it is logged.
type BatchObserver interface {
	Observer
	ObserveBatch(ctx context.Context, b BatchInfo)
}

// ObserveBatch tells those of m that are BatchObservers of b.
func (m multiObserver) ObserveBatch(ctx context.Context, b BatchInfo) {
	m.each(func(o Observer) {
		if bo, ok := o.(BatchObserver); ok {
			bo.ObserveBatch(ctx, b)
		}
	})
}

// observeBatch logs the batch that ran, at debug, and tells the
// Observer, if it is a BatchObserver.
func (p *processor) observeBatch(ctx context.Context, b BatchInfo) {
	p.cfg.Logger.DebugContext(ctx, "amqpidem: batch ran", "queue", b.Queue, "size", b.Size, "runs", b.Runs, "duration", b.Duration)
	bo, ok := p.cfg.Observer.(BatchObserver)
	if !ok {
		return
	}
	defer func() {
		if v := recover(); v != nil {
			p.cfg.Logger.ErrorContext(ctx, "amqpidem: Observer panicked", "queue", b.Queue, "op", "batch",
				"panic", v, "stack", string(debug.Stack()))
		}
	}()
	bo.ObserveBatch(ctx, b)
}

// batchOnly is the Handler of a batch consumer: it runs a message that
// has no lease (ProcessMissingKey, FailOpen) as a batch of one.
type batchOnly struct {
	h BatchHandler
	// slots is the batcher's (nil for none): a batch of one runs in one,
	// as any batch, so that the batches at once stay what the pool check
	// counts on.
	slots chan struct{}
}

func (b batchOnly) Handle(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	if b.slots != nil {
		select {
		case b.slots <- struct{}{}:
			defer func() { <-b.slots }()
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
	rs, err := b.h.HandleBatch(ctx, []*amqp.Delivery{d})
	switch {
	case err != nil:
		return nil, err
	case len(rs) == 0:
		return nil, nil
	case len(rs) != 1:
		return nil, fmt.Errorf("amqpidem: HandleBatch returned %d results for 1 message", len(rs))
	}
	return rs[0].Result, rs[0].Err
}

// batcher gathers the flights whose handler is to run (their lease taken
// and kept) into batches, and, when the store is a lock.BatchAcquirer,
// the lease requests of arriving deliveries into one call. It starts no
// goroutine: the first of a group, its leader, waits for the others (up
// to size, or wait), makes the group's call on its own goroutine and
// then wakes them; each flight settles itself.
type batcher struct {
	h    BatchHandler
	bc   BatchCompleter     // h, when it completes records itself
	ba   lock.BatchAcquirer // the store, when it takes leases in batches
	bt   BatchLeaseTaker    // h, when it takes them itself (in place of ba)
	size int
	wait time.Duration
	// slots bounds the batches running at once (NewBatchConsumer: one
	// per BatchSize of Concurrency, rounded up, what its pool check
	// counts on); nil for none (WrapBatch).
	slots chan struct{}

	runs gathering[*flight]
	acqs gathering[*acquireCall]

	// With leases taken in batches, the flights on their way from a
	// lease batch to a run batch, guarded by runs.mu: leasing, those
	// whose AcquireBatch call is being made; leased, those it answered
	// that have not joined a run batch or gone another way yet
	// (flight.arrived). A run batch waits for those (gatherRun), so
	// that the deliveries of one lease batch are not split in two run
	// batches, each a transaction of its own, for want of CPU to bring
	// them there within the run batch's wait.
	leasing, leased int
	// parked are the run batches being gathered of a BatchLeaseTaker's
	// other lease batches, by lease batch, guarded by runs.mu: a flight
	// of another lease batch than the open group's parks it (and takes
	// up its own lease batch's, if parked), so that lease batches whose
	// flights arrive interleaved still run one run batch each.
	parked map[*group[*acquireCall]]*group[*flight]

	// lossMu guards each flight's lost and cancelRun (runKept), and
	// closed: a lease lost is told by the keeper's goroutine, a run
	// started and ended by its batch's leader.
	lossMu sync.Mutex
	// closed is the cause (heartbeat.ErrClosed) of the first lease the
	// Keeper's Shutdown told lost, nil before: the Keeper keeps no lease
	// any more, so every flight counts as lost with it (leaseLost),
	// those it has not told yet too. Shutdown tells the leases one after
	// the other, and a run the first loss cancels would otherwise run
	// again with the others, work that cannot commit, until their turn.
	closed error
}

// maxPrealloc is the most items a group's slice is allocated for before
// any join: DefaultBatchSize's, and then some.
const maxPrealloc = 128

// gathering collects items into groups of at most size.
type gathering[T any] struct {
	mu   sync.Mutex
	open *group[T] // the group being gathered, if any
}

// group is one group being gathered, then handled by its leader.
type group[T any] struct {
	items []T
	full  chan struct{} // closed when it has size items, or is sealed early (batcher.arrived)
	done  chan struct{} // closed by the leader once every item is answered
	// late: its leader's wait passed while flights were still on their
	// way to it from a lease batch (batcher.leased): it is sealed as
	// soon as none is.
	late bool
	// from is the lease batch of a run batch's flights, when the handler
	// is a BatchLeaseTaker: one run batch, one lease batch.
	from *group[*acquireCall]
}

// join adds x to the group being gathered, or starts one with x's caller
// as its leader.
func (g *gathering[T]) join(x T, size int) (gr *group[T], leader bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.joinLocked(x, size)
}

// joinLocked is join, with g.mu held.
func (g *gathering[T]) joinLocked(x T, size int) (gr *group[T], leader bool) {
	if g.open == nil {
		// Its items are gathered in one allocation, not grown to size
		// (up to maxPrealloc: a large BatchSize is not paid for by
		// every batch of a few).
		g.open = &group[T]{items: make([]T, 0, min(size, maxPrealloc)), full: make(chan struct{}), done: make(chan struct{})}
		leader = true
	}
	gr = g.open
	gr.items = append(gr.items, x)
	if len(gr.items) >= size {
		close(gr.full)
		g.open = nil
	}
	return gr, leader
}

// gather is the leader's wait: until gr is full, wait has passed, or
// stop or done is closed; it then seals gr (no more joins) and returns
// its items.
func (g *gathering[T]) gather(gr *group[T], wait time.Duration, stop, done <-chan struct{}) []T {
	t := time.NewTimer(wait)
	select {
	case <-gr.full:
	case <-t.C:
	case <-stop:
	case <-done:
	}
	t.Stop()
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.open == gr {
		g.open = nil
	}
	return gr.items
}

// sealLocked ends the gathering of the open group, if any, with g.mu
// held: it runs with what it has.
func (g *gathering[T]) sealLocked() {
	if g.open != nil {
		close(g.open.full)
		g.open = nil
	}
}

// batchOut is what a batch came to for one of its flights.
type batchOut struct {
	result []byte
	err    error
	// completed: a BatchCompleter committed its record with the batch.
	completed bool
	// timedOut: the batch it ran in alone was cut off by HandlerTimeout.
	timedOut bool
	// completeErr is the store's answer for good when completeBatch
	// could not complete its record (lock.ErrLeaseLost,
	// lock.ErrResultTooLarge).
	completeErr error
	// staged is what the message staged (DeliveryContext), to be stored
	// with its result; stored is the value its record was completed with
	// when it holds staged messages (nStaged of them), to publish them.
	staged  [][]byte
	stored  []byte
	nStaged int
}

// acquireCall is one lease request waiting for its group's AcquireBatch.
type acquireCall struct {
	// from is the lease batch (AcquireBatch or AcquireLeaseBatch call)
	// the lease was asked for in, once answered.
	from *group[*acquireCall]
	req  lock.Request
	d    *amqp.Delivery // the delivery req is for
	res  lock.Result
	err  error
}

// acquireBatched takes the lease of c.req with the requests of the
// deliveries arriving with it, in one AcquireBatch call of at most
// BatchSize requests, made within BatchWait of the first, and answers it
// (also in c).
func (p *processor) acquireBatched(ctx context.Context, c *acquireCall) (lock.Result, error) {
	b := p.batch
	gr, leader := b.acqs.join(c, b.size)
	if !leader {
		<-gr.done
		return c.res, c.err
	}
	calls := b.acqs.gather(gr, b.wait, p.stopping, ctx.Done())
	reqs := make([]lock.Request, len(calls))
	ds := make([]*amqp.Delivery, len(calls))
	for i, c := range calls {
		reqs[i], ds[i] = c.req, c.d
	}
	b.runs.mu.Lock()
	b.leasing += len(calls)
	b.runs.mu.Unlock()
	func() {
		defer func() {
			if v := recover(); v != nil {
				what := "the store's AcquireBatch"
				if b.bt != nil {
					what = "BatchLeaseTaker.AcquireLeaseBatch"
				}
				err := fmt.Errorf("amqpidem: %s panicked: %w", what, &PanicError{Value: v, Stack: debug.Stack()})
				for _, c := range calls {
					c.res, c.err = lock.Result{}, err
				}
			}
		}()
		var rs []lock.Result
		var errs []error
		if b.bt != nil {
			rs, errs = b.bt.AcquireLeaseBatch(ctx, reqs, ds)
		} else {
			rs, errs = b.ba.AcquireBatch(ctx, reqs)
		}
		for i, c := range calls {
			c.from = gr
			if len(rs) != len(calls) || len(errs) != len(calls) {
				c.err = fmt.Errorf("amqpidem: the store's AcquireBatch answered %d results for %d requests", len(rs), len(calls))
				continue
			}
			c.res, c.err = rs[i], errs[i]
		}
	}()
	// Each of calls is now on its way (flight.arrived).
	b.runs.mu.Lock()
	b.leasing -= len(calls)
	b.leased += len(calls)
	b.runs.mu.Unlock()
	close(gr.done)
	return c.res, c.err
}

// runKept is run for a batch consumer's flight: its lease is kept
// without a context of its own (heartbeat.Keeper.KeepWith, one allocation
// rather than a context, its cancel function and a stop function), the
// flight told of its loss (batchLoss), and the flight joins a batch
// (runBatched). Its hctx is the flight as its own context (handlerCtx),
// cancelled, as a single message's is, when its lease is lost and when
// its keep stops; a lost lease also takes it out of its batch and
// cancels the batch run it is in, and is what it settles by
// (settleBatched).
func (f *flight) runKept() {
	p := f.p
	if f.attemptsExhausted() {
		return
	}
	f.hctx = f.ctx
	kept, err := p.keeper.KeepWith(f.lease, (*batchLoss)(f))
	if stopping := p.isStopping(); stopping || err != nil || f.ctx.Err() != nil {
		kept.Stop()
		f.notStarted(stopping, cmp.Or(err, context.Cause(f.ctx)))
		return
	}
	f.kept, f.keptCtx = kept, kept
	// Its execution, for FromContext on hctx: its Info, and an outbox
	// sealed (Stage refuses: a batch's messages stage on their
	// DeliveryContext, the runs' executions). Part of the flight.
	f.x = execution{info: Info{Queue: p.cfg.Queue, Key: f.ev.Key, Attempt: f.attempt, Fence: f.lease.Fence}}
	f.x.outbox.sealed = true
	f.hctx = (*handlerCtx)(f)
	f.runBatched()
}

// handlerCtx is a batch consumer's flight as its handler's context
// (hctx), what HandlerObserver's calls get for it: a context of its own,
// as a single message's is, so that an observer can tell the messages of
// a batch apart by it (promamqpidem's oldest handler), where their ctx is
// one (a Consumer's session's). It carries the flight's lease
// (heartbeat.LeaseFromContext), its Info (FromContext, as a single
// message's execution does; Stage on it answers ErrNoOutbox) and ctx's
// values, and is done when ctx
// is, when the lease is lost (its cause the loss's, as a Keep context's)
// and once the keep stops (context.Canceled, as a Keep context's stop
// cancels it). It is the flight itself until a context of its own is
// needed (own): a Done asked for, the lease lost or the keep stopped;
// then that context, derived from ctx, answers. No allocation while none
// is asked for.
type handlerCtx flight

// own returns the flight's handler context of its own, nil while ctx
// answers for it: made when mk says so (Done), or once its lease was
// lost or its keep stopped, cancelled then with why.
func (c *handlerCtx) own(mk bool) context.Context {
	f := (*flight)(c)
	b := f.p.batch
	b.lossMu.Lock()
	defer b.lossMu.Unlock()
	if f.ownCtx == nil && (mk || f.lost != nil || f.ended) {
		f.ownCtx, f.cancelOwn = context.WithCancelCause(f.ctx)
		switch {
		case f.lost != nil:
			f.cancelOwn(f.lost)
		case f.ended:
			f.cancelOwn(nil)
		}
	}
	return f.ownCtx
}

// end cancels the handler context once the flight's keep stopped
// (stopKeep): made already, it is cancelled now, which frees it from
// ctx; else own makes it cancelled when asked.
func (c *handlerCtx) end() {
	f := (*flight)(c)
	b := f.p.batch
	b.lossMu.Lock()
	f.ended = true
	cancel := f.cancelOwn
	b.lossMu.Unlock()
	if cancel != nil {
		cancel(nil)
	}
}

// Deadline returns the flight's ctx's deadline. HandlerTimeout's is not
// it: that bounds each run of the batch (the run's context carries it),
// and hctx spans every run (a split runs a flight again, under a fresh
// timeout), so that no one deadline, with Done closed when it passes,
// would be true of it.
func (c *handlerCtx) Deadline() (time.Time, bool) { return c.ctx.Deadline() }

// Done returns a channel closed when the flight's ctx is done, its lease
// lost or its keep stopped.
func (c *handlerCtx) Done() <-chan struct{} { return c.own(true).Done() }

// Err returns why the handler context is done, nil while it is not.
func (c *handlerCtx) Err() error {
	if o := c.own(false); o != nil {
		return o.Err()
	}
	return c.ctx.Err()
}

// Value returns the flight's kept lease for heartbeat's key, its
// execution (x) for FromContext's, else the value of the handler context
// for key (its cancellation cause too, for context.Cause).
func (c *handlerCtx) Value(key any) any {
	if v := c.keptCtx.Value(key); v != nil {
		return v
	}
	if key == (executionKey{}) {
		return &c.x
	}
	if o := c.own(false); o != nil {
		return o.Value(key)
	}
	return c.ctx.Value(key)
}

// batchLoss is a batch consumer's flight as the heartbeat.LossHandler of
// its lease (runKept).
type batchLoss flight

// LeaseLost records cause as why the flight's lease was lost, which takes
// it out of its batch (runBatch), and cancels its handler context, if
// made (handlerCtx.own makes it cancelled otherwise), and the batch run
// it is in, if any, with cause.
func (l *batchLoss) LeaseLost(cause error) {
	f := (*flight)(l)
	if lossHook != nil {
		lossHook(f, cause)
	}
	b := f.p.batch
	b.lossMu.Lock()
	if f.lost == nil {
		f.lost = cause
	}
	if b.closed == nil && errors.Is(cause, heartbeat.ErrClosed) {
		b.closed = cause
	}
	cancel, cancelOwn := f.cancelRun, f.cancelOwn
	b.lossMu.Unlock()
	if cancelOwn != nil {
		cancelOwn(cause)
	}
	if cancel != nil {
		cancel(cause)
	}
}

// stopped is why f must not run (or run on) in a batch: its lease lost,
// or its ctx done (a forced stop; with WrapBatch, its Handle call's ctx
// ending); nil for neither.
func (f *flight) stopped() error {
	if err := f.leaseLost(); err != nil {
		return err
	}
	if f.ctx.Err() != nil {
		return context.Cause(f.ctx)
	}
	return nil
}

// leaseLost is why f's lease was lost, nil while it is kept: the
// Keeper's Shutdown (batcher.closed) counts for every flight, told yet or
// not.
func (f *flight) leaseLost() error {
	b := f.p.batch
	b.lossMu.Lock()
	defer b.lossMu.Unlock()
	return cmp.Or(f.lost, b.closed)
}

// lossHook, when set (by tests, before any flight runs), is called by
// each flight's LeaseLost before it records the loss.
var lossHook func(f *flight, cause error)

// runJoinHook, when set (by tests, before any flight runs), is called by
// each flight of a batch consumer before it joins a run batch.
var runJoinHook func(f *flight)

// leaseBatch is the lease batch f's lease was asked for in, nil when
// none (its lease was not batched, or not asked for yet).
func (f *flight) leaseBatch() *group[*acquireCall] {
	if f.acq == nil {
		return nil
	}
	return f.acq.from
}

// runBatched is run's second half for a batch consumer: f joins a batch
// and waits for it (or gathers and runs it, as its leader), then settles
// by what the batch came to for it.
func (f *flight) runBatched() {
	p := f.p
	b := p.batch
	if runJoinHook != nil {
		runJoinHook(f)
	}
	f.ready.Add(1)
	b.runs.mu.Lock()
	if open := b.runs.open; b.bt != nil && open != nil && open.from != f.leaseBatch() {
		// A BatchLeaseTaker's leases of two lease batches (two sessions,
		// say) never run as one batch: the batch being gathered is
		// parked, still gathering its own lease batch's flights.
		if b.parked == nil {
			b.parked = map[*group[*acquireCall]]*group[*flight]{}
		}
		b.parked[open.from] = open
		b.runs.open = nil
	}
	if g := b.parked[f.leaseBatch()]; b.bt != nil && b.runs.open == nil && g != nil {
		delete(b.parked, f.leaseBatch())
		b.runs.open = g
	}
	gr, leader := b.runs.joinLocked(f, b.size)
	if leader {
		gr.from = f.leaseBatch()
	}
	b.arrivedLocked(f)
	b.runs.mu.Unlock()
	if leader {
		// A batch runs when one of its slots is free: batches of few
		// deliveries, arriving apart, would otherwise run as many at once
		// as Concurrency, each holding a pooled connection. While it waits,
		// its group may still gather (until full, or sealed: arrivedLocked).
		// Only a forced stop (f.ctx) ends the wait: the batch's flights
		// then settle without running.
		if a, ok := f.d.Acknowledger.(*acker); ok {
			// Its channel's acks settle a batch at a time.
			a.holdBatches()
		}
		slot := false
		if b.slots != nil {
			select {
			case b.slots <- struct{}{}:
				slot = true
			case <-f.ctx.Done():
			}
		}
		fs := b.gatherRun(gr, p.stopping, f.ctx.Done())
		start := time.Now()
		// The batch is the group's, not its leader's: with WrapBatch, the
		// leader's ctx is its own Handle call's, and a batch run under it
		// after it ended would fail for the others. Each flight's lease
		// lost, or its ctx done (a forced shutdown), cancels the batch it
		// is in (callBatch).
		bctx := context.WithoutCancel(f.ctx)
		runs := p.runBatch(bctx, fs, f.settleRun, true)
		p.completeBatch(bctx, fs)
		if slot {
			<-b.slots
		}
		p.observeBatch(bctx, BatchInfo{Queue: p.cfg.Queue, Size: len(fs), Runs: runs, Duration: time.Since(start)})
		f.settleRun(fs)
		close(gr.done)
		return
	}
	f.ready.Wait()
	f.settleBatched()
}

// settleRun is called by leader, the leader of a run batch, with flights
// of it whose out is final: each settles now (the leader's own flight
// on the leader's goroutine), once. The leader calls it with the
// flights whose records a part of the batch committed as that part
// commits, and with all of them once the batch is over.
func (leader *flight) settleRun(fs []*flight) {
	self := false
	for _, f := range fs {
		if f.released {
			continue
		}
		f.released = true
		if f == leader {
			self = true
			continue
		}
		f.ready.Done()
	}
	if self {
		leader.settleBatched()
	}
}

// arrived tells f's batcher that f, whose lease was asked for in a
// lease batch, is no longer on its way to a run batch: it joined one, or
// goes another way (its store answer, its attempts, a lost lease). Once
// called, later calls do nothing.
func (f *flight) arrived() {
	if !f.leaseBatched {
		return
	}
	b := f.p.batch
	b.runs.mu.Lock()
	b.arrivedLocked(f)
	b.runs.mu.Unlock()
}

// arrivedLocked is arrived, with b.runs.mu held. The run batch being
// gathered runs at once when no flight is on its way to it any more: none
// of an answered lease batch, none in an AcquireBatch call (or its wait
// passed while some were: late).
func (b *batcher) arrivedLocked(f *flight) {
	if !f.leaseBatched {
		return
	}
	f.leaseBatched = false
	b.leased--
	if b.leased != 0 {
		return
	}
	if open := b.runs.open; open != nil && (b.leasing == 0 || open.late) {
		b.runs.sealLocked()
	}
	for from, g := range b.parked {
		if b.leasing == 0 || g.late {
			close(g.full)
			delete(b.parked, from)
		}
	}
}

// gatherRun is the wait of gr's leader: gr runs when it is full, or
// sealed because no flight is on its way to it (arrivedLocked), or when
// its wait passed, or stop or done is closed. The wait is BatchWait, or,
// with leases taken in batches, a fifth of it: the deliveries of one lease
// batch come together, having waited BatchWait for their lease already.
// When that fifth passes while flights of an answered lease batch are
// still on their way, gr waits for them (the machine busy, they are
// late), up to BatchWait in all, rather than split their lease batch in
// two transactions.
func (b *batcher) gatherRun(gr *group[*flight], stop, done <-chan struct{}) []*flight {
	if b.ba == nil && b.bt == nil {
		return b.runs.gather(gr, b.wait, stop, done)
	}
	short := b.wait / 5
	t := time.NewTimer(short)
	defer t.Stop()
	select {
	case <-gr.full:
	case <-stop:
	case <-done:
	case <-t.C:
		b.runs.mu.Lock()
		wait := (b.runs.open == gr || b.parked[gr.from] == gr) && b.leased > 0
		if wait {
			gr.late = true
		}
		b.runs.mu.Unlock()
		if !wait {
			break
		}
		t.Reset(b.wait - short)
		select {
		case <-gr.full:
		case <-t.C:
		case <-stop:
		case <-done:
		}
	}
	b.runs.mu.Lock()
	defer b.runs.mu.Unlock()
	if b.runs.open == gr {
		b.runs.open = nil
	}
	if b.parked[gr.from] == gr {
		delete(b.parked, gr.from)
	}
	return gr.items
}

// runBatch runs the flights fs as one batch and sets each one's out. A
// flight whose lease was lost (or the consumer forced to stop) before or
// during the batch is taken out of it, and the rest run again without
// it (none does once the Keeper was shut down: each counts as lost,
// leaseLost); a batch error splits the batch in halves, each run again, down to
// single flights, whose out is then that error. A BatchCompleter's commit
// whose outcome is unknown (lock.ErrUnavailable) is not run again: each
// flight settles as "store unavailable". last says that no other part
// of the batch runs after fs; settle settles flights of a part that is
// not last as soon as their records commit. It returns how many times it
// called the handler.
func (p *processor) runBatch(ctx context.Context, fs []*flight, settle func([]*flight), last bool) (runs int) {
	for len(fs) > 0 {
		live := make([]*flight, 0, len(fs))
		for _, f := range fs {
			if err := f.stopped(); err != nil {
				f.out = batchOut{err: err}
				continue
			}
			live = append(live, f)
		}
		if len(live) == 0 {
			return runs
		}
		runs++
		rs, err, timedOut, run := p.callBatch(ctx, live)
		if err == nil {
			for i, f := range live {
				f.out = batchOut{completed: p.batch.bc != nil, staged: run.staged[i], stored: run.stored[i], nStaged: run.nStaged[i]}
				if rs != nil {
					f.out.result, f.out.err = rs[i].Result, rs[i].Err
					f.out.completed = f.out.completed && rs[i].Err == nil
				}
				if f.out.completed {
					// Its record committed with this run: the lease is
					// over, and renewing it while the rest of a split
					// batch runs would be refused, warned about as a
					// lease lost. settleBatched stops it too.
					f.stopKeep()
				}
			}
			if !last && p.batch.bc != nil {
				// Part of a split batch, other parts still to run: the
				// messages whose records committed settle now (published,
				// acked) rather than after those runs, which may take
				// longer than their outbox claim. The others settle with
				// the batch: their ends are store calls on its leases.
				var done []*flight
				for _, f := range live {
					if f.out.completed {
						done = append(done, f)
					}
				}
				settle(done)
			}
			return runs
		}
		// A commit whose outcome is unknown may have landed: running any
		// of its flights again could commit their effects twice, so each
		// settles on its own, the record deciding its redelivery.
		unknown := p.batch.bc != nil && errors.Is(err, lock.ErrUnavailable) && !IsPermanent(err)
		lost := false
		for _, f := range live {
			lost = lost || f.stopped() != nil
		}
		switch {
		case unknown || len(live) == 1:
			for _, f := range live {
				f.out = batchOut{err: err, timedOut: timedOut && len(live) == 1}
			}
			return runs
		case lost:
			fs = live // the lost ones are taken out, the rest run again
			continue
		}
		mid := len(live) / 2
		runs += p.runBatch(ctx, live[:mid], settle, false)
		fs = live[mid:]
	}
	return runs
}

// completeBatch completes, in one store call, the records of the flights
// of fs that succeeded, when the store is a lock.BatchCompleter and the
// handler is not a BatchCompleter (which committed them with its
// effects). A flight whose record CompleteBatch answered for good (nil,
// lock.ErrLeaseLost or lock.ErrResultTooLarge) settles by that answer; one
// it could not answer completes its record alone (settle's retries,
// which a record already completed by this lease answers nil).
func (p *processor) completeBatch(ctx context.Context, fs []*flight) {
	cs, _ := p.given.(lock.BatchCompleter)
	if cs == nil || p.batch.bc != nil {
		return
	}
	// Each slice in one allocation, not grown to len(fs).
	done := make([]*flight, 0, len(fs))
	leases := make([]lock.Lease, 0, len(fs))
	values := make([][]byte, 0, len(fs))
	for _, f := range fs {
		if f.out.err != nil || f.out.completed {
			continue
		}
		v, err := p.batchValue(f, f.out.result, f.out.staged)
		if err != nil {
			f.out.err = err // settled as "result too large"
			continue
		}
		// Kept also for the record CompleteBatch cannot answer for: it is
		// completed alone with this same value (settleBatched).
		f.out.stored, f.out.nStaged = v, len(f.out.staged)
		done, leases, values = append(done, f), append(leases, f.lease), append(values, v)
	}
	if len(done) == 0 {
		return
	}
	start := time.Now()
	errs := p.callCompleteBatch(ctx, cs, leases, values)
	if o, ok := p.store.(*observedStore); ok {
		o.report(ctx, "complete", start, len(leases), errs...)
	}
	for i, f := range done {
		var err error
		if len(errs) == len(done) {
			err = errs[i]
		} else {
			err = fmt.Errorf("amqpidem: the store's CompleteBatch answered %d errors for %d leases", len(errs), len(done))
		}
		switch {
		case err == nil:
			f.out.completed = true
		case errors.Is(err, lock.ErrLeaseLost), errors.Is(err, lock.ErrResultTooLarge):
			f.out.completeErr = err
		}
	}
}

// callCompleteBatch calls the store's CompleteBatch. A panic is logged and
// answers no record (an error wrapping a *PanicError for each): the
// flights then complete their records alone (settleBatched), and the
// batch's leader goes on to close its group, whose other flights would
// otherwise wait for it for ever, their leases kept alive.
func (p *processor) callCompleteBatch(ctx context.Context, cs lock.BatchCompleter, leases []lock.Lease, values [][]byte) (errs []error) {
	defer func() {
		if v := recover(); v != nil {
			err := fmt.Errorf("amqpidem: the store's CompleteBatch panicked: %w", &PanicError{Value: v, Stack: debug.Stack()})
			p.cfg.Logger.ErrorContext(ctx, "amqpidem: the store's CompleteBatch panicked; each record is completed alone",
				"queue", p.cfg.Queue, "records", len(leases), "panic", v)
			errs = make([]error, len(leases))
			for i := range errs {
				errs[i] = err
			}
		}
	}()
	return cs.CompleteBatch(context.WithoutCancel(ctx), leases, values)
}

// callBatch runs the batch handler on fs, under a context cancelled when
// any of their leases is lost (or they are forced to stop) and bounded by
// HandlerTimeout; a panic is the batch's error, a *PanicError, and so are
// results that do not match the batch. timedOut says whether
// HandlerTimeout cut it off.
func (p *processor) callBatch(ctx context.Context, fs []*flight) (rs []BatchResult, err error, timedOut bool, run *batchRun) {
	bctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// A lease lost cancels the run its flight is in (batchLoss): each
	// flight points at this run while it runs; one lost before that
	// cancels it now.
	b := p.batch
	var lost error
	b.lossMu.Lock()
	for _, f := range fs {
		f.cancelRun = cancel
		lost = cmp.Or(lost, f.lost)
	}
	b.lossMu.Unlock()
	defer func() {
		b.lossMu.Lock()
		for _, f := range fs {
			f.cancelRun = nil
		}
		b.lossMu.Unlock()
	}()
	if lost != nil {
		cancel(lost)
	}
	// A flight's ctx done (a forced stop, a Handle call's ctx ending)
	// cancels the run too: one context.AfterFunc per ctx that can be done,
	// not per flight, where flights share one (a Consumer's session's).
	var stops []func() bool
	var dones []<-chan struct{}
	for _, f := range fs {
		done := f.ctx.Done()
		if done == nil || slices.Contains(dones, done) {
			continue
		}
		dones = append(dones, done)
		fctx := f.ctx
		stops = append(stops, context.AfterFunc(fctx, func() { cancel(context.Cause(fctx)) }))
	}
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	if p.cfg.HandlerTimeout > 0 {
		var c context.CancelFunc
		bctx, c = context.WithTimeoutCause(bctx, p.cfg.HandlerTimeout, ErrHandlerTimeout)
		defer c()
	}
	ds := make([]*amqp.Delivery, len(fs))
	cs := make([]amqp.Delivery, len(fs)) // the copies handlerDelivery makes, in one allocation
	for i, f := range fs {
		cs[i] = *f.d
		cs[i].Acknowledger = refuseAck{}
		ds[i] = &cs[i]
		p.handlerStarted(f.hctx, Info{Queue: p.cfg.Queue, Key: f.ev.Key, Attempt: f.attempt, Fence: f.lease.Fence})
	}
	run, bctx = p.newBatchRun(bctx, fs, ds)
	start := time.Now()
	func() {
		defer func() {
			if v := recover(); v != nil {
				rs, err = nil, &PanicError{Value: v, Stack: debug.Stack()}
			}
		}()
		if p.batch.bc == nil {
			rs, err = p.batch.h.HandleBatch(bctx, ds)
			return
		}
		items := make([]BatchItem, len(fs))
		for i, f := range fs {
			items[i] = BatchItem{Delivery: ds[i], Lease: f.lease}
		}
		rs, err = p.batch.bc.HandleBatchComplete(bctx, items, func(i int, result []byte) ([]byte, error) {
			staged := run.seal(i)
			v, err := p.batchValue(fs[i], result, staged)
			run.stored[i], run.nStaged[i] = v, len(staged)
			return v, err
		})
	}()
	run.staged = run.sealAll()
	for _, f := range fs {
		f.ev.Handler += time.Since(start)
		p.handlerEnded(f.hctx, Info{Queue: p.cfg.Queue, Key: f.ev.Key, Attempt: f.attempt, Fence: f.lease.Fence})
	}
	if err == nil && rs != nil && len(rs) != len(fs) {
		// A BatchCompleter checks this before it commits.
		err = fmt.Errorf("amqpidem: HandleBatch returned %d results for %d messages", len(rs), len(fs))
	}
	return rs, err, errors.Is(context.Cause(bctx), ErrHandlerTimeout), run
}

// batchValue is the value stored for f's result and the messages it
// staged: as runCompleter's value makes it.
func (p *processor) batchValue(f *flight, result []byte, staged [][]byte) ([]byte, error) {
	var claim int64
	if len(staged) > 0 {
		claim = f.claim()
	}
	stored := encodeValue(f.d.ReplyTo, result, staged, claim)
	if len(result) > p.cfg.MaxResultSize || len(stored) > p.valueLimit {
		return nil, fmt.Errorf("%w: a result of %d bytes (at most %d allowed) and %d staged messages make %d bytes, at most %d allowed",
			lock.ErrResultTooLarge, len(result), p.cfg.MaxResultSize, len(staged), len(stored), p.valueLimit)
	}
	return stored, nil
}

// settleBatched settles f by what its batch came to (f.out), as run and
// runCompleter settle a single message.
func (f *flight) settleBatched() {
	o := f.out
	f.freeSlot()
	f.batchTimedOut = o.timedOut
	switch {
	case o.err == nil && o.completed:
		f.stopKeep()
		if o.nStaged > 0 {
			// As complete and runCompleter publish what a message staged.
			f.ev.Outbox.Staged = o.nStaged
			f.p.checkRetention(f.ctx, f.lease)
			if !f.dispatch(o.stored, f.lease.Fence, true) {
				return
			}
		}
		f.replyAndAck(o.result, Completed)
	case o.err == nil && errors.Is(o.completeErr, lock.ErrLeaseLost):
		// As complete settles it: someone took the key over.
		f.stopKeep()
		f.requeue(Abandoned, "lease lost", MinInProgressDelay, o.completeErr)
	case o.err == nil && o.completeErr != nil:
		f.stopKeep()
		f.fail("result too large", o.completeErr)
	case o.err == nil && len(o.result) > f.p.cfg.MaxResultSize:
		f.stopKeep()
		f.fail("result too large", fmt.Errorf("%w: %d bytes, at most %d allowed", lock.ErrResultTooLarge, len(o.result), f.p.cfg.MaxResultSize))
	case o.err == nil && o.stored != nil:
		// CompleteBatch could not answer for it, and may have stored this
		// value: the same again (a new one would carry another outbox
		// claim, refused once the first is stored).
		f.completeValue(o.result, o.staged, o.stored)
	case o.err == nil:
		f.complete(o.result, o.staged)
	case errors.Is(o.err, lock.ErrResultTooLarge) && !IsPermanent(o.err):
		f.stopKeep()
		f.fail("result too large", o.err)
	case f.p.batch.bc != nil && errors.Is(o.err, lock.ErrLeaseLost) && !IsPermanent(o.err):
		// Nothing of the batch committed; the record decides the next
		// delivery.
		f.stopKeep()
		f.release()
		f.requeue(Abandoned, "lease lost", MinInProgressDelay, o.err)
	case f.p.batch.bc != nil && errors.Is(o.err, lock.ErrUnavailable) && !IsPermanent(o.err):
		// Not committed, or committed with the answer lost: then the
		// record is completed, refuses the release, and the redelivery is
		// acked as a duplicate.
		f.stopKeep()
		f.release()
		f.requeue(Abandoned, "store unavailable", f.p.cfg.UnavailableDelay, o.err)
	case f.ctx.Err() == nil && !IsPermanent(o.err) && !o.timedOut && f.leaseLost() != nil:
		// As failed settles a handler stopped by its lost lease (its
		// context cancelled): its failure says nothing about the
		// message.
		f.arrived()
		f.stopKeep()
		f.release()
		f.requeue(Abandoned, "lease lost", MinInProgressDelay, f.leaseLost())
	default:
		f.failed(o.err)
	}
}
