package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// connLogs is a slog.Logger's output, safe for concurrent use.
type connLogs struct{ testenv.SyncBuffer }

// newConnLogs returns a logger at debug level writing to the returned
// connLogs.
func newConnLogs() (*connLogs, *slog.Logger) {
	l := &connLogs{}
	return l, slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// hasLine reports whether one line of the logs holds every part.
func (l *connLogs) hasLine(parts ...string) bool {
	for _, line := range strings.Split(l.String(), "\n") {
		ok := true
		for _, p := range parts {
			ok = ok && strings.Contains(line, p)
		}
		if ok {
			return true
		}
	}
	return false
}

// connDialer is a ConsumerConfig.Dial that keeps every connection it opened.
type connDialer struct {
	url   string
	mu    sync.Mutex
	conns []*amqp.Connection
}

func (d *connDialer) dial() (*amqp.Connection, error) {
	c, err := amqp.Dial(d.url)
	if err == nil {
		d.mu.Lock()
		d.conns = append(d.conns, c)
		d.mu.Unlock()
	}
	return c, err
}

func (d *connDialer) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.conns)
}

func (d *connDialer) conn(i int) *amqp.Connection {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.conns[i]
}

// connRun runs c with ctx in the background; the returned channel gets
// Run's error. When the test ends, c is shut down and Run waited for (at
// most 15 s).
func connRun(t *testing.T, c *amqpidem.Consumer, ctx context.Context) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	finished := make(chan struct{})
	go func() {
		done <- c.Run(ctx)
		close(finished)
	}()
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.Shutdown(sctx)
		select {
		case <-finished:
		case <-time.After(5 * time.Second):
			t.Error("Run did not return after Shutdown")
		}
	})
	return done
}

// connRunEnd waits up to d for Run's error; it fails the test if Run goes on.
func connRunEnd(t *testing.T, done <-chan error, d time.Duration) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		t.Fatalf("Run still running after %v", d)
		return nil
	}
}

// ConsumerConfig checks its own fields: the promoted Config.Validate did
// not.
func TestConsumerConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg  amqpidem.ConsumerConfig
		want string // "" for valid
	}{
		{amqpidem.ConsumerConfig{URL: "amqp://x", Config: amqpidem.Config{Queue: "q"}}, ""},
		{amqpidem.ConsumerConfig{Config: amqpidem.Config{Queue: "q"}}, "URL is required"},
		{amqpidem.ConsumerConfig{URL: "amqp://x", Prefetch: -1, Config: amqpidem.Config{Queue: "q"}}, "Prefetch -1"},
		{amqpidem.ConsumerConfig{URL: "amqp://x", Prefetch: 70000, Config: amqpidem.Config{Queue: "q"}}, "Prefetch 70000"},
		{amqpidem.ConsumerConfig{URL: "amqp://x", Concurrency: -2, Config: amqpidem.Config{Queue: "q"}}, "Concurrency -2"},
		{amqpidem.ConsumerConfig{URL: "amqp://x"}, "Config.Queue is required"},
	} {
		err := tc.cfg.Validate()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%+v: %v, want valid", tc.cfg, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("Validate: %v, want an error with %q", err, tc.want)
		}
	}
}

type connTraceKey struct{}

// The handlers' context carries Run's ctx values; cancelling ctx still
// ends Run.
func TestConsumerHandlerSeesRunContextValues(t *testing.T) {
	e := newEnv(t, nil)
	got := make(chan any, 1)
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: e.url, Config: amqpidem.Config{Queue: e.queue}},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			got <- ctx.Value(connTraceKey{})
			return nil, nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithValue(context.Background(), connTraceKey{}, "span-42"))
	defer cancel()
	done := connRun(t, c, ctx)
	e.publish(amqp.Publishing{MessageId: "m", Body: []byte("x")})
	select {
	case v := <-got:
		if v != "span-42" {
			t.Fatalf("handler's ctx value: %v, want span-42 (from Run's ctx)", v)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("handler never ran")
	}
	cancel()
	if err := connRunEnd(t, done, 10*time.Second); !errors.Is(err, context.Canceled) {
		t.Fatalf("Run after ctx cancelled: %v", err)
	}
}

