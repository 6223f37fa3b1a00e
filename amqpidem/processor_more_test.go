package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

// takeOver makes the handler's lease lost: it is released and acquired by
// someone else, as a consumer taking over an expired lease would.
func takeOver(t *testing.T, s lock.Store, l lock.Lease) lock.Lease {
	t.Helper()
	if err := s.Release(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	res, err := s.Acquire(context.Background(), lock.Request{Key: l.Key, TTL: time.Minute})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("take over: %v %v", res.Status, err)
	}
	return res.Lease
}

func TestProcessLeaseLost(t *testing.T) {
	for _, handlerReturns := range []string{"ctx error", "success anyway"} {
		t.Run(handlerReturns, func(t *testing.T) {
			var store lock.Store
			var other lock.Lease
			h := func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
				l, _ := heartbeat.LeaseFromContext(ctx)
				other = takeOver(t, store, l)
				select {
				case <-ctx.Done():
				case <-time.After(5 * time.Second):
					return nil, errors.New("context not cancelled after the lease was lost")
				}
				if !errors.Is(context.Cause(ctx), lock.ErrLeaseLost) {
					return nil, fmt.Errorf("cause: %v", context.Cause(ctx))
				}
				if handlerReturns == "ctx error" {
					return nil, ctx.Err()
				}
				return []byte("stale result"), nil
			}
			p, s := newTestProcessor(t, Config{LeaseTTL: 150 * time.Millisecond}, h)
			store = s
			b := &fakeBroker{}
			d, ack := delivery("k", "body")
			ev := p.process(context.Background(), b, d, nil)
			if ev.Outcome != Abandoned || ev.Reason != "lease lost" || ack.acks != 1 || len(b.pubs) != 1 || b.pubs[0].key != "requeue" {
				t.Fatalf("got %v %q acks %d pubs %+v err %v; want abandoned, requeued, acked", ev.Outcome, ev.Reason, ack.acks, b.pubs, ev.Err)
			}
			// The record is the other owner's, untouched.
			if err := s.Complete(context.Background(), other, []byte("theirs")); err != nil {
				t.Fatalf("the new owner cannot complete: %v", err)
			}
			res, _ := s.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "k")})
			if string(res.Value) != "theirs" {
				t.Fatalf("stored result: %q", res.Value)
			}
		})
	}
}

// A handler stopped by shutdown gives its message back as a copy straight
// to the queue and an ack (a nack would count against a quorum queue's
// delivery limit); only if the copy fails is it nacked with requeue.
func TestProcessShutdownGivesBack(t *testing.T) {
	for _, copyFails := range []bool{false, true} {
		t.Run(fmt.Sprint("copy fails=", copyFails), func(t *testing.T) {
			started := make(chan struct{})
			h := func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
				close(started)
				<-ctx.Done()
				return nil, ctx.Err()
			}
			p, s := newTestProcessor(t, Config{}, h)
			ctx, cancel := context.WithCancel(context.Background())
			go func() { <-started; cancel() }()
			b := &fakeBroker{}
			if copyFails {
				b.fail = map[string]error{"requeue": errors.New("channel closed")}
			}
			d, ack := delivery("k", "body")
			ev := p.process(ctx, b, d, nil)
			if ev.Outcome != Abandoned || !strings.HasPrefix(ev.Reason, "shutdown") {
				t.Fatalf("got %v %q", ev.Outcome, ev.Reason)
			}
			if copyFails {
				if ack.nacks != 1 || !ack.requeu || ack.acks != 0 {
					t.Fatalf("copy failed: acks %d nacks %d requeue %v, want a nack with requeue", ack.acks, ack.nacks, ack.requeu)
				}
			} else if ack.acks != 1 || ack.nacks != 0 || len(b.pubs) != 1 || b.pubs[0].delay != 0 {
				t.Fatalf("acks %d nacks %d pubs %+v, want a copy with no delay and an ack", ack.acks, ack.nacks, b.pubs)
			}
			// The lease was released: the redelivery runs at once, as attempt 2.
			res, err := s.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "k")})
			if err != nil || res.Status != lock.Acquired || res.Lease.Attempt != 2 {
				t.Fatalf("after shutdown: %v attempt %d %v", res.Status, res.Lease.Attempt, err)
			}
		})
	}
}

