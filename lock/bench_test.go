package lock_test

import (
	"context"
	"runtime"
	"strconv"
	"strings"
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

// BenchmarkRedisComplete measures the completion alone: b.N leases on new
// keys are taken first (untimed, as the native Acquire makes them, or
// extended once in Extended, which rewrites the record through a script),
// then completed by 32 callers at once, as a consumer's handlers complete
// them. It reports the Redis server's CPU per Complete (redis-cpu-ns/op,
// from INFO cpu: run it against a server of its own, REDIS_ADDR, since
// every client's work counts) and this process's (cpu-ns/op).
func BenchmarkRedisComplete(b *testing.B) {
	client := testenv.RedisClient(b)
	ctx := context.Background()
	result := []byte("ok")
	run := func(extend bool) func(*testing.B) {
		return func(b *testing.B) {
			store, err := lock.NewRedisStore(client, lock.Config{Prefix: testenv.Name(b), Retention: time.Minute})
			if err != nil {
				b.Fatal(err)
			}
			if err := store.Check(ctx); err != nil {
				b.Fatal(err)
			}
			leases := make([]lock.Lease, 0, b.N)
			for len(leases) < b.N {
				reqs := make([]lock.Request, min(256, b.N-len(leases)))
				for i := range reqs {
					reqs[i] = lock.Request{Key: "c" + strconv.Itoa(len(leases)+i)}
				}
				res, errs := store.AcquireBatch(ctx, reqs)
				for i := range res {
					if errs[i] != nil || res[i].Status != lock.Acquired {
						b.Fatalf("Acquire: %v %v", res[i].Status, errs[i])
					}
					leases = append(leases, res[i].Lease)
				}
				if extend {
					for _, err := range store.Extend(ctx, leases[len(leases)-len(res):]...) {
						if err != nil {
							b.Fatal(err)
						}
					}
				}
			}
			var next atomic.Int64
			b.SetParallelism((32 + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
			b.ResetTimer()
			redis0, cpu0 := redisCPU(b, client), proccpu.Self()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := store.Complete(ctx, leases[next.Add(1)-1], result); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64((redisCPU(b, client)-redis0).Nanoseconds())/float64(b.N), "redis-cpu-ns/op")
			b.ReportMetric(float64((proccpu.Self()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
		}
	}
	b.Run("New", run(false))
	b.Run("Extended", run(true))
}

// redisCPU is the server's CPU time so far (INFO cpu: used_cpu_user +
// used_cpu_sys).
func redisCPU(b *testing.B, client redis.UniversalClient) time.Duration {
	info, err := client.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for _, field := range []string{"used_cpu_user:", "used_cpu_sys:"} {
		_, v, _ := strings.Cut(info, field)
		v, _, _ = strings.Cut(v, "\r\n")
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			b.Fatalf("INFO cpu %s: %v", field, err)
		}
		total += f
	}
	return time.Duration(total * float64(time.Second))
}

// BenchmarkRedisBatch measures what one message of a batch consumer costs
// the Redis store: one op is one message, its lease taken by AcquireBatch
// and its record completed by CompleteBatch, 100 keys a call (BatchSize
// 100, as in make bench), new keys (Acquired) or duplicates of completed
// ones (Duplicate: AcquireBatch alone). It reports allocations, this
// process's CPU (cpu-ns/op), the server's (redis-cpu-ns/op, from INFO cpu:
// run it against a server of its own, REDIS_ADDR, since every client's
// work counts) and round trips per message.
func BenchmarkRedisBatch(b *testing.B) {
	client := testenv.RedisClient(b)
	var trips atomic.Int64
	client.AddHook(tripHook{&trips})
	ctx := context.Background()
	const size = 100
	result := []byte("ok")
	store, err := lock.NewRedisStore(client, lock.Config{Prefix: testenv.Name(b), Retention: time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	if err := store.Check(ctx); err != nil {
		b.Fatal(err)
	}
	var seq atomic.Int64
	// keys returns a batch of n keys: new ones, or the batch dup.
	keys := func(n int, dup bool) []lock.Request {
		reqs := make([]lock.Request, n)
		for i := range reqs {
			if dup {
				reqs[i] = lock.Request{Key: "d" + strconv.Itoa(i)}
			} else {
				reqs[i] = lock.Request{Key: "b" + strconv.FormatInt(seq.Add(1), 10)}
			}
		}
		return reqs
	}
	run := func(dup bool) func(*testing.B) {
		return func(b *testing.B) {
			if dup {
				reqs := keys(size, true)
				res, _ := store.AcquireBatch(ctx, reqs)
				leases := make([]lock.Lease, 0, size)
				for _, r := range res {
					if r.Status == lock.Acquired {
						leases = append(leases, r.Lease)
					}
				}
				values := make([][]byte, len(leases))
				for i := range values {
					values[i] = result
				}
				store.CompleteBatch(ctx, leases, values)
			}
			// The batches' keys are made before the timer starts, as a
			// consumer gets them from its deliveries.
			batches := make([][]lock.Request, 0, b.N/size+1)
			for n := b.N; n > 0; n -= size {
				batches = append(batches, keys(min(n, size), dup))
			}
			leases := make([]lock.Lease, 0, size)
			values := make([][]byte, size)
			for i := range values {
				values[i] = result
			}
			b.ReportAllocs()
			b.ResetTimer()
			trips0, redis0, cpu0 := trips.Load(), redisCPU(b, client), proccpu.Self()
			for _, reqs := range batches {
				res, errs := store.AcquireBatch(ctx, reqs)
				leases = leases[:0]
				for i, r := range res {
					want := lock.Acquired
					if dup {
						want = lock.Completed
					}
					if errs[i] != nil || r.Status != want {
						b.Fatalf("AcquireBatch: %v %v", r.Status, errs[i])
					}
					if r.Status == lock.Acquired {
						leases = append(leases, r.Lease)
					}
				}
				if len(leases) > 0 {
					for _, err := range store.CompleteBatch(ctx, leases, values[:len(leases)]) {
						if err != nil {
							b.Fatal(err)
						}
					}
				}
			}
			cpu, rcpu, rt := proccpu.Self()-cpu0, redisCPU(b, client)-redis0, trips.Load()-trips0
			b.StopTimer()
			b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
			b.ReportMetric(float64(rcpu.Nanoseconds())/float64(b.N), "redis-cpu-ns/op")
			b.ReportMetric(float64(rt)/float64(b.N), "round-trips/op")
		}
	}
	b.Run("Acquired", run(false))
	b.Run("Duplicate", run(true))
}
