package amqpidem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// outboxBroker is a fakeBroker whose publishes to the routing key "next"
// (where the tests' handlers stage) answer what fail says: it also keeps
// the order of publishes and acks in log.
type outboxBroker struct {
	fakeBroker
	mu sync.Mutex
	// fail answers a publish to "next" with its error; with taken set,
	// the broker took the message all the same (a confirm lost).
	fail  error
	taken bool
	next  []amqp.Publishing // messages the broker took on "next"
	log   *[]string
}

func (b *outboxBroker) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if key != "next" {
		return b.fakeBroker.publish(ctx, exchange, key, msg)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fail == nil || b.taken {
		b.next = append(b.next, msg)
		if b.log != nil {
			*b.log = append(*b.log, "publish "+msg.MessageId)
		}
	}
	return b.fail
}

func (b *outboxBroker) published() []amqp.Publishing {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]amqp.Publishing(nil), b.next...)
}

// loggingAck is a fakeAck that notes its acks in log.
type loggingAck struct {
	fakeAck
	log *[]string
}

func (a *loggingAck) Ack(tag uint64, multiple bool) error {
	*a.log = append(*a.log, "ack")
	return a.fakeAck.Ack(tag, multiple)
}

// stager returns a handler that stages n messages to "next", the first
// with the MessageId "own", the others with none, then returns err.
func stager(n int, err error) HandlerFunc {
	return func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		for i := range n {
			msg := amqp.Publishing{Body: []byte(fmt.Sprintf("%s-%d", d.Body, i)), Headers: amqp.Table{"n": int32(i)}}
			if i == 0 {
				msg.MessageId = "own"
			}
			if e := Stage(ctx, "", "next", msg); e != nil {
				return nil, e
			}
		}
		return []byte("done"), err
	}
}

// storedStates returns the states of the staged messages in key's record.
func storedStates(t *testing.T, s lock.Store, key string) []OutboxState {
	t.Helper()
	res, err := s.Acquire(context.Background(), lock.Request{Key: StoreKey("q", key)})
	if err != nil || res.Status != lock.Completed {
		t.Fatalf("record of %s: %v %v, want completed", key, res.Status, err)
	}
	msgs, err := StoredOutbox(res.Value)
	if err != nil {
		t.Fatal(err)
	}
	var states []OutboxState
	for _, m := range msgs {
		states = append(states, m.State)
	}
	return states
}

// TestOutboxPublishedBeforeAck checks the way of staged messages when all
// goes well: stored with the result, published in the order staged, each
// with its MessageId (the handler's, else one derived from the key and its
// index), persistent, then the delivery acked, and the record marks them
// published.
func TestOutboxPublishedBeforeAck(t *testing.T) {
	p, s := newTestProcessor(t, Config{}, stager(3, nil))
	var log []string
	b := &outboxBroker{log: &log}
	d, _ := delivery("a", "x")
	d.Acknowledger = &loggingAck{log: &log}
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != Completed || ev.Outbox != (OutboxCounts{Staged: 3, Published: 3}) {
		t.Fatalf("event: %v %q %+v %v", ev.Outcome, ev.Reason, ev.Outbox, ev.Err)
	}
	o := outbox{idBase: StoreKey("q", "a")}
	wantIDs := []string{"own", o.messageID(1), o.messageID(2)}
	got := b.published()
	if len(got) != 3 {
		t.Fatalf("published %d messages, want 3", len(got))
	}
	for i, m := range got {
		if m.MessageId != wantIDs[i] || string(m.Body) != fmt.Sprintf("x-%d", i) || m.DeliveryMode != amqp.Persistent || m.Headers["n"] != int32(i) {
			t.Errorf("message %d: id %q body %q mode %d headers %v; want id %q", i, m.MessageId, m.Body, m.DeliveryMode, m.Headers, wantIDs[i])
		}
	}
	if !strings.HasPrefix(wantIDs[1], "amqpidem-") || wantIDs[1] == wantIDs[2] {
		t.Fatalf("derived ids %q %q", wantIDs[1], wantIDs[2])
	}
	if want := []string{"publish own", "publish " + wantIDs[1], "publish " + wantIDs[2], "ack"}; fmt.Sprint(log) != fmt.Sprint(want) {
		t.Fatalf("order: %v, want %v", log, want)
	}
	if states := storedStates(t, s, "a"); fmt.Sprint(states) != "[published published published]" {
		t.Fatalf("record: %v", states)
	}
	// A later duplicate publishes nothing again, and gets the result.
	d2, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d2, nil); ev.Outcome != Duplicate || ev.Outbox != (OutboxCounts{}) || len(b.published()) != 3 {
		t.Fatalf("duplicate: %v %+v, %d published", ev.Outcome, ev.Outbox, len(b.published()))
	}
}

