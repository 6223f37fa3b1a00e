package promamqpidem_test

import (
	"context"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// BenchmarkPerMessage is what one completed message costs the Prometheus
// adapter: its event, its handler's start and end, and its two store calls
// (acquire, complete).
func BenchmarkPerMessage(b *testing.B) {
	m := promamqpidem.New(promamqpidem.Options{})
	ctx := context.Background()
	info := amqpidem.Info{Queue: "payments", Key: "k", Attempt: 1, Fence: 1}
	ev := amqpidem.Event{Queue: "payments", Key: "k", Outcome: amqpidem.Completed, Attempt: 1,
		Handler: 3 * time.Millisecond, Total: 5 * time.Millisecond, Published: time.Now()}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.ObserveStore(ctx, amqpidem.StoreCall{Queue: "payments", Op: "acquire", Leases: 1, Duration: time.Millisecond})
			m.HandlerStarted(ctx, info)
			m.HandlerEnded(ctx, info)
			m.ObserveStore(ctx, amqpidem.StoreCall{Queue: "payments", Op: "complete", Leases: 1, Duration: time.Millisecond})
			m.Observe(ctx, ev)
		}
	})
}
