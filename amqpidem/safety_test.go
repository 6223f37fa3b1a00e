package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// cycle processes d, and while the outcome is while, the copy it
// published, at most n times; it returns the outcomes and reasons.
func cycle(p processor, b *fakeBroker, d *amqp.Delivery, while Outcome, n int) string {
	var got []string
	for range n {
		ev := p.process(context.Background(), b, d, nil)
		got = append(got, ev.Outcome.String()+"/"+ev.Reason)
		if ev.Outcome != while {
			break
		}
		d, _ = redeliver(b.pubs[len(b.pubs)-1])
	}
	return strings.Join(got, " ")
}

// redeliver turns a published copy into the delivery that comes back.
func redeliver(pub published) (*amqp.Delivery, *fakeAck) {
	d, ack := delivery(pub.msg.MessageId, string(pub.msg.Body))
	d.Headers = pub.msg.Headers
	d.ReplyTo = pub.msg.ReplyTo
	return d, ack
}

// A stored reply goes back only to the ReplyTo it was made for: another
// publisher reusing the message id cannot have it sent where it chooses.
func TestProcessStoredReplyOnlyToItsReplyTo(t *testing.T) {
	p, _ := newTestProcessor(t, Config{SkipFingerprint: true}, ok("secret"))
	b := &fakeBroker{}
	d, _ := delivery("k", "x")
	d.ReplyTo = "alice"
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Completed || len(b.pubs) != 1 {
		t.Fatalf("first delivery: %v, pubs %+v", ev.Outcome, b.pubs)
	}

	d, ack := delivery("k", "x")
	d.ReplyTo = "mallory"
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != Duplicate || ack.acks != 1 {
		t.Fatalf("foreign duplicate: %v acks %d", ev.Outcome, ack.acks)
	}
	for _, pub := range b.pubs {
		if pub.key == "mallory" {
			t.Fatalf("the stored reply was sent to another reply-to: %+v", pub)
		}
	}

	d, _ = delivery("k", "x")
	d.ReplyTo = "alice"
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Duplicate {
		t.Fatalf("own duplicate: %v", ev.Outcome)
	}
	if last := b.pubs[len(b.pubs)-1]; last.key != "alice" || string(last.msg.Body) != "secret" {
		t.Fatalf("the stored reply did not go back to its own reply-to: %+v", b.pubs)
	}
}

// uncertainFail stores the failure, then loses the reply, as a Redis stall
// longer than the settle timeout does.
type uncertainFail struct{ lock.Store }

func (s uncertainFail) Fail(ctx context.Context, l lock.Lease, reason string) error {
	if err := s.Store.Fail(ctx, l, reason); err != nil {
		return err
	}
	return fmt.Errorf("%w: i/o timeout", lock.ErrUnavailable)
}

// A failure whose Fail landed with its reply lost goes back marked
// pending: when it comes back (not redelivered, AckFailedDuplicate) it is
// dead-lettered, not dropped.
func TestProcessUncertainFailKeepsDeadLetterDue(t *testing.T) {
	mem, _ := lock.NewMemoryStore(lock.Config{})
	p := newProcessorOn(t, uncertainFail{mem}, Config{FailedDuplicate: AckFailedDuplicate},
		fails(Permanent(errors.New("card declined"))))
	b := &fakeBroker{}
	d, _ := delivery("k", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != Abandoned || len(b.pubs) != 1 {
		t.Fatalf("uncertain fail: %v %q, pubs %+v", ev.Outcome, ev.Reason, b.pubs)
	}
	back, ack := redeliver(b.pubs[0])
	b.pubs = nil
	ev := p.process(context.Background(), b, back, nil)
	if ev.Outcome != DeadLettered || ack.acks != 1 || len(b.pubs) != 1 || b.pubs[0].key != "q.dlq" {
		t.Fatalf("the copy came back: %v %q, pubs %+v; want dead-lettered", ev.Outcome, ev.Reason, b.pubs)
	}
	if ev.Reason != "permanent failure" {
		t.Errorf("reason %q, want the stored one, permanent failure", ev.Reason)
	}
}

// A record lost between retries (Retention shorter than the retry delay)
// restarts the store's attempt count; the message's own count still ends
// the retries at MaxAttempts.
func TestProcessAttemptsSurviveLostRecord(t *testing.T) {
	runs := 0
	p, _ := newTestProcessor(t, Config{MaxAttempts: 3, Retention: time.Millisecond,
		Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(time.Second) }},
		func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return nil, errors.New("transient") })
	b := &fakeBroker{}
	d, _ := delivery("k", "x")
	var ev Event
	for i := 0; i < 6; i++ {
		ev = p.process(context.Background(), b, d, nil)
		if ev.Outcome != Retried {
			break
		}
		time.Sleep(10 * time.Millisecond) // the record expires
		d, _ = redeliver(b.pubs[len(b.pubs)-1])
	}
	if ev.Outcome != DeadLettered || ev.Reason != "attempts exhausted" || runs != 3 {
		t.Fatalf("after a lost record: %v %q after %d runs, attempt %d; want dead-lettered after 3", ev.Outcome, ev.Reason, runs, ev.Attempt)
	}
}

