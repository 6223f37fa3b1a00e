package amqpidem

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// fakeAck records what was done to a delivery.
type fakeAck struct {
	mu     sync.Mutex
	acks   int
	nacks  int
	requeu bool
}

func (a *fakeAck) Ack(tag uint64, multiple bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.acks++
	return nil
}
func (a *fakeAck) Nack(tag uint64, multiple, requeue bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.nacks++
	a.requeu = requeue
	return nil
}
func (a *fakeAck) Reject(tag uint64, requeue bool) error { return a.Nack(tag, false, requeue) }

type published struct {
	exchange, key string
	msg           amqp.Publishing
	delay         time.Duration
	alone         bool // sent by publishAlone: on a channel of its own
}

// fakeBroker records publishes; fail makes publishes to a key fail.
type fakeBroker struct {
	mu   sync.Mutex
	pubs []published
	fail map[string]error
}

// publishAlone records as publish does, marked alone: the fake has no
// channels, so tests check which of the two a message went by.
func (b *fakeBroker) publishAlone(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	return b.record(exchange, key, msg, true)
}

func (b *fakeBroker) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	return b.record(exchange, key, msg, false)
}

func (b *fakeBroker) record(exchange, key string, msg amqp.Publishing, alone bool) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.fail[key]; err != nil {
		return err
	}
	b.pubs = append(b.pubs, published{exchange: exchange, key: key, msg: msg, alone: alone})
	return nil
}
func (b *fakeBroker) declare(context.Context, string, amqp.Table, bool) error { return nil }
func (b *fakeBroker) forget(string)                                           {}
func (b *fakeBroker) requeue(ctx context.Context, queue string, msg amqp.Publishing, delay time.Duration) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.fail["requeue"]; err != nil {
		return err
	}
	b.pubs = append(b.pubs, published{key: "requeue", msg: msg, delay: delay})
	return nil
}

func newTestProcessor(t *testing.T, cfg Config, h HandlerFunc) (processor, lock.Store) {
	t.Helper()
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return newProcessorOn(t, store, cfg, h), store
}

