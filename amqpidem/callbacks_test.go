package amqpidem

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// panickyTaker is a LeaseTaker whose AcquireLease panics.
type panickyTaker struct{ *fakeCompleter }

func (panickyTaker) AcquireLease(context.Context, lock.Request, *amqp.Delivery) (lock.Result, error) {
	panic("the driver's state is corrupt")
}

// panicBackOff is a backoff.BackOff whose NextBackOff panics.
type panicBackOff struct{}

func (panicBackOff) NextBackOff() time.Duration { panic("backoff bug") }
func (panicBackOff) Reset()                     {}

// A user callback that panics on the delivery path settles that delivery
// instead of crashing the process (a poison message would otherwise take
// every consumer that takes it down, one after the other): a Fingerprint
// panic is an invalid key, dead-lettered like a KeyFunc panic; a LeaseTaker
// whose AcquireLease panics gets the message requeued after
// UnavailableDelay and dead-lettered after MaxAttempts tries; a Backoff
// that panics retries after UnavailableDelay.
func TestProcessRecoversCallbackPanics(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	boom := func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, errors.New("boom") }
	tests := []struct {
		name       string
		cfg        Config
		handler    Handler
		attempt    int64 // the delivery's HeaderAttempt
		want       Outcome
		wantReason string
		wantPub    string
		wantDelay  time.Duration
	}{
		{name: "Config.Key", cfg: Config{Key: func(*amqp.Delivery) (string, error) { panic("key bug") }}, handler: HandlerFunc(ok("r")),
			want: DeadLettered, wantReason: "invalid key", wantPub: "q.dlq"},
		{name: "Config.Fingerprint", cfg: Config{Fingerprint: func(*amqp.Delivery) []byte { panic("nil map") }}, handler: HandlerFunc(ok("r")),
			want: DeadLettered, wantReason: "invalid key", wantPub: "q.dlq"},
		{name: "LeaseTaker.AcquireLease", handler: panickyTaker{&fakeCompleter{store: mem, owner: mem}},
			want: Abandoned, wantReason: "acquire panic", wantPub: "requeue", wantDelay: DefaultUnavailableDelay},
		{name: "LeaseTaker.AcquireLease, last try", handler: panickyTaker{&fakeCompleter{store: mem, owner: mem}}, attempt: DefaultMaxAttempts - 1,
			want: DeadLettered, wantReason: "acquire panic", wantPub: "q.dlq"},
		{name: "Config.Backoff", cfg: Config{Backoff: func() backoff.BackOff { panic("factory bug") }}, handler: HandlerFunc(boom),
			want: Retried, wantReason: "handler error", wantPub: "requeue", wantDelay: DefaultUnavailableDelay},
		{name: "Config.Backoff's NextBackOff", cfg: Config{Backoff: func() backoff.BackOff { return panicBackOff{} }}, handler: HandlerFunc(boom),
			want: Retried, wantReason: "handler error", wantPub: "requeue", wantDelay: DefaultUnavailableDelay},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.Queue, tc.cfg.Logger = "q", slog.New(slog.DiscardHandler)
			p, err := newProcessor(mem, tc.cfg, tc.handler)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
			b := &fakeBroker{}
			d, ack := delivery("k-"+tc.name, "x")
			if tc.attempt > 0 {
				d.Headers = amqp.Table{HeaderAttempt: tc.attempt}
			}
			processNoPanic(t, p, b, d, tc.want, tc.wantReason)
			if ack.acks != 1 || ack.nacks != 0 {
				t.Errorf("acks %d nacks %d, want one ack", ack.acks, ack.nacks)
			}
			switch {
			case len(b.pubs) != 1 || b.pubs[0].key != tc.wantPub:
				t.Errorf("publishes: got %+v, want one to %q", b.pubs, tc.wantPub)
			case b.pubs[0].delay != tc.wantDelay:
				t.Errorf("delay: got %v, want %v", b.pubs[0].delay, tc.wantDelay)
			}
		})
	}
}