// limitedStore hides its MaxResultSize, as a wrapping Store does.
type limitedStore struct{ lock.Store }

// A result the store refuses as too large is a terminal failure: the
// handler, which did its work, does not run again.
func TestProcessResultTooLargeForStoreIsTerminal(t *testing.T) {
	mem, _ := lock.NewMemoryStore(lock.Config{MaxResultSize: 100})
	if _, err := newProcessor(mem, Config{Queue: "q", MaxResultSize: 500}, ok("r")); err == nil || !strings.Contains(err.Error(), "MaxResultSize") {
		t.Fatalf("MaxResultSize above the store's limit: got %v, want an error", err)
	}

	runs := 0
	p := newProcessorOn(t, limitedStore{mem}, Config{},
		func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return make([]byte, 200), nil })
	b := &fakeBroker{}
	d, ack := delivery("k", "x")
	ev := p.process(context.Background(), b, d, nil)
	if ev.Outcome != DeadLettered || ev.Reason != "result too large" || runs != 1 || ack.acks != 1 {
		t.Fatalf("too large for the store: %v %q runs %d acks %d", ev.Outcome, ev.Reason, runs, ack.acks)
	}
	res, _ := mem.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "k")})
	if res.Status != lock.Failed {
		t.Fatalf("record: %v, want failed", res.Status)
	}
}

// badRecordStore answers every Acquire with a fault of the key's record.
type badRecordStore struct{ lock.Store }

func (badRecordStore) Acquire(context.Context, lock.Request) (lock.Result, error) {
	return lock.Result{}, fmt.Errorf("%w: WRONGTYPE Operation against a key holding the wrong kind of value", lock.ErrBadRecord)
}

// FailOpen runs unkeyed only when the store cannot be reached; a fault of
// one key's record is requeued a bounded number of times, then
// dead-lettered, and never run.
func TestProcessRecordFaultNeverFailsOpen(t *testing.T) {
	runs := 0
	mem, _ := lock.NewMemoryStore(lock.Config{})
	p := newProcessorOn(t, badRecordStore{mem}, Config{FailOpen: true, MaxAttempts: 3},
		func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return nil, nil })
	d, _ := delivery("k", "x")
	want := "abandoned/record unusable abandoned/record unusable dead_lettered/record unusable"
	if got := cycle(p, &fakeBroker{}, d, Abandoned, 5); got != want || runs != 0 {
		t.Fatalf("outcomes %q, runs %d; want %q, 0 runs", got, runs, want)
	}
}

