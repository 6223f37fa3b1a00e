package amqpidem

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

// ctxObserver is a HandlerObserver that records the contexts its
// HandlerStarted and HandlerEnded calls get, and whether each carried a
// lease (heartbeat.LeaseFromContext).
type ctxObserver struct {
	mu      sync.Mutex
	started []context.Context
	ended   []context.Context
	leased  int
}

func (o *ctxObserver) Observe(context.Context, Event) {}

func (o *ctxObserver) HandlerStarted(ctx context.Context, info Info) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.started = append(o.started, ctx)
	if l, ok := heartbeat.LeaseFromContext(ctx); ok && l.Fence == info.Fence {
		o.leased++
	}
}

func (o *ctxObserver) HandlerEnded(ctx context.Context, _ Info) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.ended = append(o.ended, ctx)
}

// HandlerObserver's doc: HandlerStarted and HandlerEnded get "the
// handler's context ... the same context value in both calls, so that an
// observer may use it as the handler's identity" (promamqpidem's
// oldest_handler_age_seconds keys its running handlers by it). Before
// KeepWith (baa17d5) each message of a batch had its own (its Keep
// context, carrying its lease); since, every message of every batch of a
// session gets the session's ctx: one identity for all of them, so a
// gauge keyed by it keeps the first start of a session for as long as
// batches overlap. Each message's context must be its own, and the same
// in both calls.
func TestHrev10BatchHandlerObserverContextPerMessage(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &loseOne{MemoryStore: mem}
	obs := &ctxObserver{}
	h := BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error) { return nil, nil })
	p, err := newProcessor(store, Config{Queue: "hrev10-obs", LeaseTTL: time.Second, Logger: slog.New(slog.DiscardHandler), Observer: obs}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	ids := []string{"hrev10-o0", "hrev10-o1", "hrev10-o2", "hrev10-o3"}
	p.batch = &batcher{h: h, ba: store, size: len(ids), wait: time.Second}
	p.stopping = make(chan struct{})
	evs := processAll(&p, ids) // one ctx for all: a session's, no Tracer
	for _, id := range ids {
		if ev := evs[id]; ev.Outcome != Completed {
			t.Fatalf("%s: %v %q %v, want completed", id, ev.Outcome, ev.Reason, ev.Err)
		}
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	if len(obs.started) != len(ids) || len(obs.ended) != len(ids) {
		t.Fatalf("HandlerStarted %d times, HandlerEnded %d times, want %d each", len(obs.started), len(obs.ended), len(ids))
	}
	distinct := map[context.Context]bool{}
	for _, c := range obs.started {
		distinct[c] = true
	}
	if len(distinct) != len(ids) {
		t.Errorf("HandlerStarted got %d distinct contexts for %d messages: a message's context is not its identity", len(distinct), len(ids))
	}
	for i := range obs.started {
		if obs.started[i] != obs.ended[i] {
			t.Errorf("message %d: HandlerEnded got another context than HandlerStarted", i)
		}
	}
	t.Logf("contexts carrying the message's lease (heartbeat.LeaseFromContext): %d of %d", obs.leased, len(ids))
}
