package amqpidem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

func TestConfigValidateNewFields(t *testing.T) {
	fp := func(*amqp.Delivery) []byte { return nil }
	for _, tc := range []struct {
		name string
		cfg  Config
		want string // in the error; "" for valid
	}{
		{"margin", Config{Queue: "q", SafetyMargin: -time.Second}, "SafetyMargin"},
		{"margin not below TTL", Config{Queue: "q", LeaseTTL: time.Second, SafetyMargin: time.Second}, "shorter than Config.LeaseTTL"},
		{"margin below TTL", Config{Queue: "q", LeaseTTL: time.Second, SafetyMargin: 900 * time.Millisecond}, ""},
		{"timeout", Config{Queue: "q", HandlerTimeout: -1}, "HandlerTimeout"},
		{"fingerprint twice", Config{Queue: "q", SkipFingerprint: true, Fingerprint: fp}, "set one"},
		{"owned delay arg", Config{Queue: "q", DelayQueueArgs: amqp.Table{"x-message-ttl": 5}}, `"x-message-ttl"`},
		{"owned delay arg, dead-lettering", Config{Queue: "q", DelayQueueArgs: amqp.Table{"x-dead-letter-routing-key": "x"}}, "amqpidem sets itself"},
		{"free delay arg", Config{Queue: "q", DelayQueueArgs: amqp.Table{"x-queue-leader-locator": "balanced"}}, ""},
		{"delay args in process", Config{Queue: "q", DelayInProcess: true, DelayQueueArgs: amqp.Table{"x-queue-leader-locator": "balanced"}}, "no use with DelayInProcess"},
		{"delay in process", Config{Queue: "q", DelayInProcess: true}, ""},
	} {
		err := tc.cfg.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v, want valid", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.want)
		}
	}
}

// The delay queue arguments a user adds are declared with amqpidem's own.
func TestDelayQueueArgsAdded(t *testing.T) {
	for _, qt := range []string{queueClassic, queueQuorum} {
		got := delayQueueArgs("orders", qt, time.Second, amqp.Table{"x-queue-leader-locator": "balanced"})
		if got["x-queue-leader-locator"] != "balanced" || got["x-message-ttl"] != int64(1000) || got["x-queue-type"] != qt {
			t.Errorf("%s: %v", qt, got)
		}
	}
}

// Warnings and errors reach slog.Default() unless the user says otherwise:
// a dead letter is not silent by default.
func TestLoggerDefaultsToSlogDefault(t *testing.T) {
	var buf bytes.Buffer
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo})))
	t.Cleanup(func() { slog.SetDefault(old) })

	p, _ := newTestProcessor(t, Config{}, fails(Permanent(errors.New("card declined"))))
	d, _ := delivery("a", "x")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != DeadLettered {
		t.Fatalf("outcome %v", ev.Outcome)
	}
	// A completed message is not worth a line at info.
	p, _ = newTestProcessor(t, Config{}, ok("r"))
	d, _ = delivery("b", "x")
	p.process(context.Background(), &fakeBroker{}, d, nil)
	out := buf.String()
	if !strings.Contains(out, "level=WARN") || !strings.Contains(out, "card declined") {
		t.Errorf("slog.Default() got no warning of the dead letter:\n%s", out)
	}
	if strings.Contains(out, "key=b") {
		t.Errorf("a completed message was logged at info:\n%s", out)
	}
}

