package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// retryDelay is the delay of the delayed requeues in these tests; a delay
// tier of its own (delay queues "<queue>.delay.3000", "<queue>.delayq.3000").
const retryDelay = 3 * time.Second

// retryOnce is a consumer whose handler fails a key's first execution and
// succeeds on the next, with every retry retryDelay later.
type retryOnce struct {
	e   *env
	rec *recorder

	mu   sync.Mutex
	seen []amqp.Delivery // what the handler was given, in order
}

// startRetryOnce declares a work queue of type queueType and runs a
// retryOnce consumer on it; the test's delay queues are deleted when it
// ends.
func startRetryOnce(t *testing.T, queueType string) *retryOnce {
	t.Helper()
	e := newEnv(t, amqp.Table{"x-queue-type": queueType})
	t.Cleanup(func() { deleteQueues(e, delayQueueName(e, "classic"), delayQueueName(e, "quorum")) })
	r := &retryOnce{e: e, rec: &recorder{}}
	h := amqpidem.HandlerFunc(func(_ context.Context, d *amqp.Delivery) ([]byte, error) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.seen = append(r.seen, *d)
		if len(r.seen) == 1 {
			return nil, errors.New("first try fails")
		}
		return []byte("ok"), nil
	})
	startConsumer(t, e, amqpidem.ConsumerConfig{
		QueueArgs: amqp.Table{"x-queue-type": queueType},
		Config: amqpidem.Config{
			MaxAttempts:      3,
			UnavailableDelay: 200 * time.Millisecond,
			Backoff:          func() backoff.BackOff { return backoff.NewConstantBackOff(retryDelay) },
			Observer:         r.rec,
		},
	}, h)
	return r
}

// delayQueueName is the name amqpidem gives the retryDelay delay queue of
// e's work queue when that is of type queueType.
func delayQueueName(e *env, queueType string) string {
	infix := ".delay."
	if queueType == "quorum" {
		infix = ".delayq."
	}
	return fmt.Sprintf("%s%s%d", e.queue, infix, retryDelay.Milliseconds())
}

// deleteQueues deletes queues, each on a channel of its own.
func deleteQueues(e *env, queues ...string) {
	for _, q := range queues {
		if ch, err := e.conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(q, false, false, false)
			ch.Close()
		}
	}
}

// declareOn declares queue with args (passively when passive is set) on a
// channel of its own, since a refusal closes the channel.
func declareOn(t *testing.T, e *env, queue string, args amqp.Table, passive bool) (amqp.Queue, error) {
	t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if passive {
		return ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	}
	return ch.QueueDeclare(queue, true, false, false, false, args)
}

// waitRetried publishes one message and waits until its first execution
// failed and it was requeued.
func (r *retryOnce) waitRetried(t *testing.T, msg amqp.Publishing) {
	t.Helper()
	r.e.publish(msg)
	r.rec.waitFor(t, 10*time.Second, "the delayed requeue", func(evs []amqpidem.Event) bool {
		return count(evs, msg.MessageId, amqpidem.Retried) == 1
	})
}

// handled returns the deliveries the handler was given so far.
func (r *retryOnce) handled() []amqp.Delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]amqp.Delivery(nil), r.seen...)
}

// eventTime returns when the first event of key with outcome o was
// observed.
func (r *retryOnce) eventTime(t *testing.T, key string, o amqpidem.Outcome) time.Time {
	t.Helper()
	r.rec.mu.Lock()
	defer r.rec.mu.Unlock()
	for i, ev := range r.rec.events {
		if ev.Key == key && ev.Outcome == o {
			return r.rec.at[i]
		}
	}
	t.Fatalf("no %s event for %q", o, key)
	return time.Time{}
}

// quorumDelayArgs are the arguments amqpidem declares the retryDelay
// delay queue of e's quorum work queue with.
func quorumDelayArgs(e *env) amqp.Table {
	ms := retryDelay.Milliseconds()
	return amqp.Table{
		"x-queue-type":              "quorum",
		"x-message-ttl":             ms,
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": e.queue,
		"x-dead-letter-strategy":    "at-least-once",
		"x-overflow":                "reject-publish",
	}
}

