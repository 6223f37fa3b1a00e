package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Handler processes one message. It returns the result to store (and to
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

// call runs h, turning a panic into a *PanicError.
func call(ctx context.Context, h Handler, d *amqp.Delivery) (result []byte, err error) {
	defer func() {
		if v := recover(); v != nil {
			result, err = nil, &PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return h.Handle(ctx, d)
}

// Info describes the execution a handler runs in.
type Info struct {
	// Queue is the queue the message came from.
	Queue string
	// Key is the idempotency key; empty when processed without one.
	Key string
	// Attempt counts executions of the key, this one included (1 first).
	Attempt int
	// Fence is the lease's fencing token: it strictly increases per key.
	// A downstream store that keeps the highest fence it has seen for a
	// key and refuses lower ones is safe from stale holders. Zero when
	// processed without a lease.
	Fence int64
}

type infoKey struct{}

// FromContext returns the Info of the execution ctx belongs to.
func FromContext(ctx context.Context) (Info, bool) {
	i, ok := ctx.Value(infoKey{}).(Info)
	return i, ok
}

func withInfo(ctx context.Context, i Info) context.Context {
	return context.WithValue(ctx, infoKey{}, i)
}