// processNoPanic processes d and fails t if that panics or does not end
// with outcome want for reason.
func processNoPanic(t *testing.T, p processor, b *fakeBroker, d *amqp.Delivery, want Outcome, reason string) (ev Event) {
	t.Helper()
	defer func() {
		if v := recover(); v != nil {
			t.Fatalf("process panicked: %v", v)
		}
	}()
	ev = p.process(context.Background(), b, d, nil)
	if ev.Outcome != want || ev.Reason != reason {
		t.Fatalf("got %v %q (%v), want %v %q", ev.Outcome, ev.Reason, ev.Err, want, reason)
	}
	return ev
}

// panickyStore is a lock.Store whose method named by panics panics.
type panickyStore struct {
	lock.Store
	panics string
	calls  *atomic.Int32 // how many times it panicked
}

func (s panickyStore) boom() {
	s.calls.Add(1)
	panic("the driver's state is corrupt")
}

func (s panickyStore) Complete(ctx context.Context, l lock.Lease, result []byte) error {
	if s.panics == "Complete" {
		s.boom()
	}
	return s.Store.Complete(ctx, l, result)
}

func (s panickyStore) Fail(ctx context.Context, l lock.Lease, text string) error {
	if s.panics == "Fail" {
		s.boom()
	}
	return s.Store.Fail(ctx, l, text)
}

func (s panickyStore) Release(ctx context.Context, l lock.Lease) error {
	if s.panics == "Release" {
		s.boom()
	}
	return s.Store.Release(ctx, l)
}

// A store whose Complete, Fail or Release panics settles the delivery as
// a store that does not answer does, rather than crashing the process with
// every delivery in flight: Complete's is requeued "store unavailable"
// (the handler's result is not stored; the lease holds the key until it
// expires), Fail's requeued marked pending, Release's only delays the
// retry. A panicking call is not tried again. Before the fix each case
// crashed the test binary.
func TestProcessRecoversStorePanics(t *testing.T) {
	tests := []struct {
		panics     string
		handler    HandlerFunc
		want       Outcome
		wantReason string
		wantCalls  bool // the error says the store panicked
	}{
		{panics: "Complete", handler: ok("r"), want: Abandoned, wantReason: "store unavailable", wantCalls: true},
		{panics: "Fail", handler: func(context.Context, *amqp.Delivery) ([]byte, error) {
			return nil, Permanent(errors.New("bad order"))
		}, want: Abandoned, wantReason: "store unavailable", wantCalls: true},
		{panics: "Release", handler: func(context.Context, *amqp.Delivery) ([]byte, error) {
			return nil, errors.New("boom")
		}, want: Retried, wantReason: "handler error"},
	}
	for _, tc := range tests {
		t.Run(tc.panics, func(t *testing.T) {
			mem, err := lock.NewMemoryStore(lock.Config{})
			if err != nil {
				t.Fatal(err)
			}
			var logs testenv.SyncBuffer
			cfg := Config{Queue: "q", Logger: slog.New(slog.NewTextHandler(&logs, nil))}
			var calls atomic.Int32
			p, err := newProcessor(panickyStore{Store: mem, panics: tc.panics, calls: &calls}, cfg, tc.handler)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
			b := &fakeBroker{}
			d, ack := delivery("k-"+tc.panics, "x")
			ev := processNoPanic(t, p, b, d, tc.want, tc.wantReason)
			var pe *PanicError
			if tc.wantCalls && !errors.As(ev.Err, &pe) {
				t.Errorf("event error %v does not wrap a *PanicError", ev.Err)
			}
			if n := calls.Load(); n != 1 {
				t.Errorf("the store's %s was called %d times, want once (a panic is not tried again)", tc.panics, n)
			}
			if ack.acks != 1 || ack.nacks != 0 {
				t.Errorf("acks %d nacks %d, want one ack", ack.acks, ack.nacks)
			}
			if len(b.pubs) != 1 || b.pubs[0].key != "requeue" {
				t.Errorf("publishes: got %+v, want one requeue", b.pubs)
			}
			if tc.panics == "Release" && !strings.Contains(logs.String(), "the store's Release panicked") {
				t.Errorf("log does not say Release panicked:\n%s", logs.String())
			}
		})
	}
}