// TestQuorumDelayedRequeue checks that on a quorum work queue a delayed
// requeue waits in a quorum delay queue "<queue>.delayq.<ms>", not the
// classic one, and comes back from it after the delay.
func TestQuorumDelayedRequeue(t *testing.T) {
	r := startRetryOnce(t, "quorum")
	r.waitRetried(t, amqp.Publishing{MessageId: "q1", Body: []byte("pay 10")})
	retried := r.eventTime(t, "q1", amqpidem.Retried)

	dq := delayQueueName(r.e, "quorum")
	q, err := declareOn(t, r.e, dq, nil, true)
	if err != nil {
		t.Fatalf("the quorum delay queue %q does not exist: %v", dq, err)
	}
	if q.Messages != 1 && time.Since(retried) < retryDelay-500*time.Millisecond {
		t.Errorf("the quorum delay queue %q holds %d messages, want the copy", dq, q.Messages)
	}
	if _, err := declareOn(t, r.e, delayQueueName(r.e, "classic"), nil, true); err == nil {
		t.Errorf("a classic delay queue %q was declared for a quorum work queue", delayQueueName(r.e, "classic"))
	}

	r.rec.waitFor(t, 10*time.Second, "the copy back and completed", func(evs []amqpidem.Event) bool {
		return count(evs, "q1", amqpidem.Completed) == 1
	})
	if gap := r.eventTime(t, "q1", amqpidem.Completed).Sub(retried); gap < retryDelay-200*time.Millisecond {
		t.Errorf("the copy came back after %v, want about %v", gap, retryDelay)
	}
	seen := r.handled()
	if len(seen) != 2 {
		t.Fatalf("handler ran %d times, want 2", len(seen))
	}
	if got := seen[1].Headers["x-first-death-queue"]; got != dq {
		t.Errorf("the copy came back from %v, want %q", got, dq)
	}
	if string(seen[1].Body) != "pay 10" || seen[1].MessageId != "q1" {
		t.Errorf("the copy lost data: %q %q", seen[1].MessageId, seen[1].Body)
	}
}

// TestQuorumDelayQueueArguments checks the arguments of the quorum delay
// queue amqpidem declared: RabbitMQ accepts a declaration of an existing
// queue only with equivalent arguments, so one with exactly the expected
// arguments must pass and one with any of them changed must fail.
func TestQuorumDelayQueueArguments(t *testing.T) {
	r := startRetryOnce(t, "quorum")
	r.waitRetried(t, amqp.Publishing{MessageId: "q2", Body: []byte("pay 20")})
	dq := delayQueueName(r.e, "quorum")

	if _, err := declareOn(t, r.e, dq, nil, true); err != nil {
		t.Fatalf("the quorum delay queue %q does not exist: %v", dq, err)
	}
	if _, err := declareOn(t, r.e, dq, quorumDelayArgs(r.e), false); err != nil {
		t.Fatalf("declaring %q with the expected arguments %v: %v", dq, quorumDelayArgs(r.e), err)
	}
	changes := map[string]any{
		"x-dead-letter-strategy": "at-most-once",
		"x-overflow":             "drop-head",
		"x-queue-type":           "classic",
	}
	for arg, v := range changes {
		args := quorumDelayArgs(r.e)
		args[arg] = v
		_, err := declareOn(t, r.e, dq, args, false)
		var ae *amqp.Error
		if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
			t.Errorf("declaring %q with %s=%v: got %v, want PRECONDITION_FAILED", dq, arg, v, err)
		}
	}
	r.rec.waitFor(t, 10*time.Second, "the copy back and completed", func(evs []amqpidem.Event) bool {
		return count(evs, "q2", amqpidem.Completed) == 1
	})
}

// TestClassicDelayedRequeue checks that a classic work queue keeps its
// classic delay queue "<queue>.delay.<ms>", with the same arguments as
// before.
func TestClassicDelayedRequeue(t *testing.T) {
	r := startRetryOnce(t, "classic")
	r.waitRetried(t, amqp.Publishing{MessageId: "c1", Body: []byte("pay 30")})
	dq := delayQueueName(r.e, "classic")
	ms := retryDelay.Milliseconds()
	want := amqp.Table{
		"x-message-ttl":             ms,
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": r.e.queue,
		"x-expires":                 2*ms + time.Minute.Milliseconds(),
		"x-queue-type":              "classic",
	}
	if _, err := declareOn(t, r.e, dq, want, false); err != nil {
		t.Errorf("declaring %q with the classic arguments %v: %v", dq, want, err)
	}
	if _, err := declareOn(t, r.e, delayQueueName(r.e, "quorum"), nil, true); err == nil {
		t.Errorf("a quorum delay queue %q was declared for a classic work queue", delayQueueName(r.e, "quorum"))
	}
	r.rec.waitFor(t, 10*time.Second, "the copy back and completed", func(evs []amqpidem.Event) bool {
		return count(evs, "c1", amqpidem.Completed) == 1
	})
	if seen := r.handled(); len(seen) != 2 || seen[1].Headers["x-first-death-queue"] != dq {
		t.Errorf("the copy did not come back from %q", dq)
	}
}

