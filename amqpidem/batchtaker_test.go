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
	e := newEnv(t, nil)
	rec := &recorder{}
	h := &leaseTaker{store: e.store}
	cfg := amqpidem.ConsumerConfig{
		URL: e.url, BatchSize: 10, BatchWait: 50 * time.Millisecond,
		Config: amqpidem.Config{Queue: e.queue, Observer: rec, Logger: slog.New(slog.DiscardHandler)},
	}
	c, err := amqpidem.NewBatchConsumer(e.store, cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	var keys []string
	for i := range 30 {
		keys = append(keys, fmt.Sprintf("t%02d", i))
	}
	for _, k := range keys {
		e.publish(amqp.Publishing{MessageId: k, Body: []byte(k)})
	}
	rec.waitFor(t, 30*time.Second, "every message completed", func(evs []amqpidem.Event) bool {
		for _, k := range keys {
			if count(evs, k, amqpidem.Completed) != 1 {
				return false
			}
		}
		return true
	})
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

// leaseTaker is a BatchLeaseTaker of store: its leases are the store's,
// taken one by one, and it completes each record after its handler.
type leaseTaker struct {
	store      lock.Store
	mu         sync.Mutex
	calls      int
	largest    int
	mismatched int
	runs       map[string]int
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
	h.mu.Unlock()
	rs := make([]lock.Result, len(reqs))
	errs := make([]error, len(reqs))
	for i, req := range reqs {
		rs[i], errs[i] = h.store.Acquire(ctx, req)
	}
	return rs, errs
}

func (h *leaseTaker) HandleBatchComplete(ctx context.Context, items []amqpidem.BatchItem, value func(int, []byte) ([]byte, error)) ([]amqpidem.BatchResult, error) {
	h.mu.Lock()
	if h.runs == nil {
		h.runs = map[string]int{}
	}
	for _, it := range items {
		h.runs[it.Delivery.MessageId]++
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
