package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// countingStore counts the Complete calls a processor makes itself.
type countingStore struct {
	lock.Store
	completes atomic.Int32
}

func (s *countingStore) Complete(ctx context.Context, l lock.Lease, v []byte) error {
	s.completes.Add(1)
	return s.Store.Complete(ctx, l, v)
}

// fakeCompleter stands for a transactional handler: work runs, then the
// record is completed "in the same transaction" (on the inner store, not
// through the processor's), then after runs (an answer lost, say).
type fakeCompleter struct {
	store  lock.Store // what the completion writes to
	owner  lock.Store // what CompleterStore answers
	work   func() ([]byte, error)
	refuse error // returned instead of completing: rolled back
	after  func(err error) error
}

func (f *fakeCompleter) Handle(context.Context, *amqp.Delivery) ([]byte, error) { return f.work() }
func (f *fakeCompleter) CompleterStore() lock.Store                             { return f.owner }
func (f *fakeCompleter) HandleComplete(ctx context.Context, _ *amqp.Delivery, l lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	result, err := f.work()
	if err == nil && f.refuse != nil {
		// The value made, then the completion refused, as a store's
		// compare-and-set refuses a lease taken over.
		if _, err := value(result); err != nil {
			return nil, err
		}
		return nil, f.refuse
	}
	if err == nil {
		var v []byte
		if v, err = value(result); err == nil {
			err = f.store.Complete(ctx, l, v)
		}
	}
	if f.after != nil {
		err = f.after(err)
	}
	if err != nil {
		return nil, err
	}
	return result, nil
}

func TestCompleterOutcomes(t *testing.T) {
	tests := []struct {
		name       string
		work       func() ([]byte, error)
		refuse     error
		after      func(error) error
		cfg        Config
		want       Outcome
		wantReason string
		wantDelay  time.Duration
		wantStatus lock.Status // of the record afterwards
	}{
		{name: "committed", work: func() ([]byte, error) { return []byte("r"), nil },
			want: Completed, wantStatus: lock.Completed},
		{name: "work fails", work: func() ([]byte, error) { return nil, errors.New("boom") },
			cfg:  Config{Backoff: constantBackoff(time.Second)},
			want: Retried, wantReason: "handler error", wantDelay: time.Second, wantStatus: lock.Acquired},
		{name: "too large", work: func() ([]byte, error) { return make([]byte, 100), nil }, cfg: Config{MaxResultSize: 10},
			want: DeadLettered, wantReason: "result too large", wantStatus: lock.Failed},
		{name: "lease lost", work: func() ([]byte, error) { return nil, nil },
			refuse: fmt.Errorf("complete: %w", lock.ErrLeaseLost),
			// Not released: the lease belongs to whoever took it over.
			want: Abandoned, wantReason: "lease lost", wantDelay: MinInProgressDelay, wantStatus: lock.InProgress},
		{name: "lease lost before the completion", work: func() ([]byte, error) {
			// pgstore's lease held by a transaction whose session the
			// server ended: nothing committed, the lease gone with it.
			return nil, fmt.Errorf("%w: %w: the session holding the lease ended", lock.ErrLeaseLost, lock.ErrUnavailable)
		},
			// Released: the attempt is recorded (the store refuses it if
			// someone took the key over).
			want: Abandoned, wantReason: "lease lost", wantDelay: MinInProgressDelay, wantStatus: lock.Acquired},
		{name: "committed, answer lost", work: func() ([]byte, error) { return nil, nil },
			after: func(error) error { return fmt.Errorf("commit: %w", lock.ErrUnavailable) },
			want:  Abandoned, wantReason: "store unavailable", wantDelay: DefaultUnavailableDelay, wantStatus: lock.Completed},
		{name: "not committed, store unreachable", work: func() ([]byte, error) { return nil, fmt.Errorf("begin: %w", lock.ErrUnavailable) },
			want: Abandoned, wantReason: "store unavailable", wantDelay: DefaultUnavailableDelay, wantStatus: lock.Acquired},
		{name: "panic", work: func() ([]byte, error) { panic("oops") },
			cfg:  Config{Backoff: constantBackoff(time.Second)},
			want: Retried, wantReason: "handler error", wantDelay: time.Second, wantStatus: lock.Acquired},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			mem, err := lock.NewMemoryStore(lock.Config{})
			if err != nil {
				t.Fatal(err)
			}
			store := &countingStore{Store: mem}
			h := &fakeCompleter{store: mem, owner: store, work: tc.work, refuse: tc.refuse, after: tc.after}
			cfg := tc.cfg
			cfg.Queue = "q"
			p, err := newProcessor(store, cfg, h)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
			b := &fakeBroker{}
			d, a := delivery("a", "x")
			ev := p.process(context.Background(), b, d, nil)
			if ev.Outcome != tc.want || ev.Reason != tc.wantReason || ev.Delay != tc.wantDelay {
				t.Fatalf("got %v %q delay %v (err %v), want %v %q delay %v", ev.Outcome, ev.Reason, ev.Delay, ev.Err, tc.want, tc.wantReason, tc.wantDelay)
			}
			if a.acks != 1 {
				t.Fatalf("acks %d, want 1", a.acks)
			}
			if n := store.completes.Load(); n != 0 {
				t.Fatalf("the processor called Complete %d times; a Completer completes the record itself", n)
			}
			res, err := mem.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a"), Fingerprint: fingerprint([]byte("x"))})
			if err != nil {
				t.Fatal(err)
			}
			if res.Status != tc.wantStatus {
				t.Fatalf("record afterwards: %v, want %v", res.Status, tc.wantStatus)
			}
		})
	}
}