// leaseLosingStore refuses every Complete: the lease was taken over.
type leaseLosingStore struct{ *lock.MemoryStore }

// noAmendStore hides its store's Amend, as a wrapper that does not
// forward it does.
type noAmendStore struct{ lock.Store }

func (s leaseLosingStore) Complete(context.Context, lock.Lease, []byte) error {
	return fmt.Errorf("%w: taken over", lock.ErrLeaseLost)
}

// TestOutboxNothingWithoutOutcome checks that an execution whose outcome
// is not stored publishes nothing it staged: a handler error, a permanent
// failure, a panic, a timeout, a lease lost before the completion.
func TestOutboxNothingWithoutOutcome(t *testing.T) {
	errBoom := errors.New("boom")
	panics := HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		_ = Stage(ctx, "", "next", amqp.Publishing{Body: []byte("x")})
		panic("boom")
	})
	slow := HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		_ = Stage(ctx, "", "next", amqp.Publishing{Body: []byte("x")})
		<-ctx.Done()
		return nil, ctx.Err()
	})
	for _, tc := range []struct {
		name    string
		h       HandlerFunc
		cfg     Config
		lose    bool
		want    Outcome
		wantWhy string
	}{
		{"handler error", stager(2, errBoom), Config{}, false, Retried, "handler error"},
		{"permanent", stager(2, Permanent(errBoom)), Config{}, false, DeadLettered, "permanent failure"},
		{"panic", panics, Config{}, false, Retried, "handler error"},
		{"timeout", slow, Config{HandlerTimeout: 20 * time.Millisecond}, false, Retried, "handler timeout"},
		{"lease lost", stager(2, nil), Config{}, true, Abandoned, "lease lost"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem, err := lock.NewMemoryStore(lock.Config{})
			if err != nil {
				t.Fatal(err)
			}
			var store lock.Store = mem
			if tc.lose {
				store = leaseLosingStore{mem}
			}
			p := newProcessorOn(t, store, tc.cfg, tc.h)
			b := &outboxBroker{}
			d, _ := delivery("a", "x")
			ev := p.process(context.Background(), b, d, nil)
			if ev.Outcome != tc.want || ev.Reason != tc.wantWhy || len(b.published()) != 0 || ev.Outbox != (OutboxCounts{}) {
				t.Fatalf("%v %q, %d published, %+v; want %v %q and nothing published", ev.Outcome, ev.Reason, len(b.published()), ev.Outbox, tc.want, tc.wantWhy)
			}
		})
	}
}

// TestOutboxCrashAfterStore stands for a process that died after its
// outcome was stored and before its staged messages were published (the
// broker gone: nothing published, nothing acked): the next copy of the
// message finds them pending, publishes them with the same MessageIds,
// records that, and is acked; the copy after it publishes nothing.
func TestOutboxCrashAfterStore(t *testing.T) {
	p, s := newTestProcessor(t, Config{}, stager(2, nil))
	gone := errors.New("connection closed")
	b := &outboxBroker{fail: gone}
	d, ack := delivery("a", "x")
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != Abandoned || ev.Reason != "outbox not published" || ev.Outbox.Staged != 2 || ev.Outbox.Published != 0 || ack.acks != 1 {
		t.Fatalf("first: %v %q %+v acks %d", ev.Outcome, ev.Reason, ev.Outbox, ack.acks)
	}
	if states := storedStates(t, s, "a"); fmt.Sprint(states) != "[pending pending]" {
		t.Fatalf("record after the crash: %v", states)
	}
	b.fail = nil
	d2, _ := delivery("a", "x")
	ev = p.process(context.Background(), b, d2, nil)
	if ev.Outcome != Duplicate || ev.Outbox != (OutboxCounts{Published: 2, Republished: 2}) {
		t.Fatalf("second: %v %q %+v %v", ev.Outcome, ev.Reason, ev.Outbox, ev.Err)
	}
	o := outbox{idBase: StoreKey("q", "a")}
	if got := b.published(); len(got) != 2 || got[0].MessageId != "own" || got[1].MessageId != o.messageID(1) {
		t.Fatalf("republished: %v", got)
	}
	if states := storedStates(t, s, "a"); fmt.Sprint(states) != "[published published]" {
		t.Fatalf("record: %v", states)
	}
	d3, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d3, nil); ev.Outcome != Duplicate || len(b.published()) != 2 {
		t.Fatalf("third: %v, %d published", ev.Outcome, len(b.published()))
	}
}

