package amqpidem

import (
	"context"
	"errors"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// Middleware wraps a Handler with code that runs around every execution
// of it: logging, recovery, timeouts, tracing, metrics of your own. It
// sees what the handler sees (the context, with FromContext's Info, and
// the delivery) and what it returns; amqpidem's processing (the store,
// the heartbeat, settling the delivery) runs outside it. A duplicate is
// answered from its record without running the handler, and so without
// running the middleware. A middleware calls the next handler at most
// once, in its own goroutine or another, and returns only after it
// returned (a timeout cancels the context it passes on, and waits).
//
//	logged := func(next amqpidem.Handler) amqpidem.Handler {
//		return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
//			start := time.Now()
//			result, err := next.Handle(ctx, d)
//			slog.InfoContext(ctx, "handled", "id", d.MessageId, "took", time.Since(start), "error", err)
//			return result, err
//		})
//	}
type Middleware func(Handler) Handler

// ErrMiddlewareSkipped is the error, Permanent, of a delivery whose
// Completer a middleware did not run (see Chain).
var ErrMiddlewareSkipped = errors.New("amqpidem: a middleware returned without running the handler, which completes the record in its own transaction: nothing was completed")

// Chain returns h wrapped in mws, the first outermost: Chain(h, a, b)
// runs a, which calls b, which calls h. Without mws it returns h.
//
// A Completer (pgstore's and dynamostore's TxHandler) stays one, and a
// LeaseTaker one too, so that its work still commits with the record:
// each middleware runs around HandleComplete as around Handle. The
// transaction decides, not the middleware: when the handler's
// transaction committed, the message is completed with the handler's
// result, whatever error or other result a middleware returns after; when
// it did not, the delivery fails with the handler's error even if a
// middleware returned nil; and when a middleware returns without calling
// the handler at all, it fails with ErrMiddlewareSkipped, Permanent.
func Chain(h Handler, mws ...Middleware) Handler {
	if len(mws) == 0 {
		return h
	}
	wrap := func(inner Handler) Handler {
		for i := len(mws) - 1; i >= 0; i-- {
			inner = mws[i](inner)
		}
		return inner
	}
	switch c := h.(type) {
	case LeaseTaker:
		return &chainedTaker{chainedCompleter{Completer: c, outer: wrap(h), wrap: wrap}, c}
	case Completer:
		return &chainedCompleter{Completer: c, outer: wrap(h), wrap: wrap}
	}
	return wrap(h)
}

// chainedCompleter is a Completer wrapped in middleware (Chain).
type chainedCompleter struct {
	Completer                       // the handler, for CompleterStore
	outer     Handler               // the handler wrapped, for Handle
	wrap      func(Handler) Handler // wraps a handler in the middleware
}

// Handle runs the handler, without a record, through the middleware.
func (c *chainedCompleter) Handle(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	return c.outer.Handle(ctx, d)
}

// HandleComplete runs the handler's HandleComplete through the
// middleware; what it committed decides (see Chain).
func (c *chainedCompleter) HandleComplete(ctx context.Context, d *amqp.Delivery, lease lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	var (
		ran      bool
		result   []byte
		innerErr error
	)
	h := c.wrap(HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		ran = true
		result, innerErr = c.Completer.HandleComplete(ctx, d, lease, value)
		return result, innerErr
	}))
	_, err := h.Handle(ctx, d)
	switch {
	case !ran && err != nil:
		return nil, err
	case !ran:
		return nil, Permanent(ErrMiddlewareSkipped)
	case innerErr != nil:
		return nil, innerErr
	}
	return result, nil
}

// chainedTaker is a LeaseTaker wrapped in middleware (Chain).
type chainedTaker struct {
	chainedCompleter
	taker LeaseTaker
}

// AcquireLease is the handler's.
func (c *chainedTaker) AcquireLease(ctx context.Context, req lock.Request, d *amqp.Delivery) (lock.Result, error) {
	return c.taker.AcquireLease(ctx, req, d)
}
