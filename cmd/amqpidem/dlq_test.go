package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// interruptingAdmin answers Inspect, then cancels the run's context: an
// operator's Ctrl-C landing just after a lookup succeeded.
type interruptingAdmin struct {
	lock.Admin
	cancel context.CancelFunc
}

func (a interruptingAdmin) Inspect(ctx context.Context, key string) (lock.Record, error) {
	rec, err := a.Admin.Inspect(ctx, key)
	a.cancel()
	return rec, err
}

// failedRecord stores a failed record of key under endpoint in a new
// MemoryStore.
func failedRecord(t *testing.T, endpoint, key string) *lock.MemoryStore {
	t.Helper()
	s, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: amqpidem.StoreKey(endpoint, key)})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Fail(ctx, res.Lease, "permanent failure: card declined"); err != nil {
		t.Fatal(err)
	}
	return s
}

// A lookup that succeeded is decided on, even when the run is interrupted
// right after it: the interruption is not a store error (it printed
// "Redis at ...: %!w(<nil>)").
func TestRecordInterruptedAfterLookup(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	admin := interruptingAdmin{Admin: failedRecord(t, "orders", "k1"), cancel: cancel}
	r := &replayer{o: &options{timeout: time.Second, redisURL: "redis://127.0.0.1:6379/0"}, queue: "orders",
		k: &keyFlags{queue: "orders"}, admin: admin}
	action, _, why, err := r.record(ctx, "orders", deadLetter{Key: "k1"})
	if err != nil {
		t.Fatalf("record: %v, want the failed record decided on", err)
	}
	if got, want := action, "left"; got != want || !strings.Contains(why, "record failed") {
		t.Fatalf("record: got %q (%s), want %q (record failed)", got, why, want)
	}
}

// interruptedPublisher takes the copy, then the operator's Ctrl-C
// cancels the wait for its confirm: the copy may well be in the queue.
type interruptedPublisher struct {
	cancel context.CancelFunc
	sent   int
}

func (p *interruptedPublisher) publish(ctx context.Context, _, _ string, _ amqp.Publishing, _ time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err // not sent, as amqp091-go's publish with a done context
	}
	p.sent++
	p.cancel()
	return fmt.Errorf("no confirm: %w", ctx.Err())
}

func (p *interruptedPublisher) closed() bool  { return false }
func (p *interruptedPublisher) reopen() error { return nil }

// A copy whose confirm the operator stopped waiting for is reported as
// maybe published, not as staying in the dead-letter queue alone.
func TestReplayInterruptedBeforeConfirm(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	pub := &interruptedPublisher{cancel: cancel}
	r := &replayer{o: &options{timeout: time.Second}, queue: "orders", k: &keyFlags{queue: "orders"}, admin: s, pub: pub}
	d := amqp.Delivery{MessageId: "k1", Headers: amqp.Table{amqpidem.HeaderKey: "k1"}}
	_, _, _, err = r.one(ctx, &d, describe(1, &d, nil))
	if pub.sent != 1 || err == nil || !strings.Contains(err.Error(), "may have been published") {
		t.Fatalf("one: sent %d, error %v; want the copy sent once and said to be maybe published", pub.sent, err)
	}
	// Interrupted before the copy was sent, it was not.
	_, _, _, err = r.one(ctx, &d, describe(1, &d, nil))
	if pub.sent != 1 || err == nil || strings.Contains(err.Error(), "may have been published") {
		t.Fatalf("one after the interruption: sent %d, error %v; want nothing sent, and said so", pub.sent, err)
	}
}

// A dead letter whose copy would not fit in frame_max even without the
// replay's own header is left, before its record is touched; one that
// fits once that header is dropped goes without it.
func TestReplayCopyFitsFrameMax(t *testing.T) {
	d := &amqp.Delivery{MessageId: "m", Headers: amqp.Table{"pad": strings.Repeat("p", 5000)}}
	if why := tooLarge(d, 4096); !strings.Contains(why, "frame_max 4096") {
		t.Errorf("5000 bytes of headers, frame_max 4096: %q, want it left", why)
	}
	if why := tooLarge(d, 0); why != "" {
		t.Errorf("no frame_max: %q", why)
	}
	msg := replayCopy(d, 0)
	with := amqpidem.HeaderFrameSize(&msg)
	if _, ok := msg.Headers[headerReplayedAt]; !ok {
		t.Fatalf("no %s without a limit", headerReplayedAt)
	}
	msg = replayCopy(d, with-1)
	if _, ok := msg.Headers[headerReplayedAt]; ok || amqpidem.HeaderFrameSize(&msg) > with-1 {
		t.Errorf("at frame_max %d: %s kept, or still over", with-1, headerReplayedAt)
	}
	if why := tooLarge(d, with-1); why != "" {
		t.Errorf("fits without the header: %q", why)
	}
}

// unavailableAdmin answers every call as a store that cannot be reached,
// quoting the store key as lock's errors do.
type unavailableAdmin struct{ lock.Admin }

func (unavailableAdmin) Inspect(_ context.Context, key string) (lock.Record, error) {
	return lock.Record{}, fmt.Errorf("lock: inspect %q: %w", key, lock.ErrUnavailable)
}

// A store error during replay names the key and endpoint as the operator
// gave them, not the store key ("orders\x00k1") lock's errors quote.
func TestReplayStoreErrorNamesTheKey(t *testing.T) {
	r := &replayer{o: &options{timeout: time.Second, redisURL: "redis://127.0.0.1:6379/0"}, queue: "orders",
		k: &keyFlags{queue: "orders"}, admin: unavailableAdmin{}}
	_, _, _, err := r.record(context.Background(), "orders", deadLetter{Key: "k1"})
	if err == nil || strings.Contains(err.Error(), `\x00`) || !strings.Contains(err.Error(), `key "k1"`) || !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("record: %v; want ErrUnavailable naming key \"k1\", without the store key", err)
	}
}

// A dlq command names its queue once: an argument or --queue, not two
// different ones, not none; the mistakes are usage errors (exit 2) that
// say what to give, before any service is reached.
func TestDLQQueueNamedOnce(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"dlq", "list"}, "takes one QUEUE, as an argument or with --queue"},
		{[]string{"dlq", "replay", "--all"}, "takes one QUEUE, as an argument or with --queue"},
		{[]string{"dlq", "list", "orders", "--queue", "payments"}, `the QUEUE argument "orders" and --queue "payments" differ`},
		{[]string{"dlq", "replay", "orders", "-q", "payments", "--all"}, `the QUEUE argument "orders" and --queue "payments" differ`},
		{[]string{"dlq", "list", "orders", "payments"}, "takes one QUEUE"},
	} {
		_, errOut, code := runCLI(t, append(tc.args, "--amqp", "amqp://guest:guest@127.0.0.1:1/", "--timeout", "2s")...)
		if code != exitUsage || !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit %d saying %q", tc.args, code, errOut, exitUsage, tc.want)
		}
	}
}
