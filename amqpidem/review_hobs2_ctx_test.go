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

// handlerCtx keeps the context contract on each way it is done, its own
// context made lazily: Done closed iff Err non-nil, Cause the reason, a
// child context cancelled with it, whichever of Done, Err or Value is
// asked first.
func TestHobs2HandlerCtxContract(t *testing.T) {
	lost := errors.New("lease lost (test)")
	for _, tc := range []struct {
		name  string
		first string // the method asked first after it is done
		do    func(f *flight, cancel context.CancelCauseFunc)
		cause error
	}{
		{"lost/Err", "Err", func(f *flight, _ context.CancelCauseFunc) { (*batchLoss)(f).LeaseLost(lost) }, lost},
		{"lost/Value", "Value", func(f *flight, _ context.CancelCauseFunc) { (*batchLoss)(f).LeaseLost(lost) }, lost},
		{"lost/Done", "Done", func(f *flight, _ context.CancelCauseFunc) { (*batchLoss)(f).LeaseLost(lost) }, lost},
		{"ended/Err", "Err", func(f *flight, _ context.CancelCauseFunc) { (*handlerCtx)(f).end() }, context.Canceled},
		{"ended/Done", "Done", func(f *flight, _ context.CancelCauseFunc) { (*handlerCtx)(f).end() }, context.Canceled},
		{"ctx/Err", "Err", func(_ *flight, cancel context.CancelCauseFunc) { cancel(lost) }, lost},
		{"ctx/Done", "Done", func(_ *flight, cancel context.CancelCauseFunc) { cancel(lost) }, lost},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			f := &flight{p: &processor{batch: &batcher{}}, ctx: ctx}
			c := (*handlerCtx)(f)
			if c.Err() != nil || context.Cause(c) != nil {
				t.Fatalf("live: Err %v, Cause %v", c.Err(), context.Cause(c))
			}
			var child context.Context
			if tc.first == "Done" {
				// Its own context made before it is done, a child on it.
				var stop context.CancelFunc
				child, stop = context.WithCancel(c)
				defer stop()
			}
			tc.do(f, cancel)
			if f.ownCtx != nil && tc.first != "Done" {
				t.Fatal("its own context made before it was asked for")
			}
			switch tc.first {
			case "Err":
				if c.Err() == nil {
					t.Fatal("Err nil once done")
				}
			case "Value":
				if got := context.Cause(c); !errors.Is(got, tc.cause) {
					t.Fatalf("Cause %v, want %v", got, tc.cause)
				}
			}
			select {
			case <-c.Done():
			case <-time.After(time.Second):
				t.Fatal("Done not closed")
			}
			if c.Err() == nil || !errors.Is(context.Cause(c), tc.cause) {
				t.Errorf("Err %v, Cause %v; want non-nil, %v", c.Err(), context.Cause(c), tc.cause)
			}
			if child == nil {
				var stop context.CancelFunc
				child, stop = context.WithCancel(c) // on a done context
				defer stop()
			}
			select {
			case <-child.Done():
			case <-time.After(time.Second):
				t.Fatal("a child context not cancelled")
			}
			if !errors.Is(context.Cause(child), tc.cause) {
				t.Errorf("the child's Cause %v, want %v", context.Cause(child), tc.cause)
			}
		})
	}
}
