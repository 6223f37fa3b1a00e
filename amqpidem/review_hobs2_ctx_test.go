package amqpidem

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// hobs2LossObserver records, for each message's handler context, what
// HandlerEnded saw of it: Done closed, Err, Cause, and whether a
// goroutine HandlerStarted left waiting on Done saw it close.
type hobs2LossObserver struct {
	mu    sync.Mutex
	ended map[string]hobs2Seen
	woke  map[string]chan struct{}
}

type hobs2Seen struct {
	done       bool
	err, cause error
}

func (o *hobs2LossObserver) Observe(context.Context, Event) {}

func (o *hobs2LossObserver) HandlerStarted(ctx context.Context, info Info) {
	woke := make(chan struct{})
	o.mu.Lock()
	o.woke[info.Key] = woke
	o.mu.Unlock()
	go func() {
		<-ctx.Done() // an observer waiting on the message's context
		close(woke)
	}()
}

func (o *hobs2LossObserver) HandlerEnded(ctx context.Context, info Info) {
	s := hobs2Seen{err: ctx.Err(), cause: context.Cause(ctx)}
	select {
	case <-ctx.Done():
		s.done = true
	default:
	}
	o.mu.Lock()
	o.ended[info.Key] = s
	o.mu.Unlock()
}

// A message's lease lost while its batch runs cancels the batch run
// (documented), and the message's own handler context, the one its
// HandlerObserver calls get and that carries its lease
// (heartbeat.LeaseFromContext), must say so too, as a single message's
// does: Done closed, Err non-nil, Cause wrapping lock.ErrLeaseLost. The
// other messages' contexts stay live while they run.
func TestHobs2BatchLossCancelsMessageContext(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &loseOne{MemoryStore: mem}
	obs := &hobs2LossObserver{ended: map[string]hobs2Seen{}, woke: map[string]chan struct{}{}}
	ids := []string{"hobs2-c0", "hobs2-c1", "hobs2-c2"}
	const victim = "hobs2-c1"
	calls := 0
	h := BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error) {
		calls++ // the leader's goroutine makes every call
		if calls > 1 {
			return nil, nil
		}
		store.victim = victim
		store.on.Store(true)
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
		}
		store.on.Store(false)
		return nil, ctx.Err()
	})
	p, err := newProcessor(store, Config{Queue: "hobs2-ctx", LeaseTTL: 300 * time.Millisecond, Logger: slog.New(slog.DiscardHandler), Observer: obs}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	p.batch = &batcher{h: h, ba: store, size: len(ids), wait: time.Second}
	p.stopping = make(chan struct{})
	// The victim's context must close before the others' runs end: record
	// what its HandlerEnded saw in the first (cancelled) run only.
	evs := processAll(&p, ids)
	if ev := evs[victim]; ev.Outcome != Abandoned || ev.Reason != "lease lost" {
		t.Fatalf("%s: %v %q %v, want abandoned, lease lost", victim, ev.Outcome, ev.Reason, ev.Err)
	}
	obs.mu.Lock()
	s, woke := obs.ended[victim], obs.woke[victim]
	obs.mu.Unlock()
	if !s.done || s.err == nil || !errors.Is(s.cause, lock.ErrLeaseLost) {
		t.Errorf("%s's handler context at HandlerEnded, after its lease was lost: Done closed %v, Err %v, Cause %v; want closed, non-nil, wrapping %v",
			victim, s.done, s.err, s.cause, lock.ErrLeaseLost)
	}
	select {
	case <-woke:
	case <-time.After(2 * time.Second):
		t.Errorf("%s: an observer waiting on its handler context's Done never saw the loss", victim)
	}
	for _, id := range ids {
		if id == victim {
			continue
		}
		if ev := evs[id]; ev.Outcome != Completed {
			t.Errorf("%s: %v %q %v, want completed", id, ev.Outcome, ev.Reason, ev.Err)
		}
		obs.mu.Lock()
		s, woke := obs.ended[id], obs.woke[id]
		obs.mu.Unlock()
		if s.done || s.err != nil {
			t.Errorf("%s's handler context done at HandlerEnded (%v), its lease held", id, s.err)
		}
		// Settled, its keep stopped: its context is cancelled, as a Keep
		// context's stop cancels it, and a waiter on it is let go.
		select {
		case <-woke:
		case <-time.After(2 * time.Second):
			t.Errorf("%s: its handler context still live after it settled", id)
		}
	}
}