// Headers a publisher can forge may bring a dead letter closer, never
// allow more executions, and never choose the reason.
func TestProcessForgedHeaders(t *testing.T) {
	errBoom := errors.New("boom")
	for _, tc := range []struct {
		name    string
		attempt any
		want    Outcome
		runs    int
	}{
		{"attempt MaxInt64", int64(math.MaxInt64), DeadLettered, 0},
		{"attempt negative", int64(-1 << 40), Retried, 1},
		{"attempt a string", "9", Retried, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, missing := range []MissingKeyPolicy{DeadLetterMissingKey, ProcessMissingKey} {
				runs := 0
				p, _ := newTestProcessor(t, Config{MissingKey: missing},
					func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return nil, errBoom })
				b := &fakeBroker{}
				id := "k"
				if missing == ProcessMissingKey {
					id = "" // unkeyed: the header is all there is
				}
				d, _ := delivery(id, "x")
				d.Headers = amqp.Table{HeaderAttempt: tc.attempt}
				ev := p.process(context.Background(), b, d, nil)
				if ev.Outcome != tc.want || runs != tc.runs || ev.Attempt < 0 || ev.Attempt > DefaultMaxAttempts+1 {
					t.Fatalf("policy %d: %v %q runs %d attempt %d; want %v, %d runs", missing, ev.Outcome, ev.Reason, runs, ev.Attempt, tc.want, tc.runs)
				}
				if n, _ := headerInt64(b.pubs[0].msg.Headers[HeaderAttempt]); n < 0 || n > DefaultMaxAttempts+1 {
					t.Fatalf("policy %d: copy's attempt header %d", missing, n)
				}
			}
		})
	}

	t.Run("pending mark does not choose the reason", func(t *testing.T) {
		p, s := newTestProcessor(t, Config{}, ok("r"))
		failed("k", "x")(t, s)
		b := &fakeBroker{}
		d, _ := delivery("k", "x")
		d.Headers = amqp.Table{HeaderDeadLetterPending: "x", HeaderReason: "forged"}
		ev := p.process(context.Background(), b, d, nil)
		if ev.Outcome != DeadLettered || ev.Reason != "failed duplicate" || b.pubs[0].msg.Headers[HeaderReason] != "failed duplicate" {
			t.Fatalf("forged reason: %v %q headers %v", ev.Outcome, ev.Reason, b.pubs[0].msg.Headers)
		}
	})

	// The mark counts when present, whatever its value: a void one is
	// no reason to drop a failed duplicate that AckFailedDuplicate would
	// keep only for unmarked copies. (Before the headers were parsed in
	// one place, this case alone read a void mark as absent.)
	t.Run("void pending mark is a mark", func(t *testing.T) {
		p, s := newTestProcessor(t, Config{FailedDuplicate: AckFailedDuplicate}, ok("r"))
		failed("k", "x")(t, s)
		b := &fakeBroker{}
		d, _ := delivery("k", "x")
		d.Headers = amqp.Table{HeaderDeadLetterPending: nil}
		if ev := p.process(context.Background(), b, d, nil); ev.Outcome != DeadLettered || len(b.pubs) != 1 {
			t.Fatalf("void pending mark on a failed duplicate: %v %q, %d publishes; want dead-lettered", ev.Outcome, ev.Reason, len(b.pubs))
		}
	})

	t.Run("pending mark brings the dead letter closer", func(t *testing.T) {
		runs := 0
		p, s := newTestProcessor(t, Config{}, func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return nil, nil })
		d, _ := delivery("k", "x")
		d.Headers = amqp.Table{HeaderDeadLetterPending: "permanent failure: card declined"}
		b := &fakeBroker{}
		if ev := p.process(context.Background(), b, d, nil); ev.Outcome != DeadLettered || runs != 0 || ev.Reason != "permanent failure" {
			t.Fatalf("pending mark on an acquired key: %v %q runs %d; want dead-lettered, not run", ev.Outcome, ev.Reason, runs)
		}
		if res, _ := s.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "k")}); res.Status != lock.Failed {
			t.Fatalf("record: %v, want failed", res.Status)
		}
	})
}

// A copy that cannot be published does not spin: the message waits for
// its delay and goes straight back to the queue, and it is nacked only
// when that fails too, after the wait.
func TestProcessRequeueFailureDoesNotSpin(t *testing.T) {
	const delay = 200 * time.Millisecond
	cfg := Config{Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(delay) }}
	errDeclare := errors.New(`declare queue "q.delay.200": PRECONDITION_FAILED`)

	t.Run("delay queue refused", func(t *testing.T) {
		p, _ := newTestProcessor(t, cfg, fails(errors.New("transient")))
		b := &delayRefusingBroker{err: errDeclare}
		d, ack := delivery("k", "x")
		start := time.Now()
		ev := p.process(context.Background(), b, d, nil)
		if ack.nacks != 0 || ack.acks != 1 || ev.Outcome != Retried || len(b.pubs) != 1 || b.pubs[0].delay != 0 {
			t.Fatalf("%v %q acks %d nacks %d pubs %+v; want a copy straight to the queue, acked", ev.Outcome, ev.Reason, ack.acks, ack.nacks, b.pubs)
		}
		if waited := time.Since(start); waited < delay {
			t.Fatalf("sent back after %v, before its delay %v", waited, delay)
		}
	})

	t.Run("nothing publishes", func(t *testing.T) {
		p, _ := newTestProcessor(t, cfg, fails(errors.New("transient")))
		b := &fakeBroker{fail: map[string]error{"requeue": errors.New("channel closed")}}
		d, ack := delivery("k", "x")
		start := time.Now()
		p.process(context.Background(), b, d, nil)
		if ack.nacks != 1 || !ack.requeu {
			t.Fatalf("acks %d nacks %d, want one nack with requeue", ack.acks, ack.nacks)
		}
		if waited := time.Since(start); waited < delay {
			t.Fatalf("nacked after %v, before its delay %v: a hot loop", waited, delay)
		}
	})
}