// TestOutboxLostConfirm: the broker took a message but its confirm was
// lost. The message is published again, with the same MessageId, by the
// next copy: a duplicate downstream, never a loss.
func TestOutboxLostConfirm(t *testing.T) {
	p, s := newTestProcessor(t, Config{}, stager(1, nil))
	b := &outboxBroker{fail: context.DeadlineExceeded, taken: true}
	d, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Abandoned || ev.Reason != "outbox not published" {
		t.Fatalf("first: %v %q", ev.Outcome, ev.Reason)
	}
	b.fail, b.taken = nil, false
	d2, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d2, nil); ev.Outcome != Duplicate || ev.Outbox.Republished != 1 {
		t.Fatalf("second: %v %q %+v", ev.Outcome, ev.Reason, ev.Outbox)
	}
	got := b.published()
	if len(got) != 2 || got[0].MessageId != "own" || got[1].MessageId != "own" || !bytes.Equal(got[0].Body, got[1].Body) {
		t.Fatalf("published: %v", got)
	}
	if states := storedStates(t, s, "a"); fmt.Sprint(states) != "[published]" {
		t.Fatalf("record: %v", states)
	}
}

// TestOutboxUnavailableNotCounted: publishes that fail on the way (a
// plain nack, the connection lost with the confirm outstanding, the
// broker closing the connection) are not tries: any number of copies
// later the message is still pending, with no try counted, and the next
// copy the broker takes it from publishes it.
func TestOutboxUnavailableNotCounted(t *testing.T) {
	p, s := newTestProcessor(t, Config{MaxAttempts: 2}, stager(1, nil))
	b := &outboxBroker{}
	for i, err := range []error{
		fmt.Errorf("%w: exchange \"\" routing key \"next\"", ErrNotConfirmed),
		fmt.Errorf("%w: the broker closed the channel: %w", ErrNotConfirmed, &amqp.Error{Code: amqp.FrameError, Reason: "EOF"}),
		fmt.Errorf("%w: the broker closed the channel: %w", ErrNotConfirmed, &amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED"}),
		fmt.Errorf("%w: the broker closed the channel: %w", ErrNotConfirmed, amqp.ErrClosed),
	} {
		b.fail = err
		d, _ := delivery("a", "x")
		ev := p.process(context.Background(), b, d, nil)
		if ev.Outcome != Abandoned || ev.Reason != "outbox not published" || ev.Outbox.Returned != 0 {
			t.Fatalf("copy %d (%v): %v %q %+v; want requeued, nothing given up", i, err, ev.Outcome, ev.Reason, ev.Outbox)
		}
		res, _ := s.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a")})
		msgs, _ := StoredOutbox(res.Value)
		if len(msgs) != 1 || msgs[0].State != OutboxPending || msgs[0].Tries != 0 {
			t.Fatalf("copy %d (%v): record %+v; want pending with no try counted", i, err, msgs)
		}
	}
	b.fail = nil
	d, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Duplicate || ev.Outbox.Republished != 1 || len(b.published()) != 1 {
		t.Fatalf("once the broker takes it: %v %q %+v", ev.Outcome, ev.Reason, ev.Outbox)
	}
}

// TestOutboxReturnedGivenUp: a message no queue takes is tried with each
// copy, after UnavailableDelay, and given up after MaxAttempts tries:
// counted, logged, kept in the record as returned; the delivery is then
// acked, as OutboxGivenUp (not as a duplicate: issue 42, item 5), and so
// logged.
func TestOutboxReturnedGivenUp(t *testing.T) {
	var logs bytes.Buffer
	cfg := Config{MaxAttempts: 3, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
	p, s := newTestProcessor(t, cfg, stager(1, nil))
	b := &outboxBroker{fail: fmt.Errorf("%w: 312 NO_ROUTE", ErrUnroutable)}
	var evs []Event
	for i := range 3 {
		d, _ := delivery("a", "x")
		evs = append(evs, p.process(context.Background(), b, d, nil))
		if i < 2 && (evs[i].Outcome != Abandoned || evs[i].Reason != "outbox returned" || evs[i].Delay != DefaultUnavailableDelay) {
			t.Fatalf("copy %d: %v %q %v", i, evs[i].Outcome, evs[i].Reason, evs[i].Delay)
		}
	}
	if last := evs[2]; last.Outcome != OutboxGivenUp || last.Outbox.Returned != 1 {
		t.Fatalf("last copy: %v %q %+v", last.Outcome, last.Reason, last.Outbox)
	}
	res, _ := s.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a")})
	msgs, err := StoredOutbox(res.Value)
	if err != nil || len(msgs) != 1 || msgs[0].State != OutboxReturned || msgs[0].Tries != 3 || msgs[0].RoutingKey != "next" {
		t.Fatalf("record: %+v %v", msgs, err)
	}
	if !strings.Contains(logs.String(), "staged message given up") {
		t.Fatalf("no warning logged:\n%s", logs.String())
	}
	if got := logs.String(); !strings.Contains(got, `msg="amqpidem: message outbox_given_up"`) || !strings.Contains(got, "outcome=outbox_given_up") ||
		strings.Contains(got, "outcome=duplicate") {
		t.Fatalf("the last copy is not logged as outbox_given_up:\n%s", got)
	}
	// Nothing more happens to it with later copies: an operator re-drives it.
	b.fail = nil
	d, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Duplicate || len(b.published()) != 0 {
		t.Fatalf("after giving up: %v, %d published", ev.Outcome, len(b.published()))
	}
}

// mustMemory returns a new MemoryStore.
func mustMemory(t *testing.T) *lock.MemoryStore {
	t.Helper()
	s, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// staleStore answers Acquire of a completed key with the value it had
// first: another delivery amended the record in between.
type staleStore struct {
	lock.Store
	first []byte
}

func (s *staleStore) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	return s.Store.(lock.Amender).Amend(ctx, key, fence, old, value)
}

func (s *staleStore) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	res, err := s.Store.Acquire(ctx, req)
	if res.Status == lock.Completed && s.first != nil {
		res.Value = s.first
	}
	return res, err
}

// TestOutboxChangedMeanwhile: a copy that publishes pending messages of a
// record another copy amended meanwhile is told so by the store and looks
// again shortly, rather than overwrite what the other recorded.
func TestOutboxChangedMeanwhile(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	store := &staleStore{Store: mem}
	p := newProcessorOn(t, store, Config{}, stager(1, nil))
	b := &outboxBroker{fail: errors.New("connection closed")}
	d, _ := delivery("a", "x")
	p.process(context.Background(), b, d, nil) // stored, pending
	res, _ := mem.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a")})
	store.first = res.Value
	// The other copy's outcome differs from what this one will record (it
	// gave the message up), so that the store cannot take this one's for a
	// retry of the same write.
	other, err := SetOutboxState(res.Value, 0, OutboxReturned)
	if err != nil {
		t.Fatal(err)
	}
	if err := mem.Amend(context.Background(), StoreKey("q", "a"), res.Fence, res.Value, other); err != nil {
		t.Fatal(err)
	}
	b.fail = nil
	d2, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d2, nil); ev.Outcome != Abandoned || ev.Reason != "outbox changed" || ev.Delay != MinInProgressDelay {
		t.Fatalf("stale copy: %v %q %v %v", ev.Outcome, ev.Reason, ev.Delay, ev.Err)
	}
}

