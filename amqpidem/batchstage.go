package amqpidem

import (
	"context"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DeliveryContext returns the context of the message d within the batch
// whose handler's context is ctx: ctx, with FromContext giving d's Info
// (its key, attempt and fence) and Stage staging messages in d's outbox.
// A message's staged messages are stored with its own outcome (with
// pgstore's BatchTxHandler, in the batch's transaction), published after
// its record is completed and before its delivery is acked, exactly as a
// single handler's are (see Stage): those of a message answered with an
// error, of a batch that failed as a whole, or of a run that did not
// commit, are dropped.
//
// d must be one of the deliveries the batch handler was given (the same
// pointer). ctx may be the batch's context or any context derived from
// it, a DeliveryContext of another message included. Outside a batch
// handler's context, or for a delivery not of the batch, it returns ctx
// unchanged: for a message run alone without a lease (ProcessMissingKey,
// FailOpen) that is a single handler's context, on which FromContext and
// Stage work already; elsewhere Stage answers ErrNoOutbox.
//
// The returned context is done when ctx is: the batch's context is
// cancelled when the lease of any message of the batch is lost.
func DeliveryContext(ctx context.Context, d *amqp.Delivery) context.Context {
	r, ok := ctx.Value(batchRunKey{}).(*batchRun)
	if !ok {
		return ctx
	}
	x := r.lookup(d)
	if x == nil {
		return ctx
	}
	return &deliveryContext{Context: ctx, x: x}
}

// DiscardStaged drops what the messages of the batch whose handler's
// context is ctx have staged so far, and lets them stage again: for a
// BatchCompleter that calls its batch function more than once within one
// HandleBatchComplete (pgstore's BatchTxHandler runs it again without
// the messages that failed), before each further call, so that only the
// messages staged by the run that commits are stored. A message whose
// value was already asked for (HandleBatchComplete's value) can stage
// again after it, and the next value asked for it holds only what it
// staged since. Contexts DeliveryContext returned before the call stage
// nothing more (Stage answers ErrNoOutbox): the rerun calls
// DeliveryContext again. It does nothing outside a batch handler's
// context.
func DiscardStaged(ctx context.Context) {
	if r, ok := ctx.Value(batchRunKey{}).(*batchRun); ok {
		r.discard()
	}
}

// batchRunKey is the key of a batch handler's context's *batchRun.
type batchRunKey struct{}

// batchRun is what the context of one call of a batch handler carries:
// an execution (Info and outbox) per message of the batch, by index, made
// when the handler first asks for it (DeliveryContext), and what each
// message's completed record holds. Safe for concurrent use.
type batchRun struct {
	fs  []*flight
	ds  []*amqp.Delivery // the handler's deliveries
	ctx context.Context  // the executions' context
	p   *processor

	mu    sync.Mutex
	index map[*amqp.Delivery]int // ds by pointer, once a lookup needs it
	xs    []*execution           // nil until looked up
	slab  []execution            // the first executions, one allocation for the batch

	// Set by the leader alone, in callBatch: what each message staged
	// (the handler returned), and, for a BatchCompleter, the value last
	// made for its record and how many staged messages it holds.
	staged  [][][]byte
	stored  [][]byte
	nStaged []int
}

// newBatchRun makes the run of fs, whose handler gets ds, under ctx. A
// handler that never asks for a message's context (no DeliveryContext,
// nothing staged) costs the run no execution, nor index.
func (p *processor) newBatchRun(ctx context.Context, fs []*flight, ds []*amqp.Delivery) (*batchRun, context.Context) {
	r := &batchRun{fs: fs, ds: ds, ctx: ctx, p: p, xs: make([]*execution, len(fs)),
		stored: make([][]byte, len(fs)), nStaged: make([]int, len(fs))}
	return r, context.WithValue(ctx, batchRunKey{}, r)
}

// newExecution is a fresh execution of the i-th message, as run makes a
// single message's.
func (r *batchRun) newExecution(ctx context.Context, i int) *execution {
	x := r.execution(ctx, i)
	return &x
}

// execution is newExecution's value.
func (r *batchRun) execution(ctx context.Context, i int) execution {
	f, p := r.fs[i], r.p
	return execution{
		Context: ctx,
		info:    Info{Queue: p.cfg.Queue, Key: f.ev.Key, Attempt: f.attempt, Fence: f.lease.Fence},
		outbox:  outbox{idBase: f.storeKey, maxMessages: p.cfg.MaxStaged, maxBytes: p.outboxBytes, noStore: p.amender == nil, inject: p.stageInject()},
	}
}

// lookup is d's execution, made now if it has none yet, or nil for a
// delivery not of the run.
func (r *batchRun) lookup(d *amqp.Delivery) *execution {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.index == nil {
		r.index = make(map[*amqp.Delivery]int, len(r.ds))
		for i, d := range r.ds {
			r.index[d] = i
		}
	}
	i, ok := r.index[d]
	if !ok {
		return nil
	}
	if x := r.xs[i]; x == nil || x == &sealedEarly {
		// The message's first execution: slab[i] is handed out once,
		// since xs[i] is never nil nor sealedEarly again after this.
		if r.slab == nil {
			r.slab = make([]execution, len(r.ds))
		}
		r.slab[i] = r.execution(r.ctx, i)
		if x == &sealedEarly {
			r.slab[i].outbox.seal() // sealed before it was asked for
		}
		r.xs[i] = &r.slab[i]
	}
	return r.xs[i]
}

// sealedEarly marks, in batchRun.xs, a message sealed before its
// execution was made: staging in it is refused, as in a sealed outbox.
// Never handed out (lookup makes the message its own).
var sealedEarly execution

// seal ends the staging of the i-th message and returns what it staged:
// nothing when it has no execution yet, which its lookups then refuse to
// stage in (as a sealed outbox would).
func (r *batchRun) seal(i int) [][]byte {
	r.mu.Lock()
	x := r.xs[i]
	switch x {
	case nil:
		r.xs[i] = &sealedEarly
		fallthrough
	case &sealedEarly:
		r.mu.Unlock()
		return nil
	}
	r.mu.Unlock()
	return x.outbox.seal()
}

// sealAll ends the staging of every message (the handler returned), and
// returns what each staged.
func (r *batchRun) sealAll() [][][]byte {
	out := make([][][]byte, len(r.xs))
	for i := range r.xs {
		out[i] = r.seal(i)
	}
	return out
}

// discard seals every message's outbox (what late stagers there add is
// refused) and gives each a new one.
func (r *batchRun) discard() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, x := range r.xs {
		if x == nil || x == &sealedEarly {
			r.xs[i] = nil // the next lookup makes a fresh one
			continue
		}
		x.outbox.seal()
		r.xs[i] = r.newExecution(x.Context, i)
	}
}

// deliveryContext is DeliveryContext's context: ctx, with x as the
// execution it belongs to.
type deliveryContext struct {
	context.Context
	x *execution
}

// Value returns x for executionKey{}, and otherwise what ctx holds.
func (c *deliveryContext) Value(key any) any {
	if key == (executionKey{}) {
		return c.x
	}
	return c.Context.Value(key)
}
