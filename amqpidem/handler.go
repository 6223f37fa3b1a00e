package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// Handler processes one message. The delivery it gets is a copy that it
// must not settle: Ack, Nack and Reject on it return ErrHandlerAck. Its
// Headers and Body are shared with the copies amqpidem may publish (a
// requeue, a dead letter) and with the payload fingerprint: read them, do
// not modify them. It returns the result to store (and to
// send to ReplyTo, if the message has one) or an error. An error wrapped
// with Permanent fails the message for good; any other error is retried
// with the queue's backoff.
//
// ctx is cancelled when the lease is lost or cannot be confirmed, or on
// shutdown; context.Cause(ctx) says which. A handler must stop promptly
// when ctx is done: its result is then discarded. FromContext(ctx) gives
// the key, attempt and fencing token.
type Handler interface {
	Handle(ctx context.Context, d *amqp.Delivery) ([]byte, error)
}

// A Completer is a Handler that stores its outcome itself, in the same
// transaction as its effects, so that the effects and the completed record
// commit together or not at all: a crash between the two can no longer run
// the work twice. pgstore.Store.TxHandler makes one.
//
// For a message with a lease, amqpidem calls HandleComplete instead of
// Handle and does not call the store's Complete afterwards. Handle serves
// the messages processed without a lease (Config.ProcessMissingKey,
// Config.FailOpen): the work runs in a transaction of its own, with no
// record.
type Completer interface {
	Handler
	// CompleterStore is the store whose records HandleComplete completes.
	// It must be the store the Consumer or Wrapper was made with;
	// NewConsumer and Wrap refuse another. A program that wraps the store
	// (to count its calls, say) wraps the Completer too, returning the
	// wrapped store here.
	CompleterStore() lock.Store
	// HandleComplete does the work of d in a transaction and, in that same
	// transaction, after the work, completes the record of lease with
	// value(result) (compare-and-set on owner and fence), then commits. It
	// returns the result only once the commit succeeded. ctx and d are as
	// for Handle.
	//
	// Any error means nothing was committed, and must wrap, besides the
	// work's own error: the error of value (lock.ErrResultTooLarge: the
	// result is too large to store), lock.ErrLeaseLost when the record was
	// no longer held by lease, and lock.ErrUnavailable when the store
	// could not be reached to complete or commit. A commit whose outcome
	// is unknown (the connection dropped during COMMIT) is also
	// lock.ErrUnavailable: amqpidem requeues the message and its
	// redelivery finds the record completed (a duplicate) or still held
	// (it runs again, the effects having rolled back).
	HandleComplete(ctx context.Context, d *amqp.Delivery, lease lock.Lease, value func(result []byte) ([]byte, error)) ([]byte, error)
}

// A LeaseTaker is a Completer that takes the lease of a delivery itself,
// so that the transaction HandleComplete then runs in can hold the lease
// from the start: one commit per message instead of two (pgstore's
// TxHandler). For each delivery with a key, amqpidem calls AcquireLease in
// place of the store's Acquire. Its answer means what Acquire's does, and
// the lease it grants is ended as any other: by HandleComplete, or by the
// store's Complete, Fail, Release or Cancel, one of which amqpidem always
// calls. A program that wraps the Completer without forwarding
// AcquireLease gets the store's Acquire, with the same guarantees. An
// AcquireLease (or a store's Acquire) that panics does not crash the
// process: the message is requeued after UnavailableDelay, never run, and
// dead-lettered with reason "acquire panic" after MaxAttempts tries.
type LeaseTaker interface {
	Completer
	// AcquireLease answers as CompleterStore().Acquire(ctx, req) does; d
	// is the delivery the lease is for (whether it was redelivered, say).
	AcquireLease(ctx context.Context, req lock.Request, d *amqp.Delivery) (lock.Result, error)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, d *amqp.Delivery) ([]byte, error)

// Handle calls f(ctx, d).
func (f HandlerFunc) Handle(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	return f(ctx, d)
}

// PermanentError marks a handler error as terminal: the message is not
// retried but dead-lettered and the outcome stored as failed.
type PermanentError struct {
	Err error // the handler's error
}