// TestStageRefusals: Stage outside a handler, after it returned, past
// MaxStaged or the store's size, and a message AMQP cannot carry.
func TestStageRefusals(t *testing.T) {
	if err := Stage(context.Background(), "", "next", amqp.Publishing{}); !errors.Is(err, ErrNoOutbox) {
		t.Fatalf("outside a handler: %v", err)
	}
	var late func() error
	var errs []error
	h := HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		late = func() error { return Stage(ctx, "", "next", amqp.Publishing{}) }
		errs = append(errs, Stage(ctx, "", "next", amqp.Publishing{Headers: amqp.Table{"bad": struct{}{}}}))
		errs = append(errs, Stage(ctx, "", strings.Repeat("k", 256), amqp.Publishing{}))
		for range 3 {
			errs = append(errs, Stage(ctx, "", "next", amqp.Publishing{Body: []byte("x")}))
		}
		return nil, nil
	})
	p, _ := newTestProcessor(t, Config{MaxStaged: 2}, h)
	d, _ := delivery("a", "x")
	ev := p.process(context.Background(), &outboxBroker{}, d, nil)
	if ev.Outbox.Staged != 2 {
		t.Fatalf("staged %d, want 2", ev.Outbox.Staged)
	}
	if errs[0] == nil || errors.Is(errs[0], ErrOutboxFull) || errs[1] == nil || errors.Is(errs[1], ErrOutboxFull) ||
		errs[2] != nil || errs[3] != nil || !errors.Is(errs[4], ErrOutboxFull) {
		t.Fatalf("errors: %v", errs)
	}
	if err := late(); !errors.Is(err, ErrNoOutbox) {
		t.Fatalf("after the handler returned: %v", err)
	}

	// A store that cannot amend records keeps no outbox: said at once.
	p3 := newProcessorOn(t, noAmendStore{mustMemory(t)}, Config{}, stager(1, nil))
	d3, _ := delivery("c", "x")
	if ev := p3.process(context.Background(), &outboxBroker{}, d3, nil); !errors.Is(ev.Err, ErrNoOutbox) || !strings.Contains(ev.Err.Error(), "lock.Amender") {
		t.Fatalf("store without Amend: %v %q %v", ev.Outcome, ev.Reason, ev.Err)
	}

	// Bytes: the store keeps 64 KiB with the result by default.
	big := HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		if err := Stage(ctx, "", "next", amqp.Publishing{Body: make([]byte, 40<<10)}); err != nil {
			return nil, err
		}
		return nil, Stage(ctx, "", "next", amqp.Publishing{Body: make([]byte, 40<<10)})
	})
	p2, _ := newTestProcessor(t, Config{MaxAttempts: 1}, big)
	d2, _ := delivery("b", "x")
	if ev := p2.process(context.Background(), &outboxBroker{}, d2, nil); ev.Outcome != DeadLettered || !errors.Is(ev.Err, ErrOutboxFull) {
		t.Fatalf("too many bytes: %v %q %v", ev.Outcome, ev.Reason, ev.Err)
	}
}

