package lock_test

import (
	"context"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/proccpu"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// BenchmarkRedis compares, in one run against the same server, what one
// message costs: the store's Acquire+Complete (a native transaction and a
// script, two round trips), a duplicate's Acquire (one native transaction,
// one round trip), the same two through the acquire script alone (as on a
// Cluster or Redis < 7), and the raw SET NX the naive approach starts from
// (one round trip, no lease, no result).
//
// AcquireComplete32 is AcquireComplete from 32 callers at once, a
// consumer's handlers (Concurrency 32, as in make bench): their calls share
// pipelines, so it reports the round trips per op and this process's CPU
// per op (cpu-ns/op), which is the client's cost; ns/op is mostly waiting.
func BenchmarkRedis(b *testing.B) {
	client := testenv.RedisClient(b)
	var trips atomic.Int64
	client.AddHook(tripHook{&trips})
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

	// One message: a new key acquired and completed, by callers at once
	// (0: GOMAXPROCS of them, testing's default).
	unique := func(store *lock.RedisStore, callers int) func(*testing.B) {
		return func(b *testing.B) {
			if callers > 0 {
				b.SetParallelism((callers + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			}
			trips0, cpu0 := trips.Load(), proccpu.Self()
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
			if callers > 0 {
				b.ReportMetric(float64(trips.Load()-trips0)/float64(b.N), "round-trips/op")
				if cpu := proccpu.Self() - cpu0; cpu > 0 {
					b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
				}
			}
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

	b.Run("AcquireComplete", unique(store, 0))
	b.Run("AcquireComplete32", unique(store, 32))
	b.Run("AcquireDuplicate", duplicate(store))
	b.Run("ScriptAcquireComplete", unique(scripted, 0))
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

// tripHook counts round trips: commands sent alone and pipelines.
type tripHook struct{ n *atomic.Int64 }

func (h tripHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h tripHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}

func (h tripHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}
