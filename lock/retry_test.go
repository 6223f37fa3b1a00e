package lock_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/amqpidem/amqpidem/lock"
)

// After a try that may have taken effect, RetryAcquire's error says so
// (it wraps ErrUnavailable) however the later tries end: a context ending
// during one of them made it a bare context.Canceled, and a caller took
// "nothing happened" for an answer while a lease may be held.
func TestRetryAcquireKeepsMayHaveTakenEffect(t *testing.T) {
	uncertain := fmt.Errorf("%w: i/o timeout", lock.ErrUnavailable)
	never := func(error) bool { return false }
	for _, tc := range []struct {
		name  string
		later func(cancel context.CancelFunc) error // the second try's error
	}{
		{"cancelled during the next try", func(cancel context.CancelFunc) error { cancel(); return context.Canceled }},
		{"a refusal on the next try", func(context.CancelFunc) error { return errors.New("lock: acquire: NOPERM") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			tries := 0
			_, err := lock.RetryAcquire(ctx, func(context.Context) (lock.Result, error) {
				tries++
				if tries == 1 {
					return lock.Result{}, uncertain
				}
				return lock.Result{}, tc.later(cancel)
			}, never)
			if tries < 2 {
				t.Fatalf("%d tries, want the uncertain one tried again", tries)
			}
			if !errors.Is(err, lock.ErrUnavailable) {
				t.Fatalf("RetryAcquire: %v; want an error wrapping ErrUnavailable: the first try may have taken effect", err)
			}
		})
	}
	// A first try that surely did not take effect, and an answer, are
	// returned as they are.
	refused := errors.New("refused")
	if _, err := lock.RetryAcquire(context.Background(), func(context.Context) (lock.Result, error) { return lock.Result{}, refused }, never); err != refused {
		t.Fatalf("a sure failure: %v", err)
	}
}