// TestOutboxTooLargeWithResult: staged messages and a result that fit
// apart but not together fail the message for good at completion, as a
// result too large does, and publish nothing.
func TestOutboxTooLargeWithResult(t *testing.T) {
	h := HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		if err := Stage(ctx, "", "next", amqp.Publishing{Body: make([]byte, 40<<10)}); err != nil {
			return nil, err
		}
		return make([]byte, 30<<10), nil
	})
	p, _ := newTestProcessor(t, Config{}, h)
	b := &outboxBroker{}
	d, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != DeadLettered || ev.Reason != "result too large" || len(b.published()) != 0 {
		t.Fatalf("%v %q %v, %d published", ev.Outcome, ev.Reason, ev.Err, len(b.published()))
	}
}

// TestOutboxFullFitsWithReply: an outbox filled to exactly what Stage
// accepts, with a delivery that has a ReplyTo and an empty result, is
// stored, published and replied to, with a Handler and with a Completer;
// one byte more, and Stage refuses it. (Stage's bound left out the claim's
// 8 bytes: such an outbox failed "result too large" at completion and the
// message was dead-lettered after its work was done, its staged messages
// dropped.)
func TestOutboxFullFitsWithReply(t *testing.T) {
	for _, limit := range []int{1024, 5000, lock.DefaultMaxResultSize} {
		for _, completer := range []bool{false, true} {
			t.Run(fmt.Sprint(limit, map[bool]string{false: " handler", true: " completer"}[completer]), func(t *testing.T) {
				testOutboxFullFitsWithReply(t, limit, completer)
			})
		}
	}
}

