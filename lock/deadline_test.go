package lock_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// Lease.Deadline is never later than the server's deadline: no other
// caller gets the key before it. The server starts a lease at its current
// millisecond rounded down, up to a millisecond before the request's send
// time that Deadline is counted from. Each trial takes a lease, then
// another caller asks for the key, again and again, until it gets it; the
// time its answer arrived must not be before the first lease's Deadline.
func TestRedisDeadlineNotLaterThanServer(t *testing.T) {
	for _, native := range []bool{true, false} {
		t.Run(fmt.Sprintf("native=%v", native), func(t *testing.T) {
			s := newRedisStore(t, testenv.RedisClient(t), lock.Config{Prefix: testenv.Name(t)})
			if !native {
				lock.DisableNative(s)
			}
			ctx := context.Background()
			const trials, ttl = 100, 5 * time.Millisecond
			early := 0
			for i := range trials {
				key := fmt.Sprint("k", i)
				held, err := s.Acquire(ctx, lock.Request{Key: key, TTL: ttl})
				if err != nil || held.Status != lock.Acquired {
					t.Fatalf("Acquire: %v %v", held.Status, err)
				}
				for give := time.Now().Add(time.Second); ; {
					res, err := s.Acquire(ctx, lock.Request{Key: key, TTL: ttl})
					at := time.Now()
					if err != nil {
						t.Fatal(err)
					}
					if res.Status == lock.Acquired {
						if at.Before(held.Lease.Deadline) {
							early++
						}
						break
					}
					if at.After(give) {
						t.Fatalf("key %s not taken over within a second of a %v lease", key, ttl)
					}
				}
			}
			if early > 0 {
				t.Fatalf("in %d of %d trials another caller got the key before the holder's Lease.Deadline", early, trials)
			}
		})
	}
}