// newProcessorOn makes a processor of queue "q" (unless cfg names one) on
// store, stopped when the test ends.
func newProcessorOn(t *testing.T, store lock.Store, cfg Config, h HandlerFunc) processor {
	t.Helper()
	if cfg.Queue == "" {
		cfg.Queue = "q"
	}
	p, err := newProcessor(store, cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	return p
}

func delivery(id, body string) (*amqp.Delivery, *fakeAck) {
	a := &fakeAck{}
	return &amqp.Delivery{Acknowledger: a, MessageId: id, Body: []byte(body), Exchange: "ex", RoutingKey: "rk"}, a
}

func TestProcessOutcomes(t *testing.T) {
	errBoom := errors.New("boom")
	fixed := func() backoff.BackOff { return backoff.NewConstantBackOff(3 * time.Second) }
	tests := []struct {
		name       string
		cfg        Config
		handler    HandlerFunc
		prepare    func(t *testing.T, s lock.Store) // state before the delivery
		id, body   string
		want       Outcome
		wantReason string
		wantAck    bool
		wantRuns   int
		wantPub    string // key of the one publish expected, "" for none
		wantDelay  time.Duration
		wantStatus lock.Status // record afterwards, 0 to skip
	}{
		{name: "new key succeeds", id: "a", body: "x", handler: ok("r"),
			want: Completed, wantAck: true, wantRuns: 1, wantStatus: lock.Completed},
		{name: "duplicate of completed", id: "a", body: "x", handler: ok("r"),
			prepare: completed("a", "x"), want: Duplicate, wantAck: true, wantRuns: 0, wantStatus: lock.Completed},
		{name: "held by another consumer", id: "a", body: "x", handler: ok("r"),
			prepare: holding("a", "x"), want: Busy, wantReason: "in progress elsewhere", wantAck: true,
			wantPub: "requeue", wantDelay: MinInProgressDelay, wantStatus: lock.InProgress},
		{name: "retryable failure", id: "a", body: "x", handler: fails(errBoom), cfg: Config{Backoff: fixed},
			want: Retried, wantReason: "handler error", wantAck: true, wantRuns: 1, wantPub: "requeue", wantDelay: 3 * time.Second},
		{name: "permanent failure", id: "a", body: "x", handler: fails(Permanent(errBoom)),
			want: DeadLettered, wantReason: "permanent failure", wantAck: true, wantRuns: 1, wantPub: "q.dlq", wantStatus: lock.Failed},
		{name: "last attempt fails", id: "a", body: "x", handler: fails(errBoom), cfg: Config{MaxAttempts: 1},
			want: DeadLettered, wantReason: "attempts exhausted", wantAck: true, wantRuns: 1, wantPub: "q.dlq", wantStatus: lock.Failed},
		{name: "backoff says stop", id: "a", body: "x", handler: fails(errBoom),
			cfg:  Config{Backoff: func() backoff.BackOff { return &backoff.StopBackOff{} }},
			want: DeadLettered, wantReason: "attempts exhausted", wantAck: true, wantRuns: 1, wantPub: "q.dlq", wantStatus: lock.Failed},
		{name: "duplicate of failed, dead-lettered", id: "a", body: "x", handler: ok("r"),
			prepare: failed("a", "x"), want: DeadLettered, wantReason: "failed duplicate", wantAck: true, wantPub: "q.dlq", wantStatus: lock.Failed},
		{name: "duplicate of failed, acked", id: "a", body: "x", handler: ok("r"), cfg: Config{FailedDuplicate: AckFailedDuplicate},
			prepare: failed("a", "x"), want: Dropped, wantReason: "failed duplicate", wantAck: true, wantStatus: lock.Failed},
		{name: "same key, other payload", id: "a", body: "y", handler: ok("r"),
			prepare: completed("a", "x"), want: DeadLettered, wantReason: "key conflict", wantAck: true, wantPub: "q.dlq", wantStatus: lock.Completed},
		{name: "other payload, check off", id: "a", body: "y", handler: ok("r"), cfg: Config{SkipFingerprint: true},
			prepare: completed("a", "x"), want: Duplicate, wantAck: true},
		{name: "no key, dead-lettered", id: "", body: "x", handler: ok("r"),
			want: DeadLettered, wantReason: "missing key", wantAck: true, wantPub: "q.dlq"},
		{name: "no key, processed", id: "", body: "x", handler: ok("r"), cfg: Config{MissingKey: ProcessMissingKey},
			want: Completed, wantAck: true, wantRuns: 1},
		{name: "key too long", id: strings.Repeat("k", lock.MaxKeyLen-1), body: "x", handler: ok("r"),
			want: DeadLettered, wantReason: "invalid key", wantAck: true, wantPub: "q.dlq"},
		{name: "key too long, not run unkeyed", id: strings.Repeat("k", lock.MaxKeyLen-1), body: "x", handler: ok("r"),
			cfg:  Config{MissingKey: ProcessMissingKey},
			want: DeadLettered, wantReason: "invalid key", wantAck: true, wantPub: "q.dlq"},
		{name: "longest key", id: strings.Repeat("k", lock.MaxKeyLen-2), body: "x", handler: ok("r"),
			want: Completed, wantAck: true, wantRuns: 1, wantStatus: lock.Completed},
		{name: "panic is retryable", id: "a", body: "x", handler: panics, cfg: Config{Backoff: fixed},
			want: Retried, wantAck: true, wantRuns: 1, wantPub: "requeue", wantDelay: 3 * time.Second},
		{name: "result over the limit", id: "a", body: "x", handler: ok(strings.Repeat("r", 11)), cfg: Config{MaxResultSize: 10},
			want: DeadLettered, wantReason: "result too large", wantAck: true, wantRuns: 1, wantPub: "q.dlq", wantStatus: lock.Failed},
		{name: "empty body is processed", id: "a", body: "", handler: ok("r"),
			want: Completed, wantAck: true, wantRuns: 1, wantStatus: lock.Completed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			runs := 0
			h := func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
				runs++
				return tc.handler(ctx, d)
			}
			p, store := newTestProcessor(t, tc.cfg, h)
			if tc.prepare != nil {
				tc.prepare(t, store)
			}
			b := &fakeBroker{}
			d, ack := delivery(tc.id, tc.body)
			ev := p.process(context.Background(), b, d, nil)

			if ev.Outcome != tc.want {
				t.Fatalf("outcome: got %v (%s, %v), want %v", ev.Outcome, ev.Reason, ev.Err, tc.want)
			}
			if tc.wantReason != "" && ev.Reason != tc.wantReason {
				t.Errorf("reason: got %q, want %q", ev.Reason, tc.wantReason)
			}
			if got := ack.acks == 1 && ack.nacks == 0; got != tc.wantAck {
				t.Errorf("acked once: got %v (acks %d nacks %d), want %v", got, ack.acks, ack.nacks, tc.wantAck)
			}
			if runs != tc.wantRuns {
				t.Errorf("handler runs: got %d, want %d", runs, tc.wantRuns)
			}
			switch {
			case tc.wantPub == "" && len(b.pubs) != 0:
				t.Errorf("publishes: got %+v, want none", b.pubs)
			case tc.wantPub != "" && (len(b.pubs) != 1 || b.pubs[0].key != tc.wantPub):
				t.Errorf("publishes: got %+v, want one to %q", b.pubs, tc.wantPub)
			case tc.wantPub != "" && tc.wantDelay != 0 && b.pubs[0].delay != tc.wantDelay:
				t.Errorf("delay: got %v, want %v", b.pubs[0].delay, tc.wantDelay)
			}
			if tc.wantPub == "q.dlq" {
				h := b.pubs[0].msg.Headers
				if h[HeaderReason] != tc.wantReason || h[HeaderError] == "" || h[HeaderConsumer] == "" ||
					h[HeaderOriginalExchange] != "ex" || h[HeaderOriginalRoutingKey] != "rk" || h[HeaderFirstSeen] == nil {
					t.Errorf("dead letter headers: %v", h)
				}
			}
			if tc.wantStatus != 0 {
				res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", tc.id)})
				if err != nil || res.Status != tc.wantStatus {
					t.Errorf("record afterwards: got %v %v, want %v", res.Status, err, tc.wantStatus)
				}
			}
		})
	}
}