func TestCompleterOfAnotherStore(t *testing.T) {
	a, _ := lock.NewMemoryStore(lock.Config{})
	b, _ := lock.NewMemoryStore(lock.Config{})
	h := &fakeCompleter{store: b, owner: b, work: func() ([]byte, error) { return nil, nil }}
	if _, err := newProcessor(a, Config{Queue: "q"}, h); err == nil {
		t.Fatal("newProcessor with a Completer of another store: nil error")
	}
}

func constantBackoff(d time.Duration) func() backoff.BackOff {
	return func() backoff.BackOff { return backoff.NewConstantBackOff(d) }
}

// mapStore is a store of a type that cannot be compared.
type mapStore struct {
	lock.Store
	m map[string]int
}

func TestCompleterStoreNotComparable(t *testing.T) {
	mem, _ := lock.NewMemoryStore(lock.Config{})
	a, b := mapStore{mem, map[string]int{}}, mapStore{mem, map[string]int{}}
	h := &fakeCompleter{store: mem, owner: b, work: func() ([]byte, error) { return nil, nil }}
	if _, err := newProcessor(a, Config{Queue: "q"}, h); err == nil {
		t.Fatal("newProcessor with stores that cannot be compared: nil error, want a refusal (and no panic)")
	}
}

// fakeTaker is a fakeCompleter that takes its leases itself, counting the
// calls and the deliveries they were for.
type fakeTaker struct {
	*fakeCompleter
	takes atomic.Int32
	seen  *amqp.Delivery
}

func (f *fakeTaker) AcquireLease(ctx context.Context, req lock.Request, d *amqp.Delivery) (lock.Result, error) {
	f.takes.Add(1)
	f.seen = d
	return f.store.Acquire(ctx, req)
}

// observedCalls records the store calls a StoreObserver is told of.
type observedCalls struct {
	ObserverFunc
	ops []string
}

func (o *observedCalls) ObserveStore(_ context.Context, c StoreCall) { o.ops = append(o.ops, c.Op) }

// TestLeaseTakerAcquires: a LeaseTaker's AcquireLease takes the place of
// the store's Acquire, is given the delivery, and is reported to a
// StoreObserver as the store's acquire.
func TestLeaseTakerAcquires(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	acquires := &acquireCounter{Store: mem}
	h := &fakeTaker{fakeCompleter: &fakeCompleter{store: mem, owner: acquires, work: func() ([]byte, error) { return nil, nil }}}
	obs := &observedCalls{ObserverFunc: func(context.Context, Event) {}}
	p, err := newProcessor(acquires, Config{Queue: "q", Observer: obs}, h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	d, a := delivery("a", "x")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed || a.acks != 1 {
		t.Fatalf("got %v (err %v), %d acks; want completed, acked", ev.Outcome, ev.Err, a.acks)
	}
	if h.takes.Load() != 1 || acquires.n.Load() != 0 || h.seen == nil || h.seen.MessageId != "a" {
		t.Fatalf("AcquireLease called %d times (delivery %v), the store's Acquire %d; want the taker's, once, with the delivery",
			h.takes.Load(), h.seen, acquires.n.Load())
	}
	if len(obs.ops) == 0 || obs.ops[0] != "acquire" {
		t.Fatalf("store calls observed %v, want the taken lease reported as an acquire first", obs.ops)
	}
}

// acquireCounter counts the Acquire calls made through it.
type acquireCounter struct {
	lock.Store
	n atomic.Int32
}

func (s *acquireCounter) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	s.n.Add(1)
	return s.Store.Acquire(ctx, req)
}
