package amqpidem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// env is one test's broker connection, queue and store.
type env struct {
	t     *testing.T
	url   string
	conn  *amqp.Connection
	ch    *amqp.Channel
	queue string
	store *lock.RedisStore
}

func newEnv(t *testing.T, queueArgs amqp.Table) *env {
	t.Helper()
	url := testenv.AMQPURL(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	name := testenv.Name(t)
	if _, err := ch.QueueDeclare(name, true, false, false, false, queueArgs); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c, err := amqp.Dial(url)
		if err != nil {
			return
		}
		defer c.Close()
		ch, err := c.Channel()
		if err != nil {
			return
		}
		for _, q := range append([]string{name, name + ".dlq"}, delayQueues(name)...) {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
	})
	store, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: name})
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, url: url, conn: conn, ch: ch, queue: name, store: store}
}

// delayQueues lists the quorum delay queues of queue on the local broker
// (they do not expire), through rabbitmqctl when it is there; none
// otherwise.
func delayQueues(queue string) []string {
	out, err := exec.Command("rabbitmqctl", "list_queues", "-q", "--no-table-headers", "name").Output()
	if err != nil {
		return nil
	}
	var qs []string
	for _, q := range strings.Fields(string(out)) {
		if strings.HasPrefix(q, queue+".delayq.") {
			qs = append(qs, q)
		}
	}
	return qs
}

func (e *env) publish(msg amqp.Publishing) {
	e.t.Helper()
	if msg.DeliveryMode == 0 {
		msg.DeliveryMode = amqp.Persistent
	}
	if err := e.ch.PublishWithContext(context.Background(), "", e.queue, false, false, msg); err != nil {
		e.t.Fatal(err)
	}
}