// downStore fails every call, like a Redis that cannot be reached.
type downStore struct{ lock.Store }

var errDown = fmt.Errorf("%w: dial tcp 127.0.0.1:6379: connection refused", lock.ErrUnavailable)

func (downStore) Acquire(context.Context, lock.Request) (lock.Result, error) {
	return lock.Result{}, errDown
}

func TestProcessStoreUnavailable(t *testing.T) {
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprint("FailOpen=", failOpen), func(t *testing.T) {
			runs := 0
			mem, _ := lock.NewMemoryStore(lock.Config{})
			p := newProcessorOn(t, downStore{mem}, Config{FailOpen: failOpen},
				func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return nil, nil })
			b := &fakeBroker{}
			d, ack := delivery("k", "x")
			ev := p.process(context.Background(), b, d, nil)
			if failOpen {
				if ev.Outcome != Completed || runs != 1 || ack.acks != 1 {
					t.Fatalf("fail open: %v runs %d acks %d", ev.Outcome, runs, ack.acks)
				}
				return
			}
			if ev.Outcome != Abandoned || runs != 0 || ack.acks != 1 || len(b.pubs) != 1 || b.pubs[0].delay != DefaultUnavailableDelay {
				t.Fatalf("fail closed: %v runs %d acks %d pubs %+v", ev.Outcome, runs, ack.acks, b.pubs)
			}
			if !errors.Is(ev.Err, errDown) {
				t.Fatalf("event error: %v", ev.Err)
			}
		})
	}
}

func TestProcessUnroutableDeadLetterIsKept(t *testing.T) {
	p, _ := newTestProcessor(t, Config{FailedDuplicate: AckFailedDuplicate, DeadLetterExchange: "missing"},
		fails(Permanent(errors.New("card declined"))))
	b := &fakeBroker{fail: map[string]error{"q.dlq": ErrUnroutable}}
	d, ack := delivery("k", "x")
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != Abandoned || ack.acks != 1 || len(b.pubs) != 1 || b.pubs[0].key != "requeue" {
		t.Fatalf("unroutable dead letter: %v acks %d pubs %+v", ev.Outcome, ack.acks, b.pubs)
	}
	copyMsg := b.pubs[0].msg
	if copyMsg.Headers[HeaderDeadLetterPending] == nil {
		t.Fatalf("requeued copy lacks %s: %v", HeaderDeadLetterPending, copyMsg.Headers)
	}

	// The copy comes back: even with AckFailedDuplicate it is dead-lettered,
	// not dropped, once the target works.
	b.fail = nil
	b.pubs = nil
	d2, ack2 := delivery("k", "x")
	d2.Headers = copyMsg.Headers
	ev = p.process(context.Background(), b, d2, nil)
	if ev.Outcome != DeadLettered || ack2.acks != 1 || len(b.pubs) != 1 || b.pubs[0].exchange != "missing" {
		t.Fatalf("pending dead letter: %v acks %d pubs %+v", ev.Outcome, ack2.acks, b.pubs)
	}
	if b.pubs[0].msg.Headers[HeaderDeadLetterPending] != nil {
		t.Fatal("the dead letter still carries the pending mark")
	}
}

func TestProcessReplies(t *testing.T) {
	p, _ := newTestProcessor(t, Config{}, ok("42"))
	b := &fakeBroker{}
	for i, want := range []Outcome{Completed, Duplicate} {
		d, _ := delivery("k", "x")
		d.ReplyTo, d.CorrelationId = "replies", fmt.Sprint("corr-", i)
		if ev := p.process(context.Background(), b, d, nil); ev.Outcome != want {
			t.Fatalf("delivery %d: %v", i, ev.Outcome)
		}
		last := b.pubs[len(b.pubs)-1]
		if last.key != "replies" || string(last.msg.Body) != "42" || last.msg.CorrelationId != d.CorrelationId {
			t.Fatalf("delivery %d reply: %+v", i, last)
		}
	}
}

