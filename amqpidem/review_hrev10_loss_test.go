package amqpidem

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

// hrev10Check checks the events and records of ids: lost ones abandoned
// as "lease lost" with their records not completed, the others completed.
func hrev10Check(t *testing.T, mem *lock.MemoryStore, p *processor, evs map[string]Event, ids []string, lost map[string]bool) {
	t.Helper()
	for _, id := range ids {
		ev := evs[id]
		rec, err := mem.Inspect(context.Background(), StoreKey(p.cfg.Endpoint, id))
		if err != nil {
			t.Fatalf("%s: Inspect: %v", id, err)
		}
		if lost[id] {
			if ev.Outcome != Abandoned || ev.Reason != "lease lost" {
				t.Errorf("%s: %v %q %v, want abandoned, lease lost", id, ev.Outcome, ev.Reason, ev.Err)
			}
			if rec.State == lock.StateCompleted {
				t.Errorf("%s: its record completed, though its lease was lost", id)
			}
			continue
		}
		if ev.Outcome != Completed || rec.State != lock.StateCompleted {
			t.Errorf("%s: %v %q %v, record %v, want completed", id, ev.Outcome, ev.Reason, ev.Err, rec.State)
		}
	}
	if got := p.keeper.Len(); got != 0 {
		t.Errorf("leases still kept: %d", got)
	}
}

// A lease lost after the flight's lease was taken but before it joins
// its run batch: the run goes without it (the handler never sees it),
// it is requeued as "lease lost", its record not completed.
func TestHrev10LossBeforeJoin(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &loseOne{MemoryStore: mem, victim: "hrev10-j2"}
	store.on.Store(true)
	ids := []string{"hrev10-j0", "hrev10-j1", "hrev10-j2", "hrev10-j3"}
	var mu sync.Mutex
	ran := map[string]int{}
	h := BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error) {
		mu.Lock()
		defer mu.Unlock()
		for _, d := range ds {
			ran[d.MessageId]++
		}
		return nil, nil
	})
	runJoinHook = func(f *flight) {
		if f.d.MessageId != store.victim {
			return
		}
		for deadline := time.Now().Add(3 * time.Second); f.leaseLost() == nil && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
	}
	t.Cleanup(func() { runJoinHook = nil })
	p := newBatchProc(t, store, 300*time.Millisecond, slog.New(slog.DiscardHandler), len(ids), h)
	evs := processAll(p, ids)
	hrev10Check(t, mem, p, evs, ids, map[string]bool{"hrev10-j2": true})
	for _, id := range ids {
		want := 1
		if id == "hrev10-j2" {
			want = 0
		}
		if ran[id] != want {
			t.Errorf("%s ran %d times, want %d", id, ran[id], want)
		}
	}
}

// A BatchCompleter's batch fails whole and is split; while its second
// half runs (the first committed), a lease of that half is lost: the
// half's run is cancelled with a cause wrapping lock.ErrLeaseLost, the
// lost message is requeued with its record not completed, the rest of
// the half runs again and commits.
func TestHrev10LossDuringSplitHalf(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &loseOne{MemoryStore: mem}
	ids := []string{"hrev10-s0", "hrev10-s1", "hrev10-s2", "hrev10-s3"}
	calls := 0
	var cause error
	var victim string
	c := &memCompleter{store: store, run: func(ctx context.Context, items []BatchItem) error {
		calls++ // the leader's goroutine makes every call
		switch calls {
		case 1:
			return errors.New("the whole batch fails: split it")
		case 3: // the second half
			victim = items[len(items)-1].Delivery.MessageId
			store.victim = victim
			store.on.Store(true)
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Second):
			}
			cause = context.Cause(ctx)
			return ctx.Err()
		}
		return nil
	}}
	p, err := newProcessor(store, Config{Queue: "hrev10-split", LeaseTTL: 300 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)}, batchOnly{h: c})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	p.batch = &batcher{h: c, bc: c, ba: store, size: len(ids), wait: time.Second}
	p.stopping = make(chan struct{})
	evs := processAll(&p, ids)
	if !errors.Is(cause, lock.ErrLeaseLost) {
		t.Fatalf("the second half's run: cause %v, want one wrapping %v", cause, lock.ErrLeaseLost)
	}
	if calls != 4 {
		t.Errorf("handler calls %d, want 4 (whole, first half, second half cancelled, its rest)", calls)
	}
	hrev10Check(t, mem, &p, evs, ids, map[string]bool{victim: true})
}

// The Keeper shut down while a batch runs: each lease is told ErrClosed
// on Shutdown's goroutine (which takes the batcher's lossMu), the run is
// cancelled with it, Shutdown returns, and every message is requeued, its
// record not completed. No deadlock, no lease left kept.
func TestHrev10KeeperShutdownMidBatch(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &loseOne{MemoryStore: mem}
	ids := []string{"hrev10-k0", "hrev10-k1", "hrev10-k2"}
	started := make(chan struct{})
	var once sync.Once
	var mu sync.Mutex
	var cause error
	var calls atomic.Int32
	h := BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error) {
		// Shutdown tells the leases one after the other; once it told
		// one, the batch is over for all of them (db84e24): the run is
		// not started again for the members not told yet.
		calls.Add(1)
		once.Do(func() { close(started) })
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
		}
		mu.Lock()
		if cause == nil {
			cause = context.Cause(ctx)
		}
		mu.Unlock()
		return nil, ctx.Err()
	})
	p := newBatchProc(t, store, time.Second, slog.New(slog.DiscardHandler), len(ids), h)
	done := make(chan map[string]Event)
	go func() { done <- processAll(p, ids) }()
	<-started
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := p.keeper.Shutdown(sctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	var evs map[string]Event
	select {
	case evs = <-done:
	case <-time.After(4 * time.Second):
		t.Fatal("the batch did not end after the Keeper's Shutdown")
	}
	if !errors.Is(cause, heartbeat.ErrClosed) {
		t.Errorf("the run's cause %v, want %v", cause, heartbeat.ErrClosed)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("handler calls %d, want 1: a batch whose Keeper shut down ran again", n)
	}
	lost := map[string]bool{}
	for _, id := range ids {
		lost[id] = true
	}
	hrev10Check(t, mem, p, evs, ids, lost)
}