// TestDelayQueueWithOtherArguments checks that a delay queue that exists
// with other arguments (every declaration PRECONDITION_FAILED) gives an
// error naming the queue and saying what to do.
func TestDelayQueueWithOtherArguments(t *testing.T) {
	r := startRetryOnce(t, "classic")
	dq := delayQueueName(r.e, "classic")
	if _, err := declareOn(t, r.e, dq, amqp.Table{"x-message-ttl": int64(1)}, false); err != nil {
		t.Fatal(err)
	}
	r.e.publish(amqp.Publishing{MessageId: "c2", Body: []byte("pay 40")})
	var got error
	r.rec.waitFor(t, 15*time.Second, "an event with the declaration's error", func(evs []amqpidem.Event) bool {
		for _, ev := range evs {
			if ev.Err != nil && strings.Contains(ev.Err.Error(), dq) {
				got = ev.Err
				return true
			}
		}
		return false
	})
	for _, want := range []string{fmt.Sprintf("declare queue %q", dq), "exists with arguments other than those amqpidem declares",
		"delete the queue", "PRECONDITION_FAILED"} {
		if !strings.Contains(got.Error(), want) {
			t.Errorf("error %q does not contain %q", got, want)
		}
	}
}

// TestDelayedCopyOfExpiringMessageWaits checks that a delayed copy of a
// message whose expiration is shorter than the delay still waits the
// delay (an expiration on the copy in the delay queue would have the
// broker dead-letter it back early), and that when it comes back past the
// expiry its HeaderExpiresAt records, it is dead-lettered as expired, not
// run and not dropped.
func TestDelayedCopyOfExpiringMessageWaits(t *testing.T) {
	for _, qt := range []string{"classic", "quorum"} {
		t.Run(qt, func(t *testing.T) {
			r := startRetryOnce(t, qt)
			r.waitRetried(t, amqp.Publishing{MessageId: "x1", Body: []byte("pay 50"), Expiration: "1000"})
			retried := r.eventTime(t, "x1", amqpidem.Retried)
			r.rec.waitFor(t, 10*time.Second, "the copy back, dead-lettered as expired", func(evs []amqpidem.Event) bool {
				for _, ev := range evs {
					if ev.Key == "x1" && ev.Outcome == amqpidem.DeadLettered && ev.Reason == "expired" {
						return true
					}
				}
				return false
			})
			if gap := r.eventTime(t, "x1", amqpidem.DeadLettered).Sub(retried); gap < retryDelay-200*time.Millisecond {
				t.Errorf("the copy came back after %v, want the delay, %v", gap, retryDelay)
			}
			if seen := r.handled(); len(seen) != 1 {
				t.Errorf("handler ran %d times, want once (the expired copy is not run)", len(seen))
			}
			m, ok := r.e.get(r.e.queue+".dlq", 5*time.Second)
			if !ok || m.Headers[amqpidem.HeaderOriginalExpiration] != "1000" || m.Expiration != "" {
				t.Errorf("dead letter: found %v, Expiration %q, headers %v", ok, m.Expiration, m.Headers)
			}
		})
	}
}

// inProcessConsumer runs a consumer with Config.DelayInProcess on a new
// quorum work queue, whose handler fails a key's first execution with
// every retry delay later; it returns the env, the recorder and the times
// of the handler's executions.
func inProcessConsumer(t *testing.T, delay time.Duration) (*env, *recorder, *amqpidem.Consumer, func() []time.Time) {
	t.Helper()
	return inProcessConsumerDial(t, delay, nil)
}