// delayRefusingBroker fails every delayed requeue, as when a delay queue
// exists with other arguments, and takes copies straight to the queue.
type delayRefusingBroker struct {
	fakeBroker
	err error
}

func (b *delayRefusingBroker) requeue(ctx context.Context, queue string, msg amqp.Publishing, delay time.Duration) error {
	if delay > 0 {
		return b.err
	}
	return b.fakeBroker.requeue(ctx, queue, msg, delay)
}

// Panics in user code around the handler are contained, and a handler
// cannot settle its delivery behind the layer's back.
func TestProcessContainsUserCode(t *testing.T) {
	t.Run("key function panics", func(t *testing.T) {
		for _, missing := range []MissingKeyPolicy{DeadLetterMissingKey, ProcessMissingKey} {
			runs := 0
			p, _ := newTestProcessor(t, Config{MissingKey: missing,
				Key: func(*amqp.Delivery) (string, error) { panic("nil header") }},
				func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return nil, nil })
			b := &fakeBroker{}
			d, ack := delivery("k", "x")
			ev := p.process(context.Background(), b, d, nil)
			if ev.Outcome != DeadLettered || ev.Reason != "invalid key" || runs != 0 || ack.acks != 1 || !errors.Is(ev.Err, ErrInvalidKey) {
				t.Fatalf("policy %d: %v %q runs %d acks %d err %v", missing, ev.Outcome, ev.Reason, runs, ack.acks, ev.Err)
			}
		}
	})

	t.Run("observer panics", func(t *testing.T) {
		p, _ := newTestProcessor(t, Config{Observer: ObserverFunc(func(context.Context, Event) { panic("metrics") })}, ok("r"))
		d, ack := delivery("k", "x")
		if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed || ack.acks != 1 {
			t.Fatalf("%v acks %d", ev.Outcome, ack.acks)
		}
	})

	t.Run("handler acks its delivery", func(t *testing.T) {
		var ackErr error
		p, _ := newTestProcessor(t, Config{}, func(_ context.Context, d *amqp.Delivery) ([]byte, error) {
			ackErr = d.Ack(false)
			return nil, nil
		})
		d, ack := delivery("k", "x")
		if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
			t.Fatalf("%v", ev.Outcome)
		}
		if ack.acks != 1 || !errors.Is(ackErr, ErrHandlerAck) {
			t.Fatalf("acks on the channel: %d (want 1, the layer's); the handler's Ack returned %v", ack.acks, ackErr)
		}
	})
}

// flakyFail fails the first n Fail calls as a stalled Redis does, without
// storing anything.
type flakyFail struct {
	lock.Store
	n int
}

func (s *flakyFail) Fail(ctx context.Context, l lock.Lease, reason string) error {
	if s.n > 0 {
		s.n--
		return fmt.Errorf("%w: i/o timeout", lock.ErrUnavailable)
	}
	return s.Store.Fail(ctx, l, reason)
}

// Fail is tried again like Complete: a short stall does not send a
// permanent failure round the queue (or run it again).
func TestProcessFailIsRetried(t *testing.T) {
	mem, _ := lock.NewMemoryStore(lock.Config{})
	p := newProcessorOn(t, &flakyFail{Store: mem, n: 2}, Config{}, fails(Permanent(errors.New("card declined"))))
	b := &fakeBroker{}
	d, _ := delivery("k", "x")
	if ev := p.process(context.Background(), b, d, nil); ev.Outcome != DeadLettered || len(b.pubs) != 1 || b.pubs[0].key != "q.dlq" {
		t.Fatalf("%v %q pubs %+v; want dead-lettered after Fail went through", ev.Outcome, ev.Reason, b.pubs)
	}
}

