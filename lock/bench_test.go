package lock_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// BenchmarkRedis compares, in one run against the same server, what one
// message costs: the store's Acquire+Complete (a native transaction and a
// script, two round trips), a duplicate's Acquire (one native transaction,
// one round trip), the same two through the acquire script alone (as on a
// Cluster or Redis < 7), and the raw SET NX the naive approach starts from
// (one round trip, no lease, no result).
func BenchmarkRedis(b *testing.B) {
	client := testenv.RedisClient(b)
	store, err := lock.NewRedisStore(client, lock.Config{Prefix: testenv.Name(b), Retention: time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	if err := store.Check(ctx); err != nil {
		b.Fatal(err)
	}
	var seq atomic.Int64
	result := []byte("ok")

	// One message: a new key acquired and completed.
	unique := func(store *lock.RedisStore) func(*testing.B) {
		return func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					key := "u" + strconv.FormatInt(seq.Add(1), 10)
					res, err := store.Acquire(ctx, lock.Request{Key: key})
					if err != nil || res.Status != lock.Acquired {
						b.Fatalf("Acquire: %v %v", res.Status, err)
					}
					if err := store.Complete(ctx, res.Lease, result); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
	// One duplicate of a completed message.
	duplicate := func(store *lock.RedisStore) func(*testing.B) {
		return func(b *testing.B) {
			res, err := store.Acquire(ctx, lock.Request{Key: "dup"})
			if err != nil {
				b.Fatal(err)
			}
			_ = store.Complete(ctx, res.Lease, result)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					res, err := store.Acquire(ctx, lock.Request{Key: "dup"})
					if err != nil || res.Status != lock.Completed {
						b.Fatalf("Acquire: %v %v", res.Status, err)
					}
				}
			})
		}
	}
	scripted, err := lock.NewRedisStore(client, lock.Config{Prefix: testenv.Name(b) + "-script", Retention: time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	lock.DisableNative(scripted)

	b.Run("AcquireComplete", unique(store))
	b.Run("AcquireDuplicate", duplicate(store))
	b.Run("ScriptAcquireComplete", unique(scripted))
	b.Run("ScriptAcquireDuplicate", duplicate(scripted))
	b.Run("RawSetNX", func(b *testing.B) {
		prefix := testenv.Name(b) + ":"
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				key := prefix + strconv.FormatInt(seq.Add(1), 10)
				if err := client.SetNX(ctx, key, "1", time.Minute).Err(); err != nil {
					b.Fatal(err)
				}
			}
		})
	})
}