// Zero LeaseTTL and Retention leave them to the store's configuration:
// there is one place where they are set.
func TestLeaseTTLFromStore(t *testing.T) {
	store, err := lock.NewMemoryStore(lock.Config{LeaseTTL: 1500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var got time.Duration
	p := newProcessorOn(t, store, Config{}, func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		l, _ := heartbeat.LeaseFromContext(ctx)
		got = l.TTL
		return nil, nil
	})
	d, _ := delivery("a", "x")
	p.process(context.Background(), &fakeBroker{}, d, nil)
	if got != 1500*time.Millisecond {
		t.Errorf("lease TTL %v, want the store's 1.5s", got)
	}
	// Set here, it wins.
	p = newProcessorOn(t, store, Config{LeaseTTL: 700 * time.Millisecond}, func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		l, _ := heartbeat.LeaseFromContext(ctx)
		got = l.TTL
		return nil, nil
	})
	d, _ = delivery("b", "x")
	p.process(context.Background(), &fakeBroker{}, d, nil)
	if got != 700*time.Millisecond {
		t.Errorf("lease TTL %v, want Config.LeaseTTL 700ms", got)
	}
}

// SafetyMargin reaches the keeper: with renewals failing, the handler is
// cancelled SafetyMargin before its lease's deadline.
func TestSafetyMarginReachesKeeper(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := noExtend{mem}
	var ran time.Duration
	p := newProcessorOn(t, store, Config{LeaseTTL: time.Second, SafetyMargin: 800 * time.Millisecond},
		func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			t0 := time.Now()
			select {
			case <-ctx.Done():
			case <-time.After(5 * time.Second):
			}
			ran = time.Since(t0)
			return nil, ctx.Err()
		})
	d, _ := delivery("a", "x")
	p.process(context.Background(), &fakeBroker{}, d, nil)
	// Cancelled at deadline - margin = 200ms after the lease was taken;
	// the default margin (a fifth) would give 800ms.
	if ran > 600*time.Millisecond {
		t.Errorf("handler ran %v with renewals failing; want it cancelled about 200ms in", ran)
	}
}

// noExtend is a store whose renewals fail.
type noExtend struct{ lock.Store }

func (noExtend) Extend(_ context.Context, leases ...lock.Lease) []error {
	errs := make([]error, len(leases))
	for i := range errs {
		errs[i] = fmt.Errorf("%w: test", lock.ErrUnavailable)
	}
	return errs
}

func TestHandlerTimeout(t *testing.T) {
	hangs := func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	fixed := func() backoff.BackOff { return backoff.NewConstantBackOff(3 * time.Second) }
	p, store := newTestProcessor(t, Config{HandlerTimeout: 50 * time.Millisecond, Backoff: fixed}, hangs)
	b := &fakeBroker{}
	d, ack := delivery("a", "x")
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != Retried || ev.Reason != "handler timeout" || !errors.Is(ev.Err, ErrHandlerTimeout) || ack.acks != 1 {
		t.Fatalf("got %v %q %v (acks %d), want retried, handler timeout", ev.Outcome, ev.Reason, ev.Err, ack.acks)
	}
	if len(b.pubs) != 1 || b.pubs[0].delay != 3*time.Second {
		t.Errorf("publishes %+v, want one requeue after the backoff", b.pubs)
	}
	if res, _ := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a"), Fingerprint: fingerprint([]byte("x"))}); res.Status != lock.Acquired || res.Attempts != 2 {
		t.Errorf("record: %v attempts %d, want released with the attempt counted", res.Status, res.Attempts)
	}

	// On the last attempt it is dead-lettered; a result returned in time
	// after all is kept.
	p, _ = newTestProcessor(t, Config{HandlerTimeout: 50 * time.Millisecond, MaxAttempts: 1}, hangs)
	b = &fakeBroker{}
	d, _ = delivery("a", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != DeadLettered || !strings.Contains(fmt.Sprint(b.pubs[0].msg.Headers[HeaderError]), "handler timeout") {
		t.Errorf("last attempt: %v %q, headers %v", ev.Outcome, ev.Reason, b.pubs[0].msg.Headers)
	}
	late := func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		<-ctx.Done()
		return []byte("done anyway"), nil
	}
	p, _ = newTestProcessor(t, Config{HandlerTimeout: 50 * time.Millisecond}, late)
	d, _ = delivery("a", "x")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
		t.Errorf("a result returned after the timeout: %v %q, want completed", ev.Outcome, ev.Reason)
	}
	// Unkeyed handlers are bounded too.
	p, _ = newTestProcessor(t, Config{HandlerTimeout: 50 * time.Millisecond, MissingKey: ProcessMissingKey, Backoff: fixed}, hangs)
	d, _ = delivery("", "x")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Retried || ev.Reason != "handler timeout" {
		t.Errorf("unkeyed: %v %q, want retried, handler timeout", ev.Outcome, ev.Reason)
	}
}

