package amqpidem

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// TestBatchLeaseBatchNotSplit: the deliveries whose leases were taken in
// one AcquireBatch call run as one batch, one handler call (one
// transaction for a BatchCompleter), even when one of them reaches the
// run batch well after the run batch's own wait (a fifth of BatchWait)
// has passed, as on a busy machine; and a lease batch of one runs at once,
// not after that wait.
func TestBatchLeaseBatchNotSplit(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var sizes []int
	h := BatchHandlerFunc(func(_ context.Context, ds []*amqp.Delivery) ([]BatchResult, error) {
		mu.Lock()
		defer mu.Unlock()
		sizes = append(sizes, len(ds))
		return nil, nil
	})
	p, err := newProcessor(mem, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	const size, wait = 4, 250 * time.Millisecond
	p.batch = &batcher{h: h, ba: mem, size: size, wait: wait}
	p.stopping = make(chan struct{})
	late := 3 * wait / 5 // well after the run batch's wait of wait/5
	runJoinHook = func(f *flight) {
		if f.d.MessageId == "m0" {
			time.Sleep(late)
		}
	}
	t.Cleanup(func() { runJoinHook = nil })

	var wg sync.WaitGroup
	acks := make([]*fakeAck, size)
	for i := range size {
		d, a := delivery(fmt.Sprintf("m%d", i), fmt.Sprintf("body %d", i))
		acks[i] = a
		wg.Go(func() {
			if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
				t.Errorf("%s: %v (%v), want completed", d.MessageId, ev.Outcome, ev.Err)
			}
		})
	}
	wg.Wait()
	for i, a := range acks {
		if a.acks != 1 {
			t.Errorf("m%d acked %d times, want 1", i, a.acks)
		}
	}
	mu.Lock()
	if len(sizes) != 1 || sizes[0] != size {
		t.Errorf("handler called with batches %v, want one of %d: the lease batch was split", sizes, size)
	}
	sizes = nil
	mu.Unlock()

	// A lease batch of one: nothing else on its way, it runs at once.
	d, _ := delivery("alone", "alone")
	start := time.Now()
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
		t.Fatalf("alone: %v (%v), want completed", ev.Outcome, ev.Err)
	}
	// Its lease waited BatchWait for others; its run batch adds no wait.
	if took := time.Since(start); took >= wait+wait/5 {
		t.Errorf("a lease batch of one took %v, want less than BatchWait and its fifth (%v): its run batch waited for nothing", took, wait+wait/5)
	}
}