// A wrong password ends Run within seconds, with an error that says so,
// logged at error level, instead of reconnecting forever.
func TestConsumerWrongPasswordEndsRun(t *testing.T) {
	e := newEnv(t, nil)
	u, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(u.User.Username(), "not-the-password")
	logs, logger := newConnLogs()
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: u.String(),
		Config: amqpidem.Config{Queue: e.queue, Logger: logger}}, amqpidem.HandlerFunc(connNoop))
	if err != nil {
		t.Fatal(err)
	}
	err = connRunEnd(t, connRun(t, c, context.Background()), 10*time.Second)
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.AccessRefused || !strings.Contains(err.Error(), "credentials") {
		t.Fatalf("Run: %v; want an ACCESS_REFUSED *amqp.Error explained as bad credentials", err)
	}
	if !logs.hasLine("level=ERROR", "credentials") {
		t.Fatalf("no error logged:\n%s", logs)
	}
}

// A queue declared elsewhere with other arguments ends Run with the
// PRECONDITION_FAILED explained, naming the queue.
func TestConsumerQueueArgumentsMismatchEndsRun(t *testing.T) {
	e := newEnv(t, amqp.Table{"x-max-length": int32(5)})
	logs, logger := newConnLogs()
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: e.url,
		Config: amqpidem.Config{Queue: e.queue, Logger: logger}}, amqpidem.HandlerFunc(connNoop))
	if err != nil {
		t.Fatal(err)
	}
	err = connRunEnd(t, connRun(t, c, context.Background()), 10*time.Second)
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed ||
		!strings.Contains(err.Error(), "PRECONDITION_FAILED") || !strings.Contains(err.Error(), fmt.Sprintf("%q", e.queue)) ||
		!strings.Contains(err.Error(), "QueueArgs") {
		t.Fatalf("Run: %v; want a PRECONDITION_FAILED *amqp.Error naming queue %q and QueueArgs", err, e.queue)
	}
	if !logs.hasLine("level=ERROR", "PRECONDITION_FAILED") {
		t.Fatalf("no error logged:\n%s", logs)
	}
}

// Consuming a queue that does not exist (a Declare that does not declare
// it) ends Run with NOT_FOUND explained.
func TestConsumerMissingQueueEndsRun(t *testing.T) {
	e := newEnv(t, nil)
	queue := e.queue + ".missing"
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: e.url,
		Declare: func(*amqp.Channel) error { return nil },
		Config:  amqpidem.Config{Queue: queue, Logger: slog.New(slog.DiscardHandler)}}, amqpidem.HandlerFunc(connNoop))
	if err != nil {
		t.Fatal(err)
	}
	err = connRunEnd(t, connRun(t, c, context.Background()), 10*time.Second)
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.NotFound || !strings.Contains(err.Error(), fmt.Sprintf("%q", queue)) ||
		!strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("Run: %v; want a NOT_FOUND *amqp.Error saying queue %q does not exist", err, queue)
	}
}

func connNoop(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }

// connCheckedStore is a store whose Check fails.
type connCheckedStore struct {
	lock.Store
	calls atomic.Int32
}

func (s *connCheckedStore) Check(context.Context) error {
	s.calls.Add(1)
	return errors.New("redis is sulking")
}