// A dead letter or a reply goes on a channel of its own (publishAlone),
// never on one shared with other publishes in flight: if the broker closed a
// shared channel over another message after taking this one, unconfirmed, it
// would be sent again, and nothing downstream drops the second dead letter or
// reply by its MessageId. (Issue 40's shared channels did exactly that once:
// scenario 08 counted one op's dead letter twice in the DLQ.)
func TestProcessOwnMessagesGoAlone(t *testing.T) {
	p, _ := newTestProcessor(t, Config{DeadLetterExchange: "dlx"}, fails(Permanent(errors.New("card declined"))))
	b := &fakeBroker{}
	d, _ := delivery("k", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != DeadLettered || len(b.pubs) != 1 {
		t.Fatalf("dead letter: %v pubs %+v", ev.Outcome, b.pubs)
	}
	if !b.pubs[0].alone {
		t.Fatalf("dead letter sent on a shared channel: %+v", b.pubs[0])
	}

	p, _ = newTestProcessor(t, Config{}, ok("42"))
	b = &fakeBroker{}
	d, _ = delivery("k", "x")
	d.ReplyTo = "replies"
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Completed || len(b.pubs) != 1 {
		t.Fatalf("reply: %v pubs %+v", ev.Outcome, b.pubs)
	}
	if !b.pubs[0].alone {
		t.Fatalf("reply sent on a shared channel: %+v", b.pubs[0])
	}
}

func TestProcessPublishFailureNeverLoses(t *testing.T) {
	p, _ := newTestProcessor(t, Config{}, fails(errors.New("transient")))
	b := &fakeBroker{fail: map[string]error{"requeue": errors.New("channel closed")}}
	d, ack := delivery("k", "x")
	ev := p.process(context.Background(), b, d, nil)
	if ack.acks != 0 || ack.nacks != 1 || !ack.requeu || ev.Outcome != Abandoned {
		t.Fatalf("failed requeue: %v acks %d nacks %d requeue %v", ev.Outcome, ack.acks, ack.nacks, ack.requeu)
	}
}

func TestProcessRetriesCountAttempts(t *testing.T) {
	p, s := newTestProcessor(t, Config{MaxAttempts: 3}, fails(errors.New("transient")))
	b := &fakeBroker{}
	want := []Outcome{Retried, Retried, DeadLettered}
	for i, w := range want {
		d, _ := delivery("k", "x")
		ev := p.process(context.Background(), b, d, nil)
		if ev.Outcome != w || ev.Attempt != i+1 {
			t.Fatalf("delivery %d: %v attempt %d, want %v attempt %d", i, ev.Outcome, ev.Attempt, w, i+1)
		}
	}
	res, _ := s.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "k")})
	if res.Status != lock.Failed || res.Attempts != 3 {
		t.Fatalf("record: %v attempts %d", res.Status, res.Attempts)
	}
	// Delays grow with the default backoff: 1 s then 2 s (10% jitter).
	if d0, d1 := b.pubs[0].delay, b.pubs[1].delay; d0 < 900*time.Millisecond || d0 > 1100*time.Millisecond || d1 < 1800*time.Millisecond || d1 > 2200*time.Millisecond {
		t.Fatalf("retry delays: %v, %v", d0, d1)
	}
}