// A handler whose sink saw a newer fence returns ErrStale: the execution is
// discarded, not counted, and the message comes back soon for the record
// to decide.
func TestHandlerErrStale(t *testing.T) {
	p, store := newTestProcessor(t, Config{}, fails(fmt.Errorf("ledger refused fence: %w", ErrStale)))
	b := &fakeBroker{}
	d, ack := delivery("a", "x")
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != Abandoned || ev.Reason != "stale fence" || ev.Attempt != 0 || ack.acks != 1 {
		t.Fatalf("got %v %q attempt %d acks %d, want abandoned, stale fence, attempt 0", ev.Outcome, ev.Reason, ev.Attempt, ack.acks)
	}
	if len(b.pubs) != 1 || b.pubs[0].key != "requeue" || b.pubs[0].delay != MinInProgressDelay {
		t.Errorf("publishes %+v, want one requeue after %v", b.pubs, MinInProgressDelay)
	}
	res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a"), Fingerprint: fingerprint([]byte("x"))})
	if err != nil || res.Status != lock.Acquired || res.Attempts != 1 {
		t.Errorf("record: %v attempts %d %v, want free with no attempt counted", res.Status, res.Attempts, err)
	}
}

// A busy duplicate that has waited often (HeaderBusy at its bound) waits
// what the holder's lease has left, within bounds.
func TestBusyDelayFollowsTheLease(t *testing.T) {
	for _, tc := range []struct {
		name     string
		ttl      time.Duration
		cfg      Config
		min, max time.Duration
	}{
		{"short lease", 2 * time.Second, Config{}, 1800 * time.Millisecond, 2200 * time.Millisecond},
		{"long lease, capped", 10 * time.Minute, Config{}, DefaultInProgressDelay, DefaultInProgressDelay},
		{"capped by config", 10 * time.Second, Config{InProgressDelay: 3 * time.Second}, 3 * time.Second, 3 * time.Second},
		{"tiny lease, floor", 20 * time.Millisecond, Config{}, MinInProgressDelay, MinInProgressDelay},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, store := newTestProcessor(t, tc.cfg, ok("r"))
			res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a"), Fingerprint: fingerprint([]byte("x")), TTL: tc.ttl})
			if err != nil || res.Status != lock.Acquired {
				t.Fatal(res.Status, err)
			}
			b := &fakeBroker{}
			d, _ := delivery("a", "x")
			d.Headers = amqp.Table{HeaderBusy: int64(maxBusyDoublings)}
			ev := p.process(context.Background(), b, d, nil)
			if ev.Outcome != Busy || len(b.pubs) != 1 {
				t.Fatalf("%v %q %+v", ev.Outcome, ev.Reason, b.pubs)
			}
			if got := b.pubs[0].delay; got < tc.min || got > tc.max {
				t.Errorf("delay %v, want within [%v, %v]", got, tc.min, tc.max)
			}
		})
	}
}