// inProcessConsumerDial is inProcessConsumer with a ConsumerConfig.Dial
// (nil: the env's URL).
func inProcessConsumerDial(t *testing.T, delay time.Duration, dial func() (*amqp.Connection, error)) (*env, *recorder, *amqpidem.Consumer, func() []time.Time) {
	t.Helper()
	e := newEnv(t, amqp.Table{"x-queue-type": "quorum"})
	t.Cleanup(func() { deleteQueues(e, delayQueueName(e, "classic"), delayQueueName(e, "quorum")) })
	rec := &recorder{}
	var mu sync.Mutex
	var runs []time.Time
	h := amqpidem.HandlerFunc(func(_ context.Context, d *amqp.Delivery) ([]byte, error) {
		mu.Lock()
		defer mu.Unlock()
		runs = append(runs, time.Now())
		if len(runs) == 1 {
			return nil, errors.New("first try fails")
		}
		return []byte("ok"), nil
	})
	c := startConsumer(t, e, amqpidem.ConsumerConfig{
		QueueArgs: amqp.Table{"x-queue-type": "quorum"},
		Dial:      dial,
		Config: amqpidem.Config{
			MaxAttempts:    3,
			DelayInProcess: true,
			Backoff:        func() backoff.BackOff { return backoff.NewConstantBackOff(delay) },
			Observer:       rec,
		},
	}, h)
	return e, rec, c, func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return append([]time.Time(nil), runs...)
	}
}