func ok(result string) HandlerFunc {
	return func(context.Context, *amqp.Delivery) ([]byte, error) { return []byte(result), nil }
}

func fails(err error) HandlerFunc {
	return func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, err }
}

func panics(context.Context, *amqp.Delivery) ([]byte, error) { panic("nil map") }

func completed(key, body string) func(*testing.T, lock.Store) {
	return func(t *testing.T, s lock.Store) {
		l := held(key, body)(t, s)
		if err := s.Complete(context.Background(), l, []byte("stored")); err != nil {
			t.Fatal(err)
		}
	}
}

func failed(key, body string) func(*testing.T, lock.Store) {
	return func(t *testing.T, s lock.Store) {
		l := held(key, body)(t, s)
		if err := s.Fail(context.Background(), l, "card declined"); err != nil {
			t.Fatal(err)
		}
	}
}

func holding(key, body string) func(*testing.T, lock.Store) {
	return func(t *testing.T, s lock.Store) { held(key, body)(t, s) }
}

// held takes a lease on key's record, as the processor of queue "q" keeps it.
func held(key, body string) func(*testing.T, lock.Store) lock.Lease {
	return func(t *testing.T, s lock.Store) lock.Lease {
		res, err := s.Acquire(context.Background(), lock.Request{Key: StoreKey("q", key), Fingerprint: fingerprint([]byte(body)), TTL: time.Minute})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("prepare: %v %v", res.Status, err)
		}
		return res.Lease
	}
}
