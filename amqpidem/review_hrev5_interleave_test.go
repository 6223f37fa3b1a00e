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

// hrev5Taker is a BatchLeaseTaker on a memory store that records its runs.
type hrev5Taker struct {
	splitCompleter
	tmu   sync.Mutex
	sizes []int
}

func (h *hrev5Taker) AcquireLeaseBatch(ctx context.Context, reqs []lock.Request, ds []*amqp.Delivery) ([]lock.Result, []error) {
	rs := make([]lock.Result, len(reqs))
	errs := make([]error, len(reqs))
	for i, r := range reqs {
		rs[i], errs[i] = h.store.Acquire(ctx, r)
	}
	return rs, errs
}

func (h *hrev5Taker) HandleBatchComplete(ctx context.Context, items []BatchItem, value func(int, []byte) ([]byte, error)) ([]BatchResult, error) {
	h.tmu.Lock()
	h.sizes = append(h.sizes, len(items))
	h.tmu.Unlock()
	return h.splitCompleter.HandleBatchComplete(ctx, items, value)
}

// TestBatchLeaseTakerInterleavedJoins: two lease batches of 3 whose
// flights reach the run batches alternately run as two run batches, one
// per lease batch. 694d21b's seal (a flight of another lease batch seals
// the open group) ran them as 6 run batches of 1: each a transaction (a
// part of a held pgstore batch, serialized on its session), where the
// leased/leasing wait is there to make one.
func TestBatchLeaseTakerInterleavedJoins(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	h := &hrev5Taker{splitCompleter: splitCompleter{store: mem, runs: map[string]int{}}}
	p, err := newProcessor(mem, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	const size = 3
	p.batch = &batcher{h: h, bc: h, bt: h, size: size, wait: 300 * time.Millisecond}
	p.stopping = make(chan struct{})
	var mu sync.Mutex
	var waiting []*flight
	turn := map[*flight]chan struct{}{}
	all := make(chan struct{})
	runJoinHook = func(f *flight) {
		mu.Lock()
		waiting = append(waiting, f)
		c := make(chan struct{})
		turn[f] = c
		if len(waiting) == 2*size {
			close(all)
		}
		mu.Unlock()
		<-c
	}
	t.Cleanup(func() { runJoinHook = nil })
	go func() {
		select {
		case <-all:
		case <-time.After(10 * time.Second):
			return
		}
		mu.Lock()
		by := map[*group[*acquireCall]][]*flight{}
		var order []*group[*acquireCall]
		for _, f := range waiting {
			if by[f.leaseBatch()] == nil {
				order = append(order, f.leaseBatch())
			}
			by[f.leaseBatch()] = append(by[f.leaseBatch()], f)
		}
		mu.Unlock()
		for i := range size {
			for _, g := range order {
				if i < len(by[g]) {
					close(turn[by[g][i]])
					time.Sleep(20 * time.Millisecond)
				}
			}
		}
	}()
	var wg sync.WaitGroup
	for i := range 2 * size {
		d, _ := delivery(fmt.Sprintf("m%d", i), "b")
		wg.Go(func() {
			if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
				t.Errorf("%s: %v (%v)", d.MessageId, ev.Outcome, ev.Err)
			}
		})
	}
	wg.Wait()
	h.tmu.Lock()
	defer h.tmu.Unlock()
	t.Logf("2 lease batches of %d, joins interleaved: run batches %v", size, h.sizes)
	if len(h.sizes) > 2 {
		t.Errorf("2 lease batches of %d ran as %d run batches %v, want 2", size, len(h.sizes), h.sizes)
	}
}
