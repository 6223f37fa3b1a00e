package amqpidem_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// TestBatchLeaseTaker: a batch consumer whose handler is a
// BatchLeaseTaker takes the leases of its lease batches with the
// handler's AcquireLeaseBatch, given each request's delivery, in place of
// the store's; the leases it grants are the ones the handler then
// completes. Every message completes once; duplicates never run.
func TestBatchLeaseTaker(t *testing.T) {
	h := &leaseTaker{}
	keys := runTaker(t, h, 10, "t", 30, 0)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.calls == 0 || h.largest < 2 {
		t.Errorf("AcquireLeaseBatch: %d calls, largest %d requests: want lease batches", h.calls, h.largest)
	}
	if h.mismatched > 0 {
		t.Errorf("%d requests given without their delivery", h.mismatched)
	}
	for _, k := range keys {
		if h.runs[k] != 1 {
			t.Errorf("%s: ran %d times, want 1", k, h.runs[k])
		}
	}
}

// runTaker runs n messages, their ids prefix and a number, published
// every gap, through a batch consumer of h (on the test's store, batches
// of size, BatchWait 50 ms) until each completed, and returns the ids.
func runTaker(t *testing.T, h *leaseTaker, size int, prefix string, n int, gap time.Duration) []string {
	e := newEnv(t, nil)
	h.store = e.store
	rec := &recorder{}
	cfg := amqpidem.ConsumerConfig{
		URL: e.url, BatchSize: size, BatchWait: 50 * time.Millisecond,
		Config: amqpidem.Config{Queue: e.queue, Observer: rec, Logger: slog.New(slog.DiscardHandler)},
	}
	c, err := amqpidem.NewBatchConsumer(e.store, cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	var keys []string
	for i := range n {
		keys = append(keys, fmt.Sprintf("%s%02d", prefix, i))
	}
	for _, k := range keys {
		e.publish(amqp.Publishing{MessageId: k, Body: []byte(k)})
		time.Sleep(gap)
	}
	rec.waitFor(t, 30*time.Second, "every message completed", func(evs []amqpidem.Event) bool {
		for _, k := range keys {
			if count(evs, k, amqpidem.Completed) != 1 {
				return false
			}
		}
		return true
	})
	return keys
}

// leaseTaker is a BatchLeaseTaker of store: its leases are the store's,
// taken one by one, and it completes each record after its handler.
type leaseTaker struct {
	store      lock.Store
	delay      func(call int) time.Duration // each AcquireLeaseBatch call's, before it answers
	mu         sync.Mutex
	calls      int
	largest    int
	mismatched int
	runs       map[string]int
	from       map[string]int // the call each lease (owner) came from
	mixed      int            // runs holding leases of more than one call
}

var _ amqpidem.BatchLeaseTaker = (*leaseTaker)(nil)

func (h *leaseTaker) CompleterStore() lock.Store { return h.store }

func (h *leaseTaker) HandleBatch(context.Context, []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
	return nil, nil
}

func (h *leaseTaker) AcquireLeaseBatch(ctx context.Context, reqs []lock.Request, ds []*amqp.Delivery) ([]lock.Result, []error) {
	h.mu.Lock()
	h.calls++
	h.largest = max(h.largest, len(reqs))
	for i := range reqs {
		if i >= len(ds) || ds[i] == nil || !strings.HasSuffix(reqs[i].Key, ds[i].MessageId) {
			h.mismatched++
		}
	}
	call := h.calls
	h.mu.Unlock()
	if h.delay != nil {
		time.Sleep(h.delay(call))
	}
	rs := make([]lock.Result, len(reqs))
	errs := make([]error, len(reqs))
	for i, req := range reqs {
		rs[i], errs[i] = h.store.Acquire(ctx, req)
	}
	h.mu.Lock()
	if h.from == nil {
		h.from = map[string]int{}
	}
	for _, r := range rs {
		h.from[r.Lease.Owner] = call
	}
	h.mu.Unlock()
	return rs, errs
}

func (h *leaseTaker) HandleBatchComplete(ctx context.Context, items []amqpidem.BatchItem, value func(int, []byte) ([]byte, error)) ([]amqpidem.BatchResult, error) {
	h.mu.Lock()
	if h.runs == nil {
		h.runs = map[string]int{}
	}
	calls := map[int]bool{}
	for _, it := range items {
		h.runs[it.Delivery.MessageId]++
		calls[h.from[it.Lease.Owner]] = true
	}
	if len(calls) > 1 {
		h.mixed++
	}
	h.mu.Unlock()
	rs := make([]amqpidem.BatchResult, len(items))
	for i, it := range items {
		v, err := value(i, nil)
		if err == nil {
			err = h.store.Complete(ctx, it.Lease, v)
		}
		if err != nil {
			return nil, err
		}
	}
	return rs, nil
}

// TestBatchLeaseTakerOneLeaseBatchPerRun: a batch run by a
// BatchLeaseTaker holds the leases of one AcquireLeaseBatch call, never
// of two (pgstore's are two sessions: two transactions, committing and
// failing apart), even when lease batches overlap: deliveries trickling
// in, a call answered just after the one before it (slow, then less).
func TestBatchLeaseTakerOneLeaseBatchPerRun(t *testing.T) {
	h := &leaseTaker{delay: func(call int) time.Duration {
		return time.Duration(100+50*(call%2)) * time.Millisecond
	}}
	runTaker(t, h, 100, "o", 60, 5*time.Millisecond)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mixed > 0 {
		t.Errorf("%d runs held leases of more than one AcquireLeaseBatch call (%d calls)", h.mixed, h.calls)
	}
	t.Logf("%d AcquireLeaseBatch calls", h.calls)
}