// TestDelayInProcess checks Config.DelayInProcess: a retry waits its delay
// with the delivery unacked in the work queue, then comes back as a copy
// published straight to it; no delay queue is declared.
func TestDelayInProcess(t *testing.T) {
	e, rec, _, runs := inProcessConsumer(t, retryDelay)
	e.publish(amqp.Publishing{MessageId: "ip1", Body: []byte("pay 40")})
	waitRuns(t, runs, 1)
	time.Sleep(retryDelay / 3)
	// Waiting: held by the consumer, not ready in the queue.
	q, err := declareOn(t, e, e.queue, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	if q.Messages != 0 {
		t.Errorf("while the retry waits, %d messages are ready in %s, want 0 (the delivery held unacked)", q.Messages, e.queue)
	}
	rec.waitFor(t, 3*retryDelay, "the retry completed", func(evs []amqpidem.Event) bool {
		return count(evs, "ip1", amqpidem.Completed) == 1
	})
	got := runs()
	if len(got) != 2 {
		t.Fatalf("handler ran %d times, want 2", len(got))
	}
	if gap := got[1].Sub(got[0]); gap < retryDelay-100*time.Millisecond {
		t.Errorf("the retry ran %v after the first try, want at least %v", gap, retryDelay)
	}
	for _, qt := range []string{"classic", "quorum"} {
		if _, err := declareOn(t, e, delayQueueName(e, qt), nil, true); err == nil {
			t.Errorf("delay queue %q was declared with DelayInProcess", delayQueueName(e, qt))
		}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, ev := range rec.events {
		if ev.Outcome == amqpidem.Retried && ev.Delay != retryDelay {
			t.Errorf("retried event: Delay %v, want %v", ev.Delay, retryDelay)
		}
	}
}

// TestDelayInProcessShutdown checks that Shutdown cuts an in-process wait
// short and sends the copy back to the queue at once: nothing is lost, and
// the next consumer runs it.
func TestDelayInProcessShutdown(t *testing.T) {
	e, rec, c, runs := inProcessConsumer(t, time.Hour)
	e.publish(amqp.Publishing{MessageId: "ip2", Body: []byte("pay 50")})
	waitRuns(t, runs, 1)
	time.Sleep(200 * time.Millisecond) // into the wait
	shutdownSoon(t, c.Shutdown)
	rec.mu.Lock()
	n := count(rec.events, "ip2", amqpidem.Retried)
	for _, ev := range rec.events {
		// The wait it had, cut short: not the hour it was to have.
		if ev.Outcome == amqpidem.Retried && (ev.Delay <= 0 || ev.Delay > time.Minute) {
			t.Errorf("retried event cut short by Shutdown: Delay %v, want the time it waited", ev.Delay)
		}
	}
	rec.mu.Unlock()
	if n != 1 {
		t.Errorf("%d retried events, want 1", n)
	}
	q, err := declareOn(t, e, e.queue, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	if q.Messages != 1 {
		t.Fatalf("after Shutdown %d messages are ready in %s, want the copy", q.Messages, e.queue)
	}
}

// waitRuns waits until the handler ran n times.
func waitRuns(t *testing.T, runs func() []time.Time, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for len(runs()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("the handler ran %d times in 10 s, want %d", len(runs()), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestDelayInProcessConnectionLost checks that a delivery held for its
// delay is let go at once when its channel dies: the broker delivers it
// again, and no copy is published when the wait would have ended (here an
// hour later, at Shutdown).
func TestDelayInProcessConnectionLost(t *testing.T) {
	dl := &connDialer{url: testenv.AMQPURL(t)}
	dial := dl.dial
	e, rec, c, runs := inProcessConsumerDial(t, time.Hour, dial)
	e.publish(amqp.Publishing{MessageId: "ip3", Body: []byte("pay 60")})
	waitRuns(t, runs, 1)
	time.Sleep(200 * time.Millisecond) // into the wait
	dl.conn(0).Close()
	rec.waitFor(t, 10*time.Second, "the held delivery let go, and its redelivery completed", func(evs []amqpidem.Event) bool {
		return count(evs, "ip3", amqpidem.Abandoned) == 1 && count(evs, "ip3", amqpidem.Completed) == 1
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if n := len(runs()); n != 2 {
		t.Errorf("the handler ran %d times, want 2", n)
	}
	if q, err := declareOn(t, e, e.queue, nil, true); err != nil || q.Messages != 0 {
		t.Errorf("after Shutdown: %d messages in %s (%v), want none: a copy was published for the let-go delivery", q.Messages, e.queue, err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, ev := range rec.events {
		if ev.Outcome == amqpidem.Abandoned && !strings.Contains(ev.Reason, "channel closed during the wait") {
			t.Errorf("abandoned event: reason %q", ev.Reason)
		}
	}
}

// TestDelayInProcessWrapperShutdown checks that Wrapper.Shutdown ends a
// Handle waiting out a requeue delay at once: the copy goes back to the
// queue and Shutdown returns without waiting for its context.
func TestDelayInProcessWrapperShutdown(t *testing.T) {
	e := newEnv(t, nil)
	w, err := amqpidem.Wrap(e.conn, e.store, amqpidem.Config{
		Queue:          e.queue,
		DelayInProcess: true,
		Backoff:        func() backoff.BackOff { return backoff.NewConstantBackOff(time.Hour) },
	}, amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) {
		return nil, errors.New("fails")
	}))
	if err != nil {
		t.Fatal(err)
	}
	e.publish(amqp.Publishing{MessageId: "ip4", Body: []byte("pay 70")})
	ch, msgs := e.consume()
	handled := make(chan amqpidem.Event, 1)
	go func() { handled <- w.Handle(context.Background(), <-msgs) }()
	time.Sleep(500 * time.Millisecond) // into the wait
	if err := ch.Cancel("", false); err != nil {
		t.Log(err)
	}
	shutdownSoon(t, w.Shutdown)
	select {
	case ev := <-handled:
		if ev.Outcome != amqpidem.Retried {
			t.Errorf("Handle: outcome %v (%s), want retried", ev.Outcome, ev.Reason)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Handle did not return after Shutdown")
	}
	ch.Close()
	if q, err := declareOn(t, e, e.queue, nil, true); err != nil || q.Messages != 1 {
		t.Errorf("after Shutdown: %d messages in %s (%v), want the copy", q.Messages, e.queue, err)
	}
}

// shutdownSoon calls shutdown, with 30 s to spare, and fails the test if
// it fails or takes more than 5 s: a wait of an hour must be cut short.
func shutdownSoon(t *testing.T, shutdown func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	if err := shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("Shutdown took %v with a wait of an hour under way", took)
	}
}

// TestDelayInProcessHoldsNoHandlerSlot checks what Config.DelayInProcess
// documents: a delivery waiting its delay holds one of the prefetch, not
// a handler slot. With one handler slot, a second message completes while
// the first waits an hour.
func TestDelayInProcessHoldsNoHandlerSlot(t *testing.T) {
	e := newEnv(t, nil)
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Prefetch:    4,
		Concurrency: 1,
		Config: amqpidem.Config{
			DelayInProcess: true,
			Backoff:        func() backoff.BackOff { return backoff.NewConstantBackOff(time.Hour) },
			Observer:       rec,
		},
	}, amqpidem.HandlerFunc(func(_ context.Context, d *amqp.Delivery) ([]byte, error) {
		if d.MessageId == "waits" {
			return nil, errors.New("fails, then waits an hour")
		}
		return []byte("ok"), nil
	}))
	e.publish(amqp.Publishing{MessageId: "waits", Body: []byte("pay 80")})
	time.Sleep(500 * time.Millisecond) // its handler ran, its wait began
	e.publish(amqp.Publishing{MessageId: "next", Body: []byte("pay 90")})
	rec.waitFor(t, 10*time.Second, "the next message completed while the first waits", func(evs []amqpidem.Event) bool {
		return count(evs, "next", amqpidem.Completed) == 1
	})
}
