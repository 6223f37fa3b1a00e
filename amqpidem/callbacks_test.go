package amqpidem

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

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
			var ev Event
			func() {
				defer func() {
					if v := recover(); v != nil {
						t.Fatalf("process panicked: %v", v)
					}
				}()
				ev = p.process(context.Background(), b, d, nil)
			}()
			if ev.Outcome != tc.want || ev.Reason != tc.wantReason {
				t.Fatalf("got %v %q (%v), want %v %q", ev.Outcome, ev.Reason, ev.Err, tc.want, tc.wantReason)
			}
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