func testOutboxFullFitsWithReply(t *testing.T, limit int, completer bool) {
	store, err := lock.NewMemoryStore(lock.Config{MaxResultSize: limit})
	if err != nil {
		t.Fatal(err)
	}
	msg := func(body int) amqp.Publishing {
		return amqp.Publishing{MessageId: "m", DeliveryMode: amqp.Persistent, Body: bytes.Repeat([]byte("b"), body)}
	}
	var body int // the body that fills the outbox, to be found
	var refused error
	work := func(ctx context.Context) ([]byte, error) {
		if refused = Stage(ctx, "", "next", msg(body+1)); !errors.Is(refused, ErrOutboxFull) {
			return nil, fmt.Errorf("one byte more than fills the outbox: %v, want ErrOutboxFull", refused)
		}
		return nil, Stage(ctx, "", "next", msg(body))
	}
	var p processor
	if completer {
		c := &stagingCompleter{store: store, work: work}
		if p, err = newProcessor(store, Config{Queue: "q", Logger: discard()}, c); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	} else {
		p = newProcessorOn(t, store, Config{Logger: discard()}, func(ctx context.Context, _ *amqp.Delivery) ([]byte, error) { return work(ctx) })
	}
	base, _ := appendPublishing(nil, "", "next", msg(0))
	for body = max(p.outboxBytes-len(base)-8, 0); body < limit; body++ {
		enc, err := appendPublishing(nil, "", "next", msg(body))
		if err != nil {
			t.Fatal(err)
		}
		if entrySize(len(enc)) == p.outboxBytes {
			break
		}
	}
	if body == limit {
		t.Fatalf("no message fills an outbox of %d bytes exactly", p.outboxBytes)
	}
	b := &outboxBroker{}
	d, _ := delivery("a", "x")
	d.ReplyTo = "client"
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != Completed || ev.Outbox != (OutboxCounts{Staged: 1, Published: 1}) {
		t.Fatalf("an outbox filled to what Stage accepts (%d bytes, a store of %d), with a reply: %v %q %+v %v",
			p.outboxBytes, limit, ev.Outcome, ev.Reason, ev.Outbox, ev.Err)
	}
	if got := b.published(); len(got) != 1 || len(got[0].Body) != body {
		t.Fatalf("published %d messages, want the one staged", len(got))
	}
	if len(b.pubs) != 1 || b.pubs[0].key != "client" {
		t.Fatalf("publishes besides the staged one: %+v, want the reply", b.pubs)
	}
	res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a")})
	if err != nil || res.Status != lock.Completed {
		t.Fatalf("record: %v %v", res.Status, err)
	}
	if len(res.Value) > limit {
		t.Fatalf("stored %d bytes in a store of %d", len(res.Value), limit)
	}
}

// stagingCompleter stands for a transactional handler (pgstore's
// TxHandler): the work, which stages, then the completion with value(result)
// on the store, as one transaction would.
type stagingCompleter struct {
	store lock.Store
	work  func(ctx context.Context) ([]byte, error)
}

func (c *stagingCompleter) Handle(ctx context.Context, _ *amqp.Delivery) ([]byte, error) {
	return c.work(ctx)
}
func (c *stagingCompleter) CompleterStore() lock.Store { return c.store }
func (c *stagingCompleter) HandleComplete(ctx context.Context, _ *amqp.Delivery, l lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	result, err := c.work(ctx)
	if err != nil {
		return nil, err
	}
	v, err := value(result)
	if err != nil {
		return nil, err
	}
	if err := c.store.Complete(ctx, l, v); err != nil {
		return nil, err
	}
	return result, nil
}

// TestOutboxCompleter: a Completer's staged messages are in the value it
// completes the record with, in its transaction, and published after it
// committed; its failure publishes nothing.
func TestOutboxCompleter(t *testing.T) {
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	fail := false
	c := &stagingCompleter{store: store, work: func(ctx context.Context) ([]byte, error) {
		if err := Stage(ctx, "", "next", amqp.Publishing{Body: []byte("in tx")}); err != nil {
			return nil, err
		}
		if fail {
			return nil, errors.New("rolled back")
		}
		return []byte("ok"), nil
	}}
	cfg := Config{Queue: "q", Logger: discard(), Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(time.Second) }}
	p, err := newProcessor(store, cfg, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	b := &outboxBroker{}
	fail = true
	d, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Retried || len(b.published()) != 0 {
		t.Fatalf("failed: %v %q, %d published", ev.Outcome, ev.Reason, len(b.published()))
	}
	fail = false
	d2, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d2, nil); ev.Outcome != Completed || ev.Outbox != (OutboxCounts{Staged: 1, Published: 1}) {
		t.Fatalf("completed: %v %q %+v %v", ev.Outcome, ev.Reason, ev.Outbox, ev.Err)
	}
	if got := b.published(); len(got) != 1 || string(got[0].Body) != "in tx" {
		t.Fatalf("published: %v", got)
	}
	if states := storedStates(t, store, "a"); fmt.Sprint(states) != "[published]" {
		t.Fatalf("record: %v", states)
	}
}

