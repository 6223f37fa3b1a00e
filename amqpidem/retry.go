package amqpidem

import (
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
)

// The delay before a retry is decided, for a retryable failure with
// attempts left, by the first of these that applies:
//
//  1. the handler's error is, or wraps, a RetryAfterError (RetryAfter):
//     its Delay;
//  2. Config.RetryDelay, when set: RetryDelay(n, err, d);
//  3. Config.Backoff: its n-th NextBackOff.
//
// MaxAttempts ends the retries whichever decides, and a Permanent error is
// never retried.

// RetryDelayFunc decides the delay before the retry of delivery d, whose
// execution n (1 for the first) failed with the retryable error err, as
// asynq's RetryDelayFunc does. A negative delay means no more retries: the
// message is dead-lettered ("attempts exhausted"). It is called from the
// processing goroutines at once and must be safe for concurrent use; one
// that panics is logged at error level and the retry waits
// UnavailableDelay.
type RetryDelayFunc func(n int, err error, d *amqp.Delivery) time.Duration

// RetryAfterError is a retryable error that says how long to wait before
// the retry: a rate-limited API's 429 with its Retry-After, say. Make one
// with RetryAfter.
type RetryAfterError struct {
	Err   error         // the handler's error
	Delay time.Duration // the wait before the retry; zero or less: at once
}

// Error returns the wrapped error's text and the delay.
func (e *RetryAfterError) Error() string {
	return fmt.Sprintf("%v (retry after %v)", e.Err, e.Delay)
}

// Unwrap returns the wrapped error.
func (e *RetryAfterError) Unwrap() error { return e.Err }

// RetryAfter wraps err so that the message is retried after d, in place
// of what Config.RetryDelay or Config.Backoff would say; the retry still
// counts toward MaxAttempts. RetryAfter(nil, d) is nil; Permanent wins
// over it.
//
//	if resp.StatusCode == http.StatusTooManyRequests {
//		return nil, amqpidem.RetryAfter(errRateLimited, 30*time.Second)
//	}
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &RetryAfterError{Err: err, Delay: d}
}

// retryAfter is the delay a RetryAfterError in err asks for, if any.
func retryAfter(err error) (time.Duration, bool) {
	var ra *RetryAfterError
	if !errors.As(err, &ra) {
		return 0, false
	}
	return max(ra.Delay, 0), true
}

// Constant returns a Config.Backoff factory: every retry after d.
func Constant(d time.Duration) func() backoff.BackOff {
	return func() backoff.BackOff { return backoff.NewConstantBackOff(d) }
}

// Steps returns a Config.Backoff factory: retry n after delays[n-1], the
// last delay for every retry after those (Steps(time.Second,
// 10*time.Second, time.Minute): 1 s, 10 s, then a minute each time).
// Without delays, every retry is at once.
func Steps(delays ...time.Duration) func() backoff.BackOff {
	delays = append([]time.Duration(nil), delays...)
	return func() backoff.BackOff { return &steps{delays: delays} }
}

// steps is the backoff.BackOff Steps makes.
type steps struct {
	delays []time.Duration
	next   int
}

// NextBackOff returns the next step's delay, the last one's once past it.
func (s *steps) NextBackOff() time.Duration {
	if len(s.delays) == 0 {
		return 0
	}
	d := s.delays[min(s.next, len(s.delays)-1)]
	s.next++
	return d
}

// Reset starts again from the first step.
func (s *steps) Reset() { s.next = 0 }
