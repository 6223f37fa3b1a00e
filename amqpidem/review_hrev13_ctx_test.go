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

// hrev13InfoObserver records, for each message, what FromContext and
// Stage gave on the handler context its HandlerStarted call got.
type hrev13InfoObserver struct {
	mu    sync.Mutex
	info  map[string]Info // the Info the call was given
	found map[string]Info // FromContext's, when it found one
	stage map[string]error
}

func (o *hrev13InfoObserver) Observe(context.Context, Event) {}

func (o *hrev13InfoObserver) HandlerStarted(ctx context.Context, info Info) {
	got, ok := FromContext(ctx)
	err := Stage(ctx, "", "hrev13-nowhere", amqp.Publishing{Body: []byte("x")})
	o.mu.Lock()
	defer o.mu.Unlock()
	o.info[info.Key] = info
	if ok {
		o.found[info.Key] = got
	}
	o.stage[info.Key] = err
}

func (o *hrev13InfoObserver) HandlerEnded(context.Context, Info) {}

// A batch message's handler context, the one its HandlerObserver calls
// get, gives the message's Info through FromContext, as a single
// message's does (its execution), so that code reading the Info from a
// context (a log handler, say) works on both. Staging on it is refused
// (ErrNoOutbox): a batch message stages on DeliveryContext.
func TestHrev13BatchHandlerCtxFromContext(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &loseOne{MemoryStore: mem}
	obs := &hrev13InfoObserver{info: map[string]Info{}, found: map[string]Info{}, stage: map[string]error{}}
	ids := []string{"hrev13-i0", "hrev13-i1", "hrev13-i2"}
	h := BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error) { return nil, nil })
	p, err := newProcessor(store, Config{Queue: "hrev13-info", LeaseTTL: time.Second, Logger: slog.New(slog.DiscardHandler), Observer: obs}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	p.batch = &batcher{h: h, ba: store, size: len(ids), wait: time.Second}
	p.stopping = make(chan struct{})
	evs := processAll(&p, ids)
	obs.mu.Lock()
	defer obs.mu.Unlock()
	for _, id := range ids {
		if ev := evs[id]; ev.Outcome != Completed {
			t.Fatalf("%s: %v %q %v, want completed", id, ev.Outcome, ev.Reason, ev.Err)
		}
		want, ok := obs.info[id]
		if !ok {
			t.Fatalf("%s: no HandlerStarted call", id)
		}
		if got, ok := obs.found[id]; !ok || got != want {
			t.Errorf("%s: FromContext on its handler context: %+v, %v; want %+v, true", id, got, ok, want)
		}
		if err := obs.stage[id]; !errors.Is(err, ErrNoOutbox) {
			t.Errorf("%s: Stage on its handler context: %v, want %v", id, err, ErrNoOutbox)
		}
	}
}

// handlerCtx asked from other goroutines (an observer's) while its lease
// is lost, its keep stops and its ctx ends, all at once: under -race, no
// data race; Done one channel, closed in the end; Err non-nil; and once
// an Err or a Cause was seen non-nil, the cause never changes after.
func TestHrev13HandlerCtxRaces(t *testing.T) {
	lostErr := errors.New("lease lost (hrev13)")
	ctxErr := errors.New("ctx ended (hrev13)")
	for i := range 200 {
		ctx, cancel := context.WithCancelCause(context.Background())
		f := &flight{p: &processor{batch: &batcher{}}, ctx: ctx}
		c := (*handlerCtx)(f)
		var wg sync.WaitGroup
		start := make(chan struct{})
		var seen []error // causes seen once Err was non-nil, in order
		var dones []<-chan struct{}
		var mu sync.Mutex
		for range 2 {
			wg.Go(func() {
				<-start
				for range 50 {
					d := c.Done()
					var cause error
					if c.Err() != nil {
						cause = context.Cause(c)
					}
					mu.Lock()
					dones = append(dones, d)
					if cause != nil {
						seen = append(seen, cause)
					}
					mu.Unlock()
				}
			})
		}
		wg.Go(func() {
			<-start
			for range 50 {
				if err := c.Err(); err != nil {
					mu.Lock()
					seen = append(seen, context.Cause(c))
					mu.Unlock()
				}
				_ = c.Value(executionKey{})
			}
		})
		wg.Go(func() { <-start; (*batchLoss)(f).LeaseLost(lostErr) })
		wg.Go(func() { <-start; c.end() })
		wg.Go(func() { <-start; cancel(ctxErr) })
		close(start)
		wg.Wait()
		select {
		case <-c.Done():
		default:
			t.Fatalf("run %d: Done not closed once lost, ended and ctx done", i)
		}
		final := context.Cause(c)
		if c.Err() == nil || final == nil {
			t.Fatalf("run %d: Err %v, Cause %v once done", i, c.Err(), final)
		}
		if !errors.Is(final, lostErr) && !errors.Is(final, ctxErr) && !errors.Is(final, context.Canceled) {
			t.Fatalf("run %d: Cause %v, want one of the three", i, final)
		}
		for _, s := range seen {
			if s != final {
				t.Fatalf("run %d: a Cause %v seen while done, later %v", i, s, final)
			}
		}
		for _, d := range dones {
			if d != c.Done() {
				t.Fatalf("run %d: Done gave two channels", i)
			}
		}
	}
}