// Run checks the store once at start; a failed check is logged at error
// level and consuming goes on.
func TestConsumerChecksStore(t *testing.T) {
	e := newEnv(t, nil)
	store := &connCheckedStore{Store: e.store}
	logs, logger := newConnLogs()
	rec := &recorder{}
	startConsumerWith(t, e, store, amqpidem.ConsumerConfig{Config: amqpidem.Config{Logger: logger, Observer: rec}},
		amqpidem.HandlerFunc(connNoop))
	e.publish(amqp.Publishing{MessageId: "m", Body: []byte("x")})
	rec.waitFor(t, 10*time.Second, "m completed", func(evs []amqpidem.Event) bool { return count(evs, "m", amqpidem.Completed) == 1 })
	if n := store.calls.Load(); n != 1 {
		t.Fatalf("Check called %d times, want once", n)
	}
	if !logs.hasLine("level=ERROR", "redis is sulking") {
		t.Fatalf("failed check not logged at error level:\n%s", logs)
	}
}

// Copies are published on a second connection, which outlives the
// consuming connection.
func TestConsumerPublishesOnItsOwnConnection(t *testing.T) {
	e := newEnv(t, nil)
	dl := &connDialer{url: e.url}
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{Dial: dl.dial, Config: amqpidem.Config{Observer: rec}},
		amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) {
			return nil, amqpidem.Permanent(errors.New("no")) // a dead letter: a publish
		}))
	e.publish(amqp.Publishing{MessageId: "m1", Body: []byte("x")})
	rec.waitFor(t, 10*time.Second, "m1 dead-lettered", func(evs []amqpidem.Event) bool { return count(evs, "m1", amqpidem.DeadLettered) == 1 })
	if n := dl.count(); n != 2 {
		t.Fatalf("%d connections after a dead letter, want 2: one to consume, one to publish", n)
	}
	dl.conn(0).Close() // the consuming connection dies
	e.publish(amqp.Publishing{MessageId: "m2", Body: []byte("x")})
	rec.waitFor(t, 15*time.Second, "m2 dead-lettered", func(evs []amqpidem.Event) bool { return count(evs, "m2", amqpidem.DeadLettered) == 1 })
	if n := dl.count(); n != 3 {
		t.Fatalf("%d connections after a reconnection, want 3: the publishing one is kept", n)
	}
	if dl.conn(1).IsClosed() {
		t.Fatal("the publishing connection closed with the consuming one")
	}
}

// When the consuming connection dies, the consumer reconnects and goes on
// while a handler of the dead connection still runs; that handler's
// outcome is stored, and the broker's redelivery is a duplicate.
func TestConsumerReconnectsWithoutWaitingForHandlers(t *testing.T) {
	e := newEnv(t, nil)
	dl := &connDialer{url: e.url}
	var ran runs
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{Dial: dl.dial,
		Config: amqpidem.Config{Observer: rec, InProgressDelay: 200 * time.Millisecond}},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			ran.add(d.MessageId)
			if d.MessageId == "slow" {
				started <- struct{}{}
				select { // a long job, deaf to its context
				case <-release:
				case <-time.After(time.Minute):
				}
			}
			return []byte("done"), nil
		}))
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock) // before Shutdown, which waits for the handler

	e.publish(amqp.Publishing{MessageId: "slow", Body: []byte("x")})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("slow handler never started")
	}
	dl.conn(0).Close()
	e.publish(amqp.Publishing{MessageId: "fast", Body: []byte("x")})
	rec.waitFor(t, 10*time.Second, "fast completed while slow still runs", func(evs []amqpidem.Event) bool {
		return count(evs, "fast", amqpidem.Completed) == 1
	})
	if n := count(connEvents(rec), "slow", amqpidem.Completed); n != 0 {
		t.Fatal("slow completed before it was released")
	}
	unblock()
	rec.waitFor(t, 15*time.Second, "slow completed, and its redelivery a duplicate", func(evs []amqpidem.Event) bool {
		return count(evs, "slow", amqpidem.Completed) == 1 && count(evs, "slow", amqpidem.Duplicate) == 1
	})
	if n := ran.get("slow"); n != 1 {
		t.Fatalf("slow ran %d times, want 1", n)
	}
}