// TestOutboxUnkeyed: without a key there is no record: staged messages
// are published after the handler, before the ack, and a publish that
// fails is the execution's failure, retried.
func TestOutboxUnkeyed(t *testing.T) {
	p, _ := newTestProcessor(t, Config{MissingKey: ProcessMissingKey}, stager(2, nil))
	b := &outboxBroker{}
	d, _ := delivery("", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Completed || ev.Outbox != (OutboxCounts{Staged: 2, Published: 2}) {
		t.Fatalf("%v %q %+v %v", ev.Outcome, ev.Reason, ev.Outbox, ev.Err)
	}
	if got := b.published(); len(got) != 2 || got[0].MessageId != "own" || !strings.HasPrefix(got[1].MessageId, "amqpidem-") {
		t.Fatalf("published: %v", got)
	}
	b.fail = fmt.Errorf("%w: 312 NO_ROUTE", ErrUnroutable)
	d2, _ := delivery("", "x")
	if ev := p.process(context.Background(), b, d2, nil); ev.Outcome != Retried || !errors.Is(ev.Err, ErrUnroutable) {
		t.Fatalf("publish refused: %v %q %v", ev.Outcome, ev.Reason, ev.Err)
	}
}

// TestStoredOutboxValues checks the stored value's forms: a value without
// an outbox reads as none, one with reads back in order, and a damaged
// one is an error for StoredOutbox and no result for a duplicate.
func TestStoredOutboxValues(t *testing.T) {
	enc, err := appendPublishing(nil, "ex", "rk", amqp.Publishing{MessageId: "m", Body: []byte("b")})
	if err != nil {
		t.Fatal(err)
	}
	for _, replyTo := range []string{"", "reply-q"} {
		v := encodeValue(replyTo, []byte("result"), [][]byte{enc, enc}, 0)
		msgs, err := StoredOutbox(v)
		if err != nil || len(msgs) != 2 || msgs[1].Exchange != "ex" || msgs[1].Msg.MessageId != "m" || msgs[0].State != OutboxPending {
			t.Fatalf("replyTo %q: %+v %v", replyTo, msgs, err)
		}
		if r, ok := decodeResult(v, replyTo); string(r) != "result" || ok != (replyTo != "") {
			t.Fatalf("replyTo %q: result %q %v", replyTo, r, ok)
		}
		header := 2
		if replyTo != "" {
			header = ResultOverhead
		}
		for cut := header + 1; cut < len(v)-len("result"); cut++ {
			if _, err := StoredOutbox(v[:cut]); err == nil {
				t.Fatalf("replyTo %q: a value cut at %d read without error", replyTo, cut)
			}
		}
	}
	if msgs, err := StoredOutbox(encodeValue("", []byte("r"), nil, 0)); err != nil || msgs != nil {
		t.Fatalf("no outbox: %v %v", msgs, err)
	}
	if msgs, err := StoredOutbox([]byte("not amqpidem's")); err != nil || msgs != nil {
		t.Fatalf("foreign value: %v %v", msgs, err)
	}
}

// TestOutboxClaim: while the execution that stored staged messages may
// still be publishing them (a lease TTL after its completion), a copy of
// its message waits as a busy duplicate instead of publishing them a
// second time; once the claim has passed, a copy publishes what is still
// pending (the holder died before it could).
func TestOutboxClaim(t *testing.T) {
	p, store := newTestProcessor(t, Config{}, stager(1, nil))
	// What a holder that died right after its completion leaves: the
	// record completed with its message pending and claimed.
	res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "a"), Fingerprint: fingerprint([]byte("x"))})
	if err != nil || res.Status != lock.Acquired {
		t.Fatal(res.Status, err)
	}
	enc, err := appendPublishing(nil, "", "next", amqp.Publishing{MessageId: "m"})
	if err != nil {
		t.Fatal(err)
	}
	claim := time.Now().Add(400 * time.Millisecond)
	if err := store.Complete(context.Background(), res.Lease, encodeValue("", nil, [][]byte{enc}, claim.UnixMilli())); err != nil {
		t.Fatal(err)
	}
	b := &outboxBroker{}
	d, _ := delivery("a", "x")
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != Busy || ev.Reason != "outbox being published" || ev.Delay < MinInProgressDelay || ev.Delay > 450*time.Millisecond || len(b.published()) != 0 {
		t.Fatalf("copy within the claim: %v %q %v, %d published", ev.Outcome, ev.Reason, ev.Delay, len(b.published()))
	}
	time.Sleep(time.Until(claim) + 10*time.Millisecond)
	d2, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d2, nil); ev.Outcome != Duplicate || ev.Outbox.Republished != 1 || len(b.published()) != 1 {
		t.Fatalf("copy after the claim: %v %q %+v, %d published", ev.Outcome, ev.Reason, ev.Outbox, len(b.published()))
	}
}