// The user picks what the payload check compares.
func TestFingerprintFunc(t *testing.T) {
	// The order, without the "at" timestamp the producer regenerates.
	order := func(d *amqp.Delivery) []byte { b, _, _ := bytes.Cut(d.Body, []byte(";at=")); return b }
	p, store := newTestProcessor(t, Config{Fingerprint: order}, ok("r"))
	d, _ := delivery("a", "sku=1;at=10:00")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
		t.Fatalf("first: %v", ev.Outcome)
	}
	d, _ = delivery("a", "sku=1;at=10:05")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Duplicate {
		t.Errorf("same order, new timestamp: %v %q, want duplicate", ev.Outcome, ev.Reason)
	}
	d, _ = delivery("a", "sku=2;at=10:05")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != DeadLettered || ev.Reason != "key conflict" {
		t.Errorf("other order: %v %q, want key conflict", ev.Outcome, ev.Reason)
	}
	_ = store
	// nil skips the check for that message.
	p, _ = newTestProcessor(t, Config{Fingerprint: func(*amqp.Delivery) []byte { return nil }}, ok("r"))
	for _, body := range []string{"one", "two"} {
		d, _ = delivery("b", body)
		if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome == DeadLettered {
			t.Errorf("nil fingerprint: %q dead-lettered (%s)", body, ev.Reason)
		}
	}
}

// The dead-letter queue is declared with DeadLetterQueueArgs.
func TestDeadLetterQueueArgs(t *testing.T) {
	p, _ := newTestProcessor(t, Config{DeadLetterQueueArgs: amqp.Table{"x-queue-type": "quorum"}}, fails(Permanent(errors.New("no"))))
	b := &declaringBroker{}
	d, _ := delivery("a", "x")
	p.process(context.Background(), b, d, nil)
	if b.name != "q.dlq" || b.args["x-queue-type"] != "quorum" {
		t.Errorf("declared %q with %v, want q.dlq with x-queue-type quorum", b.name, b.args)
	}
}

type declaringBroker struct {
	fakeBroker
	name string
	args amqp.Table
}

func (b *declaringBroker) declare(_ context.Context, name string, args amqp.Table, _ bool) error {
	b.name, b.args = name, args
	return nil
}

