package main

import (
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/proccpu"
)

// runs numbers the drivers, whose keys are new only within their prefix.
var runs atomic.Int64

// BenchmarkFloor measures the client side of the three protocols (see the
// package doc): one op is one new message, acquired and completed, in
// groups of k (a, b, c) or from 32 goroutines through the store (a32).
// ns/op is wall time per message, allocs/op and B/op the go-redis client's
// and the driver's, cpu-ns/op this process's CPU per message (the client's
// cost; the server's is main's to measure). It runs against
// REDISFLOOR_ADDR, a private redis-server 7.0 (keys are never deleted;
// they expire after a minute), and is skipped without it. Use
// -benchtime=32768x (a multiple of every k) so that every op is a message.
func BenchmarkFloor(b *testing.B) {
	addr := os.Getenv("REDISFLOOR_ADDR")
	if addr == "" {
		b.Skip("REDISFLOOR_ADDR is not set (a private redis-server 7.0, e.g. 127.0.0.1:6394)")
	}
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64})
	defer client.Close()
	prefix := fmt.Sprintf("floorbench%d", time.Now().UnixNano())
	for _, k := range []int{8, 16, 32} {
		for _, mode := range []string{"a", "b", "c"} {
			b.Run(fmt.Sprintf("%s/k%d", mode, k), func(b *testing.B) {
				d, err := newDriver(client, fmt.Sprintf("%s%s%d", prefix, mode, runs.Add(1)), k)
				if err != nil {
					b.Fatal(err)
				}
				if err := d.check(ctx); err != nil {
					b.Fatal(err)
				}
				b.ReportAllocs()
				cpu0 := proccpu.Self()
				b.ResetTimer()
				for range (b.N + k - 1) / k { // b.N, or 1 in testing's first run

					if err := d.group(ctx, mode); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				b.ReportMetric(float64((proccpu.Self()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
			})
		}
	}
	b.Run("a32", func(b *testing.B) {
		d, err := newDriver(client, fmt.Sprintf("%sa32-%d", prefix, runs.Add(1)), 1)
		if err != nil {
			b.Fatal(err)
		}
		if err := d.check(ctx); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		cpu0 := proccpu.Self()
		b.ResetTimer()
		if err := d.callers(ctx, b.N, 32); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		b.ReportMetric(float64((proccpu.Self()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	})
}