// A delivery that waits for a slot when its connection dies is not run:
// the broker's redelivery is.
func TestConsumerDropsWaitingDeliveriesOfDeadConnection(t *testing.T) {
	e := newEnv(t, nil)
	dl := &connDialer{url: e.url}
	started := make(chan struct{}, 1)
	release := make(chan struct{})
	var mu sync.Mutex
	var waitingRuns []bool // Redelivered of each run of "waiting"
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{Dial: dl.dial, Concurrency: 1,
		Config: amqpidem.Config{Observer: rec, InProgressDelay: 200 * time.Millisecond}},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			switch d.MessageId {
			case "slow":
				started <- struct{}{}
				select {
				case <-release:
				case <-time.After(time.Minute):
				}
			case "waiting":
				mu.Lock()
				waitingRuns = append(waitingRuns, d.Redelivered)
				mu.Unlock()
			}
			return nil, nil
		}))
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock)

	e.publish(amqp.Publishing{MessageId: "slow", Body: []byte("x")})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("slow handler never started")
	}
	e.publish(amqp.Publishing{MessageId: "waiting", Body: []byte("x")})
	eventually(t, 10*time.Second, "waiting delivered", func() bool {
		q, err := e.ch.QueueDeclarePassive(e.queue, true, false, false, false, nil)
		return err == nil && q.Messages == 0
	})
	time.Sleep(100 * time.Millisecond) // its worker waits for the slot
	dl.conn(0).Close()
	time.Sleep(500 * time.Millisecond)
	unblock()
	rec.waitFor(t, 15*time.Second, "waiting completed", func(evs []amqpidem.Event) bool {
		return count(evs, "waiting", amqpidem.Completed) == 1
	})
	time.Sleep(300 * time.Millisecond) // room for a run that should not be
	mu.Lock()
	defer mu.Unlock()
	if len(waitingRuns) != 1 || !waitingRuns[0] {
		t.Fatalf("runs of waiting (redelivered?): %v; want one, of the broker's redelivery", waitingRuns)
	}
}

// connEvents returns the events r has recorded so far.
func connEvents(r *recorder) []amqpidem.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]amqpidem.Event(nil), r.events...)
}

// Run's end waits for the handlers of a dead connection too, and leaves
// no goroutine behind.
func TestConsumerRunWaitsForHandlersOfDeadConnections(t *testing.T) {
	e := newEnv(t, nil)
	baseline := runtime.NumGoroutine()
	dl := &connDialer{url: e.url}
	started := make(chan struct{}, 1)
	var returned atomic.Bool
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{Dial: dl.dial,
		Config: amqpidem.Config{Queue: e.queue, InProgressDelay: 200 * time.Millisecond}},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			started <- struct{}{}
			<-ctx.Done() // only stops when told to
			returned.Store(true)
			return nil, ctx.Err()
		}))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	e.publish(amqp.Publishing{MessageId: "long", Body: []byte("x")})
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("handler never started")
	}
	dl.conn(0).Close()
	eventually(t, 10*time.Second, "a new connection", func() bool { return dl.count() >= 2 })

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := c.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown: %v, want DeadlineExceeded (the handler had to be cancelled)", err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, amqpidem.ErrConsumerClosed) {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return")
	}
	if !returned.Load() {
		t.Fatal("Run returned before the handler of the dead connection")
	}
	waitGoroutines(t, baseline)
}

// When Run's ctx ends while it is still trying to connect, its error says
// why it could not consume, not only that ctx ended: a first run against a
// broker that is not there returned a bare "context deadline exceeded",
// the cause only in the log.
func TestConsumerRunDeadlineWrapsTheCause(t *testing.T) {
	e := newEnv(t, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now: connection refused
	_, logger := newConnLogs()
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: "amqp://guest:guest@" + addr + "/",
		Config: amqpidem.Config{Queue: e.queue, Logger: logger}}, amqpidem.HandlerFunc(connNoop))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	err = connRunEnd(t, connRun(t, c, ctx), 10*time.Second)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("Run: %v; want context.DeadlineExceeded, wrapping the refused connection", err)
	}
}