// Retention shorter than twice LeaseTTL and a second is refused, for
// every kind of handler:
// a completed record would expire before the claim its execution holds
// on its staged messages (a lease TTL) lets a copy publish them, and a
// copy arriving after a crash would find no record and run the handler
// again.
func TestConfigRetentionAtLeastLeaseTTL(t *testing.T) {
	for _, tc := range []struct {
		cfg Config
		ok  bool
	}{
		{Config{Queue: "q", LeaseTTL: 10 * time.Second, Retention: 5 * time.Second}, false},
		{Config{Queue: "q", LeaseTTL: 10 * time.Second, Retention: 10*time.Second - time.Millisecond}, false},
		// Equal is not enough: a copy waits 1.1 times the claim's rest.
		{Config{Queue: "q", LeaseTTL: 10 * time.Second, Retention: 10 * time.Second}, false},
		{Config{Queue: "q", LeaseTTL: 10 * time.Second, Retention: 21*time.Second - time.Millisecond}, false},
		{Config{Queue: "q", LeaseTTL: 10 * time.Second, Retention: 21 * time.Second}, true},
		{Config{Queue: "q", LeaseTTL: 10 * time.Second, Retention: time.Hour}, true},
		// One of them left to the store: only the lease shows whether
		// the two agree (a warning when they do not).
		{Config{Queue: "q", Retention: time.Second}, true},
		{Config{Queue: "q", LeaseTTL: time.Hour}, true},
	} {
		err := tc.cfg.Validate()
		if tc.ok {
			if err != nil {
				t.Errorf("LeaseTTL %v, Retention %v: %v", tc.cfg.LeaseTTL, tc.cfg.Retention, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), "Config.Retention") || !strings.Contains(err.Error(), "Config.LeaseTTL") {
			t.Errorf("LeaseTTL %v, Retention %v: got %v, want an error naming Config.Retention and Config.LeaseTTL", tc.cfg.LeaseTTL, tc.cfg.Retention, err)
		}
	}
	mem := mustMemory(t)
	cfg := Config{Queue: "q", LeaseTTL: time.Minute, Retention: 30 * time.Second}
	for _, h := range []struct {
		kind string
		h    Handler
	}{
		{"Handler", ok("r")},
		{"Completer", &stagingCompleter{store: mem}},
		{"LeaseTaker", panickyTaker{&fakeCompleter{store: mem, owner: mem}}},
	} {
		if _, err := newProcessor(mem, cfg, h.h); err == nil || !strings.Contains(err.Error(), "Config.Retention") {
			t.Errorf("%s: got %v, want a Retention too short for LeaseTTL refused", h.kind, err)
		}
	}
}

// The lease shows a Retention too short for the lease TTL that the two places
// they are set in made together (the store's configuration, Config): the
// first execution that stages messages under such a lease says so, once.
func TestRetentionBelowLeaseTTLFromStoreWarned(t *testing.T) {
	store, err := lock.NewMemoryStore(lock.Config{LeaseTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	// 90 s: above the TTL, below twice it and a second.
	p := newProcessorOn(t, store, Config{Retention: 90 * time.Second, Logger: slog.New(slog.NewTextHandler(&logs, nil))}, stager(1, nil))
	for _, key := range []string{"a", "b"} {
		d, _ := delivery(key, "x")
		if ev := p.process(context.Background(), &outboxBroker{}, d, nil); ev.Outcome != Completed {
			t.Fatalf("%s: %v %q %v", key, ev.Outcome, ev.Reason, ev.Err)
		}
	}
	if n := strings.Count(logs.String(), "retention too short for the lease TTL"); n != 1 {
		t.Fatalf("logged %d times, want once:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "retention=1m30s") || !strings.Contains(logs.String(), "lease_ttl=1m0s") {
		t.Fatalf("the warning does not give both:\n%s", logs.String())
	}
}

// A duplicate right behind work in progress looks again soon, then ever
// less often: it waits MinInProgressDelay, doubled at each look (counted
// in the copy's HeaderBusy), within the holder's lease and InProgressDelay;
// and a copy that runs forgets the count. Before, it waited the whole
// lease (30 s by default) at once, even when the work ended 10 ms later.
func TestBusyDelayGrows(t *testing.T) {
	p, store := newTestProcessor(t, Config{}, ok("r"))
	held("a", "x")(t, store) // a minute's lease
	d, _ := delivery("a", "x")
	want := []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second, 4 * time.Second,
		8 * time.Second, 16 * time.Second, DefaultInProgressDelay, DefaultInProgressDelay}
	for i, w := range want {
		b := &fakeBroker{}
		ev := p.process(context.Background(), b, d, nil)
		if ev.Outcome != Busy || len(b.pubs) != 1 || b.pubs[0].delay != w {
			t.Fatalf("look %d: %v %q, publishes %+v; want busy for %v", i+1, ev.Outcome, ev.Reason, b.pubs, w)
		}
		if n, _ := headerInt64(b.pubs[0].msg.Headers[HeaderBusy]); n != int64(min(i+1, maxBusyDoublings+1)) {
			t.Fatalf("look %d: %s %v", i+1, HeaderBusy, b.pubs[0].msg.Headers[HeaderBusy])
		}
		d, _ = delivery("a", "x")
		d.Headers = b.pubs[0].msg.Headers
	}
	// Once the key is free (another store here), the copy runs; failing
	// retryably, its next copy starts the count afresh.
	p2, _ := newTestProcessor(t, Config{Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(time.Second) }}, fails(errors.New("again")))
	b := &fakeBroker{}
	if ev := p2.process(context.Background(), b, d, nil); ev.Outcome != Retried || len(b.pubs) != 1 {
		t.Fatalf("retry: %v %q %+v", ev.Outcome, ev.Reason, b.pubs)
	}
	if v, ok := b.pubs[0].msg.Headers[HeaderBusy]; ok {
		t.Errorf("a retried copy carries %s %v", HeaderBusy, v)
	}
}
