package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// TestBatchLeaseCountersSettle: whatever way the deliveries of lease
// batches go (run and completed, a handler error, a panic, a duplicate of
// completed work, the same key twice in one lease batch, a key conflict),
// the batcher's counts of flights on their way to a run batch come back
// to zero, so that a later lease batch of one runs at once rather than
// waiting BatchWait for a flight that will never come.
func TestBatchLeaseCountersSettle(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	h := BatchHandlerFunc(func(_ context.Context, ds []*amqp.Delivery) ([]BatchResult, error) {
		rs := make([]BatchResult, len(ds))
		for i, d := range ds {
			switch {
			case strings.HasPrefix(d.MessageId, "panic"):
				panic("boom")
			case strings.HasPrefix(d.MessageId, "err"):
				rs[i].Err = errors.New("no")
			}
		}
		return rs, nil
	})
	p, err := newProcessor(mem, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler), MaxAttempts: 2}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	const size, wait = 4, 200 * time.Millisecond
	p.batch = &batcher{h: h, ba: mem, size: size, wait: wait}
	p.stopping = make(chan struct{})

	// A duplicate: its key completed before.
	d, _ := delivery("dup", "dup")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
		t.Fatalf("dup: %v (%v)", ev.Outcome, ev.Err)
	}
	ids := []string{"dup", "ok1", "ok2", "err1", "panic1", "twice", "twice", "conflict", "conflict", "ok3", "err2"}
	var wg sync.WaitGroup
	for i, id := range ids {
		body := id
		if id == "conflict" {
			body = fmt.Sprintf("conflict %d", i)
		}
		d, _ := delivery(id, body)
		wg.Go(func() { p.process(context.Background(), &fakeBroker{}, d, nil) })
	}
	wg.Wait()
	p.batch.runs.mu.Lock()
	leasing, leased := p.batch.leasing, p.batch.leased
	p.batch.runs.mu.Unlock()
	if leasing != 0 || leased != 0 {
		t.Errorf("after every delivery settled: leasing %d, leased %d; want 0, 0 (a count that drifted makes each later run batch wait)", leasing, leased)
	}
	d, _ = delivery("alone", "alone")
	start := time.Now()
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
		t.Fatalf("alone: %v (%v)", ev.Outcome, ev.Err)
	}
	if took := time.Since(start); took >= wait+wait/5 {
		t.Errorf("a lease batch of one took %v, want less than %v", took, wait+wait/5)
	}
}