// consume starts a consumer of the work queue on a channel of its own, as a
// user's delivery loop does around a Wrapper.
func (e *env) consume() (*amqp.Channel, <-chan amqp.Delivery) {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	msgs, err := ch.Consume(e.queue, "", false, false, false, false, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return ch, msgs
}

// get takes one message from queue q, waiting up to d for it.
func (e *env) get(q string, d time.Duration) (amqp.Delivery, bool) {
	e.t.Helper()
	deadline := time.Now().Add(d)
	for {
		m, ok, err := e.ch.Get(q, true)
		if err != nil {
			e.t.Fatalf("get %s: %v", q, err)
		}
		if ok || time.Now().After(deadline) {
			return m, ok
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// recorder is an Observer that keeps every event.
type recorder struct {
	mu     sync.Mutex
	events []amqpidem.Event
	at     []time.Time
}

func (r *recorder) Observe(_ context.Context, e amqpidem.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
	r.at = append(r.at, time.Now())
}

// waitFor waits until cond holds over the events, or fails after d.
func (r *recorder) waitFor(t *testing.T, d time.Duration, what string, cond func([]amqpidem.Event) bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		r.mu.Lock()
		okNow := cond(r.events)
		evs := append([]amqpidem.Event(nil), r.events...)
		r.mu.Unlock()
		if okNow {
			return
		}
		if time.Now().After(deadline) {
			var b strings.Builder
			for _, e := range evs {
				fmt.Fprintf(&b, "\n  %s %s %q %v", e.Key, e.Outcome, e.Reason, e.Err)
			}
			t.Fatalf("timed out waiting for %s; events:%s", what, b.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func count(evs []amqpidem.Event, key string, o amqpidem.Outcome) int {
	n := 0
	for _, e := range evs {
		if e.Key == key && e.Outcome == o {
			n++
		}
	}
	return n
}

// startConsumer runs a Consumer until the test ends; it fails the test if
// Shutdown does not return cleanly.
func startConsumer(t *testing.T, e *env, cfg amqpidem.ConsumerConfig, h amqpidem.Handler) *amqpidem.Consumer {
	t.Helper()
	return startConsumerWith(t, e, e.store, cfg, h)
}

// startConsumerWith is startConsumer on another store than e's.
func startConsumerWith(t *testing.T, e *env, store lock.Store, cfg amqpidem.ConsumerConfig, h amqpidem.Handler) *amqpidem.Consumer {
	t.Helper()
	cfg.URL = e.url
	if cfg.Queue == "" {
		cfg.Queue = e.queue
	}
	c, err := amqpidem.NewConsumer(store, cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	return c
}

// runs counts handler executions per key.
type runs struct {
	mu sync.Mutex
	n  map[string]int
}

func (r *runs) add(key string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == nil {
		r.n = map[string]int{}
	}
	r.n[key]++
	return r.n[key]
}

func (r *runs) get(key string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[key]
}

func TestConsumerOutcomeTable(t *testing.T) {
	for _, qt := range []string{"classic", "quorum"} {
		t.Run(qt, func(t *testing.T) { testOutcomeTable(t, qt) })
	}
}

func testOutcomeTable(t *testing.T, queueType string) {
	e := newEnv(t, amqp.Table{"x-queue-type": queueType})
	var ran runs
	var flakyMu sync.Mutex
	var flakyStarts []time.Time // when each execution of "flaky" started
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		info, _ := amqpidem.FromContext(ctx)
		n := ran.add(d.MessageId)
		switch d.Type {
		case "permanent":
			return nil, amqpidem.Permanent(errors.New("card declined"))
		case "always":
			return nil, errors.New("gateway timeout")
		case "flaky":
			flakyMu.Lock()
			flakyStarts = append(flakyStarts, time.Now())
			flakyMu.Unlock()
			if n < 3 {
				return nil, fmt.Errorf("flaky failure %d", n)
			}
		case "slow":
			select {
			case <-time.After(1500 * time.Millisecond):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		return []byte(fmt.Sprintf("done:%s:attempt=%d:fence=%d", d.MessageId, info.Attempt, info.Fence)), nil
	})
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		QueueArgs: amqp.Table{"x-queue-type": queueType},
		Config: amqpidem.Config{
			LeaseTTL:        300 * time.Millisecond,
			MaxAttempts:     3,
			InProgressDelay: 200 * time.Millisecond,
			Backoff: func() backoff.BackOff {
				b := backoff.NewExponentialBackOff()
				b.InitialInterval, b.Multiplier, b.RandomizationFactor, b.MaxElapsedTime = 300*time.Millisecond, 2, 0, 0
				b.Reset()
				return b
			},
			Observer: rec,
		},
		Prefetch: 16,
	}, h)

	e.publish(amqp.Publishing{MessageId: "ok", Body: []byte("pay 10")})
	e.publish(amqp.Publishing{MessageId: "perm", Type: "permanent", Body: []byte("pay 20"),
		Headers: amqp.Table{"tenant": "acme"}})
	e.publish(amqp.Publishing{MessageId: "always", Type: "always", Body: []byte("pay 30")})
	e.publish(amqp.Publishing{MessageId: "flaky", Type: "flaky", Body: []byte("pay 40")})
	e.publish(amqp.Publishing{Body: []byte("no key")})
	e.publish(amqp.Publishing{MessageId: "slow", Type: "slow", Body: []byte("long job")})
	time.Sleep(100 * time.Millisecond)
	e.publish(amqp.Publishing{MessageId: "slow", Type: "slow", Body: []byte("long job")}) // while it runs
	rec.waitFor(t, 10*time.Second, "ok completed", func(evs []amqpidem.Event) bool { return count(evs, "ok", amqpidem.Completed) == 1 })
	e.publish(amqp.Publishing{MessageId: "ok", Body: []byte("pay 10")})      // duplicate of completed
	e.publish(amqp.Publishing{MessageId: "ok", Body: []byte("pay 10 more")}) // same key, other payload

	rec.waitFor(t, 20*time.Second, "every message settled", func(evs []amqpidem.Event) bool {
		return count(evs, "ok", amqpidem.Duplicate) == 1 &&
			count(evs, "perm", amqpidem.DeadLettered) == 1 &&
			count(evs, "always", amqpidem.DeadLettered) == 1 &&
			count(evs, "flaky", amqpidem.Completed) == 1 &&
			count(evs, "", amqpidem.DeadLettered) == 1 &&
			count(evs, "slow", amqpidem.Completed) == 1 && count(evs, "slow", amqpidem.Duplicate) == 1 &&
			count(evs, "ok", amqpidem.DeadLettered) == 1
	})

	// A duplicate of failed work is not run again: dead-lettered (the
	// default policy) with the stored error.
	e.publish(amqp.Publishing{MessageId: "perm", Type: "permanent", Body: []byte("pay 20")})
	rec.waitFor(t, 10*time.Second, "failed duplicate dead-lettered", func(evs []amqpidem.Event) bool {
		return count(evs, "perm", amqpidem.DeadLettered) == 2
	})

	// Each key ran as often as its story says, never more.
	for key, want := range map[string]int{"ok": 1, "perm": 1, "always": 3, "flaky": 3, "slow": 1} {
		if got := ran.get(key); got != want {
			t.Errorf("handler runs for %q: got %d, want %d", key, got, want)
		}
	}

	rec.mu.Lock()
	evs := append([]amqpidem.Event(nil), rec.events...)
	rec.mu.Unlock()
	if count(evs, "slow", amqpidem.Busy) < 1 {
		t.Errorf("the duplicate of the long job was never requeued as busy")
	}
	// Requeue delays follow the backoff: 300 ms, then 600 ms. Executions
	// start at least that far apart (more: the copy is published, and on a
	// quorum queue a new delay queue started, after the handler returned).
	var delays []time.Duration
	for _, ev := range evs {
		if ev.Key == "flaky" && ev.Outcome == amqpidem.Retried {
			delays = append(delays, ev.Delay)
		}
	}
	if len(delays) != 2 || delays[0] != 300*time.Millisecond || delays[1] != 600*time.Millisecond {
		t.Errorf("flaky requeue delays: %v, want [300ms 600ms]", delays)
	}
	flakyMu.Lock()
	if len(flakyStarts) == 3 {
		gap1, gap2 := flakyStarts[1].Sub(flakyStarts[0]), flakyStarts[2].Sub(flakyStarts[1])
		if gap1 < 300*time.Millisecond || gap2 < 600*time.Millisecond {
			t.Errorf("gaps between executions: %v, %v; want >= 300ms, >= 600ms", gap1, gap2)
		}
	}
	flakyMu.Unlock()

	// Dead letters: one copy each, with headers a person can act on.
	dead := map[string]amqp.Delivery{}
	for range 5 {
		m, ok := e.get(e.queue+".dlq", 5*time.Second)
		if !ok {
			t.Fatalf("dead-letter queue has %d messages, want 5", len(dead))
		}
		reason, _ := m.Headers[amqpidem.HeaderReason].(string)
		dead[m.MessageId+"/"+reason] = m
	}
	if _, extra := e.get(e.queue+".dlq", 300*time.Millisecond); extra {
		t.Fatal("more than 5 dead letters")
	}
	for _, want := range []string{"perm/permanent failure", "perm/failed duplicate", "always/attempts exhausted", "/missing key", "ok/key conflict"} {
		if _, ok := dead[want]; !ok {
			t.Errorf("no dead letter %q; got %v", want, keys(dead))
		}
	}
	if m := dead["perm/permanent failure"]; m.Headers["tenant"] != "acme" || string(m.Body) != "pay 20" ||
		!strings.Contains(fmt.Sprint(m.Headers[amqpidem.HeaderError]), "card declined") ||
		m.Headers[amqpidem.HeaderOriginalRoutingKey] != e.queue || m.Headers[amqpidem.HeaderConsumer] == nil ||
		m.Headers[amqpidem.HeaderFirstSeen] == nil || m.Type != "permanent" {
		t.Errorf("permanent dead letter lost data: headers %v body %q", m.Headers, m.Body)
	}
	if m := dead["perm/failed duplicate"]; !strings.Contains(fmt.Sprint(m.Headers[amqpidem.HeaderError]), "card declined") {
		t.Errorf("failed duplicate's dead letter lacks the stored error: %v", m.Headers)
	}
	if m := dead["always/attempts exhausted"]; fmt.Sprint(m.Headers[amqpidem.HeaderAttempt]) != "3" ||
		!strings.Contains(fmt.Sprint(m.Headers[amqpidem.HeaderError]), "gateway timeout") {
		t.Errorf("exhausted dead letter headers: %v", m.Headers)
	}

	// Records: completed results are stored; failures too.
	res, err := e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, "flaky")})
	if err != nil || res.Status != lock.Completed || !bytes.Contains(res.Value, []byte("done:flaky:attempt=3")) {
		t.Errorf("flaky record: %v %q %v", res.Status, res.Value, err)
	}
	res, err = e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, "always")})
	if err != nil || res.Status != lock.Failed || !strings.Contains(res.Error, "gateway timeout") {
		t.Errorf("always record: %v %q %v", res.Status, res.Error, err)
	}
}

func keys(m map[string]amqp.Delivery) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
