package amqpidem

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// splitCompleter is a BatchCompleter of store that panics on any batch
// holding "poison", and completes the others' records one by one.
type splitCompleter struct {
	store lock.Store
	mu    sync.Mutex
	runs  map[string]int
	alone func() // called when poison runs alone
}

func (h *splitCompleter) HandleBatch(context.Context, []*amqp.Delivery) ([]BatchResult, error) {
	return nil, nil
}

func (h *splitCompleter) CompleterStore() lock.Store { return h.store }

func (h *splitCompleter) HandleBatchComplete(ctx context.Context, items []BatchItem, value func(int, []byte) ([]byte, error)) ([]BatchResult, error) {
	for _, it := range items {
		if it.Delivery.MessageId == "poison" {
			if len(items) == 1 && h.alone != nil {
				h.alone()
			}
			panic("poison")
		}
	}
	h.mu.Lock()
	for _, it := range items {
		h.runs[it.Delivery.MessageId]++
	}
	h.mu.Unlock()
	for i, it := range items {
		v, err := value(i, nil)
		if err == nil {
			err = h.store.Complete(ctx, it.Lease, v)
		}
		if err != nil {
			return nil, err
		}
	}
	return nil, nil
}

// TestBatchSplitLeaderSettlesMidBatch: a split batch whose leader's part
// commits first: the leader settles its own flight inline, the others of
// committed parts settle through their ready channel, and the batch goes
// on to the end; a panicking handler on the last parts. Every flight
// settles once, nothing hangs, nothing runs twice.
func TestBatchSplitLeaderSettlesMidBatch(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	h := &splitCompleter{store: mem, runs: map[string]int{}}
	p, err := newProcessor(mem, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	ids := []string{"m0", "m1", "m2", "m3", "m4", "poison"}
	p.batch = &batcher{h: h, bc: h, size: len(ids), wait: 2 * time.Second}
	p.stopping = make(chan struct{})
	runJoinHook = func(f *flight) {
		if f.d.MessageId != "m0" { // m0 leads, and is in the first part
			time.Sleep(50 * time.Millisecond)
		}
	}
	t.Cleanup(func() { runJoinHook = nil })
	var wg sync.WaitGroup
	acks := map[string]*fakeAck{}
	early := -1
	h.alone = func() {
		// The last part: the leader's part committed long before.
		a := acks["m0"]
		a.mu.Lock()
		early = a.acks
		a.mu.Unlock()
	}
	evs := make([]Event, len(ids))
	for i, id := range ids {
		d, a := delivery(id, id)
		acks[id] = a
		wg.Go(func() { evs[i] = p.process(context.Background(), &fakeBroker{}, d, nil) })
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("a flight of the split batch never settled")
	}
	if early != 1 {
		t.Errorf("the leader m0, whose part committed first, was acked %d times when the last part ran, want 1 (settled at once)", early)
	}
	for i, id := range ids {
		a := acks[id]
		a.mu.Lock()
		n := a.acks + a.nacks
		a.mu.Unlock()
		if n != 1 {
			t.Errorf("%s: settled %d times (%v), want once", id, n, evs[i].Outcome)
		}
		if id == "poison" {
			if evs[i].Outcome == Completed {
				t.Errorf("poison completed")
			}
			continue
		}
		if evs[i].Outcome != Completed || h.runs[id] != 1 {
			t.Errorf("%s: %v (%v), ran %d times, want completed once", id, evs[i].Outcome, evs[i].Err, h.runs[id])
		}
	}
}
