package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// loseOne is a MemoryStore (a BatchAcquirer and a BatchCompleter) whose
// Extend answers lock.ErrLeaseLost for the key ending in victim once on
// is set: someone took it over.
type loseOne struct {
	*lock.MemoryStore
	victim string
	on     atomic.Bool
}

func (s *loseOne) Extend(ctx context.Context, leases ...lock.Lease) []error {
	errs := s.MemoryStore.Extend(ctx, leases...)
	for i, l := range leases {
		if s.on.Load() && strings.HasSuffix(l.Key, "\x00"+s.victim) {
			errs[i] = fmt.Errorf("%w: taken over (test)", lock.ErrLeaseLost)
		}
	}
	return errs
}

// newBatchProc is a batch consumer's processor on store, as
// BenchmarkProcessBatch makes one, with the given lease TTL and logger.
func newBatchProc(t *testing.T, store *loseOne, ttl time.Duration, logger *slog.Logger, size int, h BatchHandler) *processor {
	t.Helper()
	p, err := newProcessor(store, Config{Queue: "q", LeaseTTL: ttl, Logger: logger}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	p.batch = &batcher{h: h, ba: store, size: size, wait: time.Second}
	p.stopping = make(chan struct{})
	return &p
}

// processAll runs one delivery per id through p at once, as a batch
// consumer's, and returns their events by id.
func processAll(p *processor, ids []string) map[string]Event {
	var mu sync.Mutex
	evs := map[string]Event{}
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Go(func() {
			d := amqp.Delivery{Acknowledger: &countChannel{}, MessageId: id, Body: []byte(id)}
			ev := p.process(context.Background(), nopBroker{}, &d, nil)
			mu.Lock()
			evs[id] = ev
			mu.Unlock()
		})
	}
	wg.Wait()
	return evs
}

// A lease lost by one message of a running batch cancels the batch's
// context, with a cause wrapping lock.ErrLeaseLost; nothing of that run
// counts, the message goes back as "lease lost" with its record not
// completed, and the others run again without it and complete.
func TestBatchMemberLeaseLostCancelsBatch(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &loseOne{MemoryStore: mem, victim: "m2"}
	ids := []string{"m0", "m1", "m2", "m3"}
	var mu sync.Mutex
	var causes []error
	runs := map[string]int{}
	h := BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error) {
		mu.Lock()
		first := len(causes) == 0
		for _, d := range ds {
			runs[d.MessageId]++
		}
		mu.Unlock()
		if !first {
			return nil, nil
		}
		store.on.Store(true)
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
		}
		mu.Lock()
		causes = append(causes, context.Cause(ctx))
		mu.Unlock()
		return nil, ctx.Err()
	})
	p := newBatchProc(t, store, 300*time.Millisecond, slog.New(slog.DiscardHandler), len(ids), h)
	evs := processAll(p, ids)

	if len(causes) != 1 || !errors.Is(causes[0], lock.ErrLeaseLost) {
		t.Fatalf("the first run's context: cause %v, want one wrapping %v", causes, lock.ErrLeaseLost)
	}
	for _, id := range ids {
		ev := evs[id]
		rec, err := mem.Inspect(context.Background(), StoreKey(p.cfg.Endpoint, id))
		if err != nil {
			t.Fatalf("%s: Inspect: %v", id, err)
		}
		if id == "m2" {
			if ev.Outcome != Abandoned || ev.Reason != "lease lost" || !errors.Is(ev.Err, lock.ErrLeaseLost) {
				t.Errorf("%s: %v %q %v, want abandoned, lease lost", id, ev.Outcome, ev.Reason, ev.Err)
			}
			if rec.State == lock.StateCompleted {
				t.Errorf("%s: its record completed, though its lease was lost", id)
			}
			if runs[id] != 1 {
				t.Errorf("%s ran %d times, want 1", id, runs[id])
			}
			continue
		}
		if ev.Outcome != Completed {
			t.Errorf("%s: %v %q %v, want completed", id, ev.Outcome, ev.Reason, ev.Err)
		}
		if rec.State != lock.StateCompleted {
			t.Errorf("%s: record %v, want completed", id, rec.State)
		}
		if runs[id] != 2 {
			t.Errorf("%s ran %d times, want 2 (the cancelled run, then without m2)", id, runs[id])
		}
	}
	if got := p.keeper.Len(); got != 0 {
		t.Errorf("leases still kept: %d", got)
	}
}

// memCompleter is a BatchCompleter on a loseOne store: it runs run on
// the batch's deliveries and, when it returns nil, completes each record
// with the value asked for it (not in a transaction: enough here).
type memCompleter struct {
	store *loseOne
	run   func(ctx context.Context, items []BatchItem) error
}

func (c *memCompleter) HandleBatch(context.Context, []*amqp.Delivery) ([]BatchResult, error) {
	return nil, errors.New("memCompleter: HandleBatch called")
}

func (c *memCompleter) CompleterStore() lock.Store { return c.store }

func (c *memCompleter) HandleBatchComplete(ctx context.Context, items []BatchItem, value func(int, []byte) ([]byte, error)) ([]BatchResult, error) {
	if err := c.run(ctx, items); err != nil {
		return nil, err
	}
	for i, it := range items {
		v, err := value(i, nil)
		if err != nil {
			return nil, err
		}
		if err := c.store.Complete(context.WithoutCancel(ctx), it.Lease, v); err != nil {
			return nil, err
		}
	}
	return nil, nil
}

// A split batch's committed half settles at once, its leases no longer
// kept: while the other half runs for several heartbeat intervals, the
// keeper keeps only the running half's leases and warns about nothing
// ("lease cannot be kept" about committed work).
func TestBatchSplitCommittedHalfNotKept(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &loseOne{MemoryStore: mem}
	var logs syncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	const ttl = 150 * time.Millisecond
	ids := []string{"s0", "s1", "s2", "s3"}
	var p processor
	var mu sync.Mutex
	kept := -1
	calls := 0
	c := &memCompleter{store: store, run: func(ctx context.Context, items []BatchItem) error {
		calls++ // the leader's goroutine makes every call
		if len(items) == len(ids) {
			return errors.New("the whole batch fails: split it")
		}
		if calls == 3 {
			// The second half, after the first committed: run for
			// several heartbeat intervals.
			time.Sleep(4 * ttl)
			mu.Lock()
			kept = p.keeper.Len()
			mu.Unlock()
		}
		return nil
	}}
	p, err = newProcessor(store, Config{Queue: "q", LeaseTTL: ttl, Logger: logger}, batchOnly{h: c})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	p.batch = &batcher{h: c, bc: c, ba: store, size: len(ids), wait: time.Second}
	p.stopping = make(chan struct{})
	evs := processAll(&p, ids)
	for _, id := range ids {
		if ev := evs[id]; ev.Outcome != Completed {
			t.Errorf("%s: %v %q %v, want completed", id, ev.Outcome, ev.Reason, ev.Err)
		}
	}
	if kept != 2 {
		t.Errorf("leases kept while the second half ran: %d, want 2 (the first half's stopped as it committed)", kept)
	}
	if s := logs.String(); s != "" {
		t.Errorf("warnings:\n%s", s)
	}
}

// syncBuffer is a strings.Builder safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
