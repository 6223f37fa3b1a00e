package amqpidem

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// BenchmarkProcessBatch runs batches of 100 new deliveries, each on its
// own goroutine as a batch consumer's are, through the processor with a
// no-op BatchHandler, on lock.MemoryStore (a BatchAcquirer and a
// BatchCompleter) with a broker that keeps nothing: the batch path's own
// cost per message (allocs/op and ns/op are per message), no network in
// the way. Give it a count of messages that fills its batches
// (-benchtime 20000x): at the default the first b.N of one waits out the
// 1 s BatchWait alone, and testing stops there, with a batch of one's
// figures.
func BenchmarkProcessBatch(b *testing.B) {
	const size = 100
	p := newBatchProcessor(b, size)
	ctx, br, ack := context.Background(), nopBroker{}, &countChannel{}
	body := []byte(`{"order":42,"amount_cents":1999}`)
	ids := make([]string, b.N)
	for i := range ids {
		ids[i] = "op-" + strconv.Itoa(i)
	}
	b.ReportAllocs()
	b.ResetTimer()
	var wg sync.WaitGroup
	for start := 0; start < b.N; start += size {
		for i := start; i < min(start+size, b.N); i++ {
			wg.Go(func() {
				d := amqp.Delivery{Acknowledger: ack, MessageId: ids[i], Body: body}
				if ev := p.process(ctx, br, &d, nil); ev.Outcome != Completed {
					b.Errorf("%s: %v %s %v", ids[i], ev.Outcome, ev.Reason, ev.Err)
				}
			})
		}
		wg.Wait()
	}
}

// newBatchProcessor returns a processor of batches of up to size (waiting
// a second for them to fill) on a lock.MemoryStore, with a no-op
// BatchHandler, as a batch consumer's; its keeper is shut down in
// tb.Cleanup.
func newBatchProcessor(tb testing.TB, size int) *processor {
	tb.Helper()
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		tb.Fatal(err)
	}
	h := BatchHandlerFunc(func(context.Context, []*amqp.Delivery) ([]BatchResult, error) { return nil, nil })
	p, err := newProcessor(store, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)}, batchOnly{h: h})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	p.batch = &batcher{h: h, ba: store, size: size, wait: time.Second}
	p.stopping = make(chan struct{})
	return &p
}