func TestDelayTier(t *testing.T) {
	tests := []struct{ in, want time.Duration }{
		{0, 10 * time.Millisecond},
		{3 * time.Millisecond, 10 * time.Millisecond},
		{10 * time.Millisecond, 10 * time.Millisecond},
		{1234 * time.Millisecond, 1200 * time.Millisecond},
		{1250 * time.Millisecond, 1300 * time.Millisecond},
		{5 * time.Second, 5 * time.Second},
		{56789 * time.Millisecond, 57 * time.Second},
		{5 * time.Minute, 5 * time.Minute},
	}
	for _, tc := range tests {
		if got := delayTier(tc.in); got != tc.want {
			t.Errorf("delayTier(%v): got %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestKeyFuncs(t *testing.T) {
	tests := []struct {
		name    string
		fn      KeyFunc
		d       amqp.Delivery
		want    string
		wantErr bool
	}{
		{"message id", MessageID, amqp.Delivery{MessageId: "m1"}, "m1", false},
		{"no message id", MessageID, amqp.Delivery{}, "", true},
		{"header string", Header("k"), amqp.Delivery{Headers: amqp.Table{"k": "v"}}, "v", false},
		{"header bytes", Header("k"), amqp.Delivery{Headers: amqp.Table{"k": []byte("v")}}, "v", false},
		{"header int", Header("k"), amqp.Delivery{Headers: amqp.Table{"k": int32(7)}}, "", true},
		{"header missing", Header("k"), amqp.Delivery{}, "", true},
		{"header empty", Header("k"), amqp.Delivery{Headers: amqp.Table{"k": ""}}, "", true},
		{"body hash", BodyHash, amqp.Delivery{Body: []byte("abc")}, "sha256:" + fingerprint([]byte("abc")), false},
		{"body hash of nothing", BodyHash, amqp.Delivery{}, "", true},
	}
	for _, tc := range tests {
		got, err := tc.fn(&tc.d)
		if got != tc.want || (err != nil) != tc.wantErr {
			t.Errorf("%s: got %q, %v", tc.name, got, err)
		}
		if err != nil && !errors.Is(err, ErrNoKey) {
			t.Errorf("%s: error %v does not wrap ErrNoKey", tc.name, err)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		cfg   Config
		field string
	}{
		{Config{}, "Queue"},
		{Config{Queue: "q", LeaseTTL: -1}, "LeaseTTL"},
		{Config{Queue: "q", LeaseTTL: time.Millisecond}, "LeaseTTL"},
		{Config{Queue: "q", Retention: -1}, "Retention"},
		{Config{Queue: "q", Retention: 500 * time.Microsecond}, "Retention"},
		{Config{Queue: "q", Endpoint: "a\x00b"}, "Endpoint"},
		{Config{Queue: "q\x00"}, "Queue"},
		{Config{Queue: "q", QueueType: "stream"}, "QueueType"},
		{Config{Queue: "q", MaxAttempts: -1}, "MaxAttempts"},
		{Config{Queue: "q", InProgressDelay: -1}, "InProgressDelay"},
		{Config{Queue: "q", UnavailableDelay: -1}, "UnavailableDelay"},
		{Config{Queue: "q", MissingKey: 9}, "MissingKey"},
		{Config{Queue: "q", FailedDuplicate: 9}, "FailedDuplicate"},
		{Config{Queue: "q", MaxResultSize: -1}, "MaxResultSize"},
	}
	for _, tc := range tests {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), "Config."+tc.field) {
			t.Errorf("%+v: got %v, want an error naming Config.%s", tc.cfg, err, tc.field)
		}
	}
	if err := (Config{Queue: "q"}).Validate(); err != nil {
		t.Fatalf("minimal config: %v", err)
	}
}

// A reply queue that is gone (the client gave up) does not keep the message
// cycling: the result is stored, the reply dropped and noted.
func TestProcessUnroutableReplyIsDropped(t *testing.T) {
	p, _ := newTestProcessor(t, Config{}, ok("42"))
	b := &fakeBroker{fail: map[string]error{"gone": ErrUnroutable}}
	for i, want := range []Outcome{Completed, Duplicate} {
		d, ack := delivery("k", "x")
		d.ReplyTo = "gone"
		ev := p.process(context.Background(), b, d, nil)
		if ev.Outcome != want || ack.acks != 1 || !errors.Is(ev.Err, ErrUnroutable) {
			t.Fatalf("delivery %d: %v acks %d err %v", i, ev.Outcome, ack.acks, ev.Err)
		}
	}
	// A reply that may go through later is retried instead.
	b.fail["gone"] = errors.New("connection reset")
	d, _ := delivery("k", "x")
	d.ReplyTo = "gone"
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Abandoned || ev.Reason != "reply not sent" {
		t.Fatalf("transient reply failure: %v %q", ev.Outcome, ev.Reason)
	}
}
