package amqpidem

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"
)

// countChannel is an amqp.Acknowledger that only counts frames, so that the
// benchmarks measure the acker rather than a fake broker.
type countChannel struct {
	frames atomic.Int64 // frames written
}

// Ack counts a frame.
func (c *countChannel) Ack(tag uint64, multiple bool) error {
	c.frames.Add(1)
	return nil
}

// Nack counts a frame.
func (c *countChannel) Nack(tag uint64, multiple, requeue bool) error {
	c.frames.Add(1)
	return nil
}

// Reject counts a frame.
func (c *countChannel) Reject(tag uint64, requeue bool) error {
	c.frames.Add(1)
	return nil
}

// BenchmarkAckerSlowFrontier acks n tags above tag 1, which stays unsettled
// the while, as a long job does while the quick ones after it are acked;
// then tag 1, and a flush. One op is the whole run of n acks. ns/ack is the
// mean over the n acks, tail-ns/ack the mean over the last tenth of them
// (with 0.9n tags or more above the frontier) and tags-kept how many tags
// the acker remembers just before tag 1 is acked.
func BenchmarkAckerSlowFrontier(b *testing.B) {
	for _, n := range []int{10_000, 100_000, 400_000} {
		b.Run(fmt.Sprintf("tags=%dk", n/1000), func(b *testing.B) {
			b.ReportAllocs()
			var tail time.Duration
			kept := 0
			for range b.N {
				a := newAcker(&countChannel{}, 0)
				tag := uint64(2)
				for ; tag <= uint64(n-n/10)+1; tag++ {
					_ = a.Ack(tag, false)
				}
				start := time.Now()
				for ; tag <= uint64(n)+1; tag++ {
					_ = a.Ack(tag, false)
				}
				tail += time.Since(start)
				kept = max(kept, a.size())
				_ = a.Ack(1, false)
				a.flush()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/ack")
			b.ReportMetric(float64(tail.Nanoseconds())/float64(b.N*(n/10)), "tail-ns/ack")
			b.ReportMetric(float64(kept), "tags-kept")
		})
	}
}

// BenchmarkAckerInOrder is the common case, with no slow delivery: one op is
// one ack. serial acks 1, 2, 3... from one goroutine; shuffled-32 acks them
// out of order within windows of 32; parallel acks from GOMAXPROCS
// goroutines, each taking the next tag, as the consumer's workers do.
func BenchmarkAckerInOrder(b *testing.B) {
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		a := newAcker(&countChannel{}, 0)
		for i := range b.N {
			_ = a.Ack(uint64(i)+1, false)
		}
		a.flush()
	})
	b.Run("shuffled-32", func(b *testing.B) {
		b.ReportAllocs()
		// A fixed shuffle of 0..31, so that the loop draws no random
		// numbers; tags past the last full window are acked in order.
		perm := [32]uint64{7, 30, 2, 19, 11, 0, 25, 14, 3, 28, 21, 9, 16, 31, 5, 23,
			12, 1, 27, 18, 8, 29, 4, 15, 22, 10, 26, 6, 20, 13, 24, 17}
		a := newAcker(&countChannel{}, 0)
		full := b.N / 32 * 32
		for i := range b.N {
			tag := uint64(i) + 1
			if i < full {
				tag = uint64(i/32*32) + perm[i%32] + 1
			}
			_ = a.Ack(tag, false)
		}
		a.flush()
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		a := newAcker(&countChannel{}, 0)
		var next atomic.Uint64
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				_ = a.Ack(next.Add(1), false)
			}
		})
		a.flush()
	})
}