// A message whose recorded expiry has passed is dead-lettered, not run and
// not dropped; one still in time runs.
func TestProcessExpiredIsDeadLettered(t *testing.T) {
	runs := 0
	p, _ := newTestProcessor(t, Config{}, func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return nil, nil })
	for _, tc := range []struct {
		at   time.Time
		want Outcome
	}{{time.Now().Add(-time.Second), DeadLettered}, {time.Now().Add(time.Minute), Completed}} {
		runs = 0
		b := &fakeBroker{}
		d, ack := delivery(fmt.Sprint("k", tc.want), "x")
		d.Headers = amqp.Table{HeaderExpiresAt: tc.at.UnixMilli()}
		ev := p.process(context.Background(), b, d, nil)
		if ev.Outcome != tc.want || ack.acks != 1 || (tc.want == DeadLettered) != (runs == 0) {
			t.Fatalf("expires at %v: %v %q runs %d acks %d; want %v", tc.at, ev.Outcome, ev.Reason, runs, ack.acks, tc.want)
		}
		if tc.want == DeadLettered && (ev.Reason != "expired" || b.pubs[0].msg.Expiration != "") {
			t.Fatalf("dead letter: reason %q Expiration %q", ev.Reason, b.pubs[0].msg.Expiration)
		}
	}

	// An expired duplicate of completed work is still a duplicate.
	d, ack := delivery(fmt.Sprint("k", Completed), "x") // completed above
	d.Headers = amqp.Table{HeaderExpiresAt: time.Now().Add(-time.Second).UnixMilli()}
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Duplicate || ack.acks != 1 || runs != 1 {
		t.Fatalf("expired duplicate of completed work: %v %q acks %d runs %d; want a duplicate", ev.Outcome, ev.Reason, ack.acks, runs)
	}
}

// A dead letter moved back to its queue (after its record expired, or was
// forgotten) runs again with a fresh count, and its retries count.
func TestProcessReplayedDeadLetterRuns(t *testing.T) {
	runs := 0
	p, _ := newTestProcessor(t, Config{MaxAttempts: 2}, func(context.Context, *amqp.Delivery) ([]byte, error) {
		runs++
		return nil, errors.New("still failing")
	})
	b := &fakeBroker{}
	d, _ := delivery("k", "x")
	d.Headers = amqp.Table{HeaderAttempt: int64(2), HeaderError: "gateway timeout", HeaderReason: "attempts exhausted", HeaderConsumer: "c1"}
	if got, want := cycle(p, b, d, Retried, 3), "retried/handler error dead_lettered/attempts exhausted"; got != want || runs != 2 {
		t.Fatalf("replayed dead letter: %q after %d runs; want %q after 2", got, runs, want)
	}
}

// A reply that can never be sent does not cycle the message until its
// record expires (and the work runs again): after MaxAttempts tries it is
// given up and the message acked.
func TestProcessReplyGivenUp(t *testing.T) {
	runs := 0
	p, _ := newTestProcessor(t, Config{MaxAttempts: 3}, func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return []byte("r"), nil })
	d, _ := delivery("k", "x")
	d.ReplyTo = "full"
	want := "abandoned/reply not sent abandoned/reply not sent duplicate/reply given up"
	if got := cycle(p, &fakeBroker{fail: map[string]error{"full": ErrNotConfirmed}}, d, Abandoned, 6); got != want || runs != 1 {
		t.Fatalf("outcomes %q, runs %d; want %q, 1 run", got, runs, want)
	}
}

// noChannels is a ChannelOpener that opens nothing.
type noChannels struct{}

func (noChannels) Channel() (*amqp.Channel, error) { return nil, errors.New("no channels here") }

// Handle after Shutdown does not nack at once, which a loop still
// consuming would turn into a hot loop.
func TestWrapperAfterShutdownDoesNotSpin(t *testing.T) {
	mem, _ := lock.NewMemoryStore(lock.Config{})
	const delay = 150 * time.Millisecond
	w, err := Wrap(noChannels{}, mem, Config{Queue: "q", UnavailableDelay: delay}, ok("r"))
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	d, ack := delivery("k", "x")
	start := time.Now()
	w.Handle(context.Background(), *d)
	if ack.nacks != 1 || !ack.requeu {
		t.Fatalf("nacks %d requeue %v, want one nack with requeue", ack.nacks, ack.requeu)
	}
	if waited := time.Since(start); waited < delay {
		t.Fatalf("nacked after %v, before UnavailableDelay %v", waited, delay)
	}
}