// gatedBroker holds every publish to "next" until release is closed, and
// says on started when the first one began.
type gatedBroker struct {
	outboxBroker
	started chan struct{}
	release chan struct{}
	once    sync.Once
}

func (b *gatedBroker) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if key == "next" {
		b.once.Do(func() { close(b.started) })
		<-b.release
	}
	return b.outboxBroker.publish(ctx, exchange, key, msg)
}

// storePending completes key's record with one message to "next" pending,
// claimed until claim: what an execution that died after its completion
// leaves.
func storePending(t *testing.T, store lock.Store, key string, claim time.Time) {
	t.Helper()
	res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", key), Fingerprint: fingerprint([]byte("x"))})
	if err != nil || res.Status != lock.Acquired {
		t.Fatal(res.Status, err)
	}
	enc, err := appendPublishing(nil, "", "next", amqp.Publishing{MessageId: "m"})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Complete(context.Background(), res.Lease, encodeValue("", nil, [][]byte{enc}, claim.UnixMilli())); err != nil {
		t.Fatal(err)
	}
}

// TestOutboxCopiesTakeTheClaim: of two copies that find a message pending
// once the storing execution's claim has passed, the first takes the
// claim before it publishes, and the second, arriving while it publishes,
// waits as busy: the message goes out once.
func TestOutboxCopiesTakeTheClaim(t *testing.T) {
	p, store := newTestProcessor(t, Config{}, stager(1, nil))
	storePending(t, store, "a", time.Now().Add(-time.Second))
	b := &gatedBroker{started: make(chan struct{}), release: make(chan struct{})}
	first := make(chan Event, 1)
	go func() {
		d, _ := delivery("a", "x")
		first <- p.process(context.Background(), b, d, nil)
	}()
	<-b.started
	second := make(chan Event, 1)
	go func() {
		d2, _ := delivery("a", "x")
		second <- p.process(context.Background(), b, d2, nil)
	}()
	var ev Event
	select {
	case ev = <-second:
	case <-time.After(2 * time.Second):
		close(b.release)
		t.Fatalf("the second copy is publishing beside the first (it waits for the broker too)")
	}
	close(b.release)
	if ev.Outcome != Busy || ev.Reason != "outbox being published" || ev.Delay != MinInProgressDelay {
		t.Fatalf("second copy: %v %q %v; want busy, to look again in %v", ev.Outcome, ev.Reason, ev.Delay, MinInProgressDelay)
	}
	if ev := <-first; ev.Outcome != Duplicate || ev.Outbox.Republished != 1 {
		t.Fatalf("first copy: %v %q %+v %v", ev.Outcome, ev.Reason, ev.Outbox, ev.Err)
	}
	if n := len(b.published()); n != 1 {
		t.Fatalf("published %d times, want once", n)
	}
	if states := storedStates(t, store, "a"); fmt.Sprint(states) != "[published]" {
		t.Fatalf("record: %v", states)
	}
}

// slowCompleteStore completes, then takes delay to answer: a process
// paused between its completion and its publishing.
type slowCompleteStore struct {
	*lock.MemoryStore
	delay time.Duration
}

func (s *slowCompleteStore) Complete(ctx context.Context, l lock.Lease, v []byte) error {
	err := s.MemoryStore.Complete(ctx, l, v)
	time.Sleep(s.delay)
	return err
}

// TestOutboxOwnClaimPassed: an execution whose claim passed before it
// could publish (paused after its completion) publishes nothing and goes
// back to the queue; its copy takes the claim and publishes, once.
func TestOutboxOwnClaimPassed(t *testing.T) {
	store := &slowCompleteStore{MemoryStore: mustMemory(t), delay: 60 * time.Millisecond}
	p := newProcessorOn(t, store, Config{LeaseTTL: 40 * time.Millisecond, SafetyMargin: 10 * time.Millisecond}, stager(1, nil))
	b := &outboxBroker{}
	d, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Abandoned || ev.Reason != "outbox claim passed" || len(b.published()) != 0 {
		t.Fatalf("paused execution: %v %q, %d published", ev.Outcome, ev.Reason, len(b.published()))
	}
	d2, _ := delivery("a", "x")
	if ev := p.process(context.Background(), b, d2, nil); ev.Outcome != Duplicate || ev.Outbox.Republished != 1 || len(b.published()) != 1 {
		t.Fatalf("its copy: %v %q %+v, %d published", ev.Outcome, ev.Reason, ev.Outbox, len(b.published()))
	}
}
