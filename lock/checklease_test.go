package lock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// A lease whose retention is below a millisecond is refused, as a request
// with one is: the server would keep its outcome for 0 ms, deleting the
// completed record (finish.lua DELs it), and the next Acquire would run
// the work again as attempt 1.
func TestRedisRefusesLeaseWithoutRetention(t *testing.T) {
	s := newRedisStore(t, testenv.RedisClient(t), lock.Config{Prefix: testenv.Name(t)})
	ctx := context.Background()
	for _, retention := range []time.Duration{0, 500 * time.Microsecond} {
		res, err := s.Acquire(ctx, lock.Request{Key: "k" + retention.String()})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire: %v %v", res.Status, err)
		}
		l := res.Lease
		l.Retention = retention
		if err := s.Complete(ctx, l, []byte("done")); !errors.Is(err, lock.ErrInvalidTTL) {
			t.Errorf("Complete with retention %v: %v, want ErrInvalidTTL", retention, err)
		}
		if errs := s.Extend(ctx, l); !errors.Is(errs[0], lock.ErrInvalidTTL) {
			t.Errorf("Extend with retention %v: %v, want ErrInvalidTTL", retention, errs[0])
		}
		r, err := s.Inspect(ctx, l.Key)
		if err != nil || r.State != lock.StateInProgress {
			t.Fatalf("record after the refused Complete: %v %v; want it in progress", r.State, err)
		}
		if err := s.Complete(ctx, res.Lease, []byte("done")); err != nil {
			t.Fatalf("Complete with the lease as Acquire made it: %v", err)
		}
	}
}
