package lock

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// acquireRetries bounds the tries RetryAcquire makes after its first, and
// acquireRetryWait is the wait before the first of them (doubled for each
// next one): about 350 ms in all.
const (
	acquireRetries   = 3
	acquireRetryWait = 50 * time.Millisecond
)

// RetryAcquire is the retry policy of the stores' Acquire, for Store
// implementations. try sends one Acquire, always with the same owner
// token, so that a resent Acquire whose first answer was lost gets the
// lease that first one took (no second attempt counted). Once a try
// failed with ErrUnavailable and may have taken effect, RetryAcquire sends
// it again while it fails, up to 3 more times over about 350 ms within
// ctx, and the error it returns then wraps ErrUnavailable whatever the
// last try met (ctx ending during it, say): a lease may be held. An error
// for which certain reports true says the try did not take effect (it
// never left the client, say); it is not retried while no earlier try may
// have taken effect, so that a dead store fails fast. An answer is
// returned at once, and so is any error while no try may have taken
// effect.
func RetryAcquire(ctx context.Context, try func(context.Context) (Result, error), certain func(error) bool) (Result, error) {
	wait := acquireRetryWait
	uncertain := false // a try may have taken effect
	for n := 0; ; n++ {
		res, err := try(ctx)
		uncertain = uncertain || (errors.Is(err, ErrUnavailable) && !certain(err))
		if err == nil || !uncertain || n == acquireRetries || ctx.Err() != nil {
			return res, mayHaveTakenEffect(err, uncertain)
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return res, err
		}
		wait *= 2
	}
}

// mayHaveTakenEffect is the error RetryAcquire returns, err of its last
// try: when an earlier try may have taken effect (uncertain), one that
// says so, wrapping ErrUnavailable, whatever the last try met (its
// context ending, say).
func mayHaveTakenEffect(err error, uncertain bool) error {
	if err == nil || !uncertain || errors.Is(err, ErrUnavailable) {
		return err
	}
	return fmt.Errorf("%w: an earlier try may have taken effect: %w", ErrUnavailable, err)
}