// Error returns the wrapped error's text.
func (e *PermanentError) Error() string {
	if e.Err == nil {
		return "permanent error"
	}
	return e.Err.Error()
}

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so that the message fails for good. Permanent(nil)
// is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err, or an error it wraps, is a
// PermanentError.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

// PanicError is a recovered handler panic. It is retryable: the panic may
// come from a transient state.
type PanicError struct {
	Value any    // what the handler panicked with
	Stack []byte // the goroutine's stack at the panic
}

// Error returns the panic value; the stack is in Stack.
func (e *PanicError) Error() string { return fmt.Sprintf("handler panic: %v", e.Value) }

// ErrHandlerTimeout is the cause of a handler context cancelled after
// Config.HandlerTimeout. Unless the handler still returns a result, that
// execution is a retryable failure with reason "handler timeout"; the
// error recorded wraps ErrHandlerTimeout.
var ErrHandlerTimeout = errors.New("amqpidem: handler timeout")

// ErrStale is what a handler returns (wrapped or not) when its own store
// refused its writes because it has seen a newer fencing token for the key
// (Info.Fence; see "Guarantees" in the package documentation): another
// execution of the same key has got further than this one. amqpidem then
// discards this execution, which is not counted as an attempt, not logged
// as a handler error and not retried with backoff: the message goes back
// to its queue for a short while, and its next delivery is decided by the
// record (acked as a duplicate once the newer execution completed, a busy
// requeue while it runs, run again if it crashed). Without an
// idempotency key (ProcessMissingKey, FailOpen) there is no fence, and
// ErrStale is an ordinary handler error.
var ErrStale = errors.New("amqpidem: stale fencing token")

// ErrHandlerAck is what Ack, Nack and Reject return when a handler calls
// them on its delivery: amqpidem settles every delivery itself, after the
// outcome is stored, and a second ack of one delivery tag would make the
// broker close the channel.
var ErrHandlerAck = errors.New("amqpidem: a handler must not ack, nack or reject its delivery; amqpidem settles it")

// handlerDelivery is d as its handler gets it: a copy whose Ack, Nack and
// Reject return ErrHandlerAck and settle nothing.
func handlerDelivery(d *amqp.Delivery) *amqp.Delivery {
	c := *d
	c.Acknowledger = refuseAck{}
	return &c
}

// refuseAck is the Acknowledger of a handler's delivery.
type refuseAck struct{}

func (refuseAck) Ack(uint64, bool) error        { return ErrHandlerAck }
func (refuseAck) Nack(uint64, bool, bool) error { return ErrHandlerAck }
func (refuseAck) Reject(uint64, bool) error     { return ErrHandlerAck }

// call runs h, turning a panic into a *PanicError.
func call(ctx context.Context, h Handler, d *amqp.Delivery) ([]byte, error) {
	return recovered(func() ([]byte, error) { return h.Handle(ctx, d) })
}

// recovered runs f, turning a panic into a *PanicError.
func recovered(f func() ([]byte, error)) (result []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			result, err = nil, &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return f()
}

// Info describes the execution a handler runs in.
type Info struct {
	// Queue is the queue the message came from.
	Queue string
	// Key is the message's idempotency key (what Config.Key returned);
	// empty when processed without one. The store keeps its record under
	// StoreKey(Config.Endpoint, Key).
	Key string
	// Attempt counts executions of the key, this one included (1 first):
	// the store's count, or the message's own (HeaderAttempt, capped at
	// MaxAttempts) when that is higher, as after a lost record.
	Attempt int
	// Fence is the lease's fencing token: it strictly increases per key,
	// across a lost record too as far as package lock's docs say.
	// A downstream store that keeps the highest fence it has seen for a
	// key and refuses lower ones is safe from stale holders. Zero when
	// processed without a lease.
	Fence int64
}

// FromContext returns the Info of the execution ctx belongs to.
func FromContext(ctx context.Context) (Info, bool) {
	x, ok := ctx.Value(executionKey{}).(*execution)
	if !ok {
		return Info{}, false
	}
	return x.info, true
}

// withExecution returns ctx carrying x: its Info and its outbox. The
// context is x itself, made from ctx, so that it costs no allocation of
// its own.
func withExecution(ctx context.Context, x *execution) context.Context {
	x.Context = ctx
	return x
}
