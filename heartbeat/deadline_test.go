package heartbeat

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// extendOnce lets each lease's first Extend through and holds the later
// ones until their context ends: one confirmed extension, then a store
// that hangs.
type extendOnce struct {
	lock.Store
	mu   sync.Mutex
	seen map[int64]bool // fences extended once
}

func (s *extendOnce) Extend(ctx context.Context, leases ...lock.Lease) []error {
	s.mu.Lock()
	first := !s.seen[leases[0].Fence]
	s.seen[leases[0].Fence] = true
	s.mu.Unlock()
	if len(leases) == 1 && first {
		return s.Store.Extend(ctx, leases...)
	}
	<-ctx.Done()
	errs := make([]error, len(leases))
	for i := range errs {
		errs[i] = ctx.Err()
	}
	return errs
}

// The local deadline after a confirmed Extend is never later than the
// server's: Redis renews a lease from its current millisecond rounded
// down. Each trial keeps a lease, lets one extension through, then asks
// for the key as another caller until it gets it: its answer must not
// arrive before the Keeper's deadline (the one LeaseFromContext reports,
// which the handler's cancellation is counted from).
func TestKeepDeadlineNotLaterThanServer(t *testing.T) {
	store := sharedRedisStore(t, testenv.Name(t))
	k := newKeeper(t, &extendOnce{Store: store, seen: map[int64]bool{}},
		Config{SafetyMargin: 200 * time.Microsecond, Logger: slog.New(slog.DiscardHandler)})
	ctx := context.Background()
	const trials, ttl = 50, 30 * time.Millisecond
	early := 0
	for i := range trials {
		key := fmt.Sprint("k", i)
		lease := acquire(t, store, key, ttl)
		hctx, stop := k.Keep(ctx, lease)
		var kept lock.Lease
		eventually(t, 5*time.Second, "the first extension", func() bool {
			kept, _ = LeaseFromContext(hctx)
			return kept.Deadline.After(lease.Deadline)
		})
		for give := time.Now().Add(time.Second); ; {
			res, err := store.Acquire(ctx, lock.Request{Key: key, TTL: ttl})
			at := time.Now()
			if err != nil {
				t.Fatal(err)
			}
			if res.Status == lock.Acquired {
				if at.Before(kept.Deadline) {
					early++
				}
				break
			}
			if at.After(give) {
				t.Fatalf("key %s not taken over within a second of a %v lease", key, ttl)
			}
		}
		stop()
	}
	if early > 0 {
		t.Fatalf("in %d of %d trials another caller got the key before the Keeper's deadline", early, trials)
	}
}
