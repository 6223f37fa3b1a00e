package amqpidem_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// storeTrips counts a RedisStore's round trips by kind: pipelines that
// take leases (a native Acquire's MULTI ... EXEC) and those that run
// scripts (complete, extend, release; the acquire script after a native
// one).
type storeTrips struct{ acquire, script, other atomic.Int64 }

func (h *storeTrips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *storeTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		switch cmd.Name() {
		case "hello", "client", "info", "ping", "script", "config": // a dial, Check, INFO once
		default:
			h.other.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (h *storeTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		switch cmds[0].Name() {
		case "multi":
			h.acquire.Add(1)
		case "evalsha":
			h.script.Add(1)
		}
		return next(ctx, cmds)
	}
}

// batchCalls is a RedisStore that counts its batch calls.
type batchCalls struct {
	*lock.RedisStore
	acquires, completes atomic.Int64
}

func (s *batchCalls) AcquireBatch(ctx context.Context, reqs []lock.Request) ([]lock.Result, []error) {
	s.acquires.Add(1)
	return s.RedisStore.AcquireBatch(ctx, reqs)
}

func (s *batchCalls) CompleteBatch(ctx context.Context, leases []lock.Lease, results [][]byte) []error {
	s.completes.Add(1)
	return s.RedisStore.CompleteBatch(ctx, leases, results)
}

// batchObserver keeps the batches it is told of.
type batchObserver struct {
	mu      sync.Mutex
	batches []amqpidem.BatchInfo
}

func (o *batchObserver) Observe(context.Context, amqpidem.Event) {}

func (o *batchObserver) ObserveBatch(_ context.Context, b amqpidem.BatchInfo) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.batches = append(o.batches, b)
}

// TestBatchRedisRoundTrips: a batch consumer on Redis takes a batch's
// leases in one AcquireBatch, one round trip (the keys are new), and
// completes its records in one CompleteBatch, one round trip, counted
// exactly by a go-redis hook; each message once. Each batch is told to a
// BatchObserver (through Observers) and logged once at debug.
func TestBatchRedisRoundTrips(t *testing.T) {
	e := newEnv(t, nil)
	client := testenv.RedisClient(t)
	var trips storeTrips
	client.AddHook(&trips)
	rs, err := lock.NewRedisStore(client, lock.Config{Prefix: e.queue})
	if err != nil {
		t.Fatal(err)
	}
	store := &batchCalls{RedisStore: rs}
	rec := &recorder{}
	var mu sync.Mutex
	runs := map[string]int{}
	var batches atomic.Int64
	h := amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		batches.Add(1)
		mu.Lock()
		defer mu.Unlock()
		for _, d := range ds {
			runs[d.MessageId]++
		}
		return nil, nil
	})
	const n = 100
	for i := range n {
		e.publish(amqp.Publishing{MessageId: fmt.Sprintf("m%03d", i), Body: []byte("x")})
	}
	obs := &batchObserver{}
	logs := &lockedBuffer{}
	c, err := amqpidem.NewBatchConsumer(store, amqpidem.ConsumerConfig{
		URL: e.url, BatchSize: n, BatchWait: time.Second,
		Config: amqpidem.Config{Queue: e.queue, LeaseTTL: time.Minute, Observer: amqpidem.Observers(rec, obs),
			Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))},
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	rec.waitFor(t, 30*time.Second, "every message completed", func(evs []amqpidem.Event) bool {
		for i := range n {
			if count(evs, fmt.Sprintf("m%03d", i), amqpidem.Completed) != 1 {
				return false
			}
		}
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	for i := range n {
		if k := fmt.Sprintf("m%03d", i); runs[k] != 1 {
			t.Errorf("%s ran %d times, want 1", k, runs[k])
		}
	}
	acq, comp := store.acquires.Load(), store.completes.Load()
	t.Logf("%d messages: %d lease batches in %d round trips, %d handler batches, records completed in %d calls, %d round trips, %d other commands",
		n, acq, trips.acquire.Load(), batches.Load(), comp, trips.script.Load(), trips.other.Load())
	if acq == 0 || comp == 0 {
		t.Fatalf("AcquireBatch called %d times, CompleteBatch %d: want both used", acq, comp)
	}
	if got, want := trips.acquire.Load(), acq; got != want {
		t.Errorf("lease round trips: got %d, want one per AcquireBatch (%d)", got, want)
	}
	if got, want := comp, batches.Load(); got != want {
		t.Errorf("CompleteBatch calls: got %d, want one per handler batch (%d)", got, want)
	}
	if got, want := trips.script.Load(), comp; got != want {
		t.Errorf("script round trips: got %d, want one per CompleteBatch (%d)", got, want)
	}
	if got := trips.other.Load(); got != 0 {
		t.Errorf("commands sent alone: got %d, want 0", got)
	}

	obs.mu.Lock()
	defer obs.mu.Unlock()
	size := 0
	for _, b := range obs.batches {
		size += b.Size
		if b.Queue != e.queue || b.Runs != 1 || b.Duration <= 0 {
			t.Errorf("batch observed: got %+v, want queue %s, 1 run, a duration", b, e.queue)
		}
	}
	if got, want := int64(len(obs.batches)), batches.Load(); got != want {
		t.Errorf("batches observed: got %d, want %d", got, want)
	}
	if size != n {
		t.Errorf("sizes observed add up to %d, want %d", size, n)
	}
	if got, want := int64(strings.Count(logs.String(), `msg="amqpidem: batch ran"`)), batches.Load(); got != want {
		t.Errorf("debug lines for batches: got %d, want %d", got, want)
	}
}

// stealOne is a RedisStore whose CompleteBatch finds the lease of key
// (its store key ends with key) taken over (the store answers lock.ErrLeaseLost for it, writing
// nothing) and completes the others.
type stealOne struct {
	*lock.RedisStore
	key    string
	stolen atomic.Bool
}

func (s *stealOne) CompleteBatch(ctx context.Context, leases []lock.Lease, results [][]byte) []error {
	for i, l := range leases {
		if strings.HasSuffix(l.Key, s.key) && s.stolen.CompareAndSwap(false, true) {
			leases, results = append(leases[:i:i], leases[i+1:]...), append(results[:i:i], results[i+1:]...)
			errs := s.RedisStore.CompleteBatch(ctx, leases, results)
			return append(errs[:i:i], append([]error{fmt.Errorf("%w: complete key %q", lock.ErrLeaseLost, l.Key)}, errs[i:]...)...)
		}
	}
	return s.RedisStore.CompleteBatch(ctx, leases, results)
}

// TestBatchCompleteLeaseLost: a record CompleteBatch finds taken over is
// not acked as completed: its message goes back ("lease lost") and runs
// again once the lease has expired; its batch-mates are completed once.
func TestBatchCompleteLeaseLost(t *testing.T) {
	e := newEnv(t, nil)
	store := &stealOne{RedisStore: e.store, key: "k2"}
	rec := &recorder{}
	var mu sync.Mutex
	runs := map[string]int{}
	h := amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		mu.Lock()
		defer mu.Unlock()
		for _, d := range ds {
			runs[d.MessageId]++
		}
		return nil, nil
	})
	keys := []string{"k0", "k1", "k2", "k3"}
	for _, k := range keys {
		e.publish(amqp.Publishing{MessageId: k, Body: []byte(k)})
	}
	c, err := amqpidem.NewBatchConsumer(store, amqpidem.ConsumerConfig{
		URL: e.url, BatchSize: len(keys), BatchWait: time.Second,
		Config: amqpidem.Config{Queue: e.queue, LeaseTTL: time.Second, Observer: rec, Logger: slog.New(slog.DiscardHandler)},
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	rec.waitFor(t, 30*time.Second, "every message completed", func(evs []amqpidem.Event) bool {
		for _, k := range keys {
			if count(evs, k, amqpidem.Completed) != 1 {
				return false
			}
		}
		return true
	})
	rec.mu.Lock()
	var first *amqpidem.Event
	for i, ev := range rec.events {
		if ev.Key == "k2" {
			first = &rec.events[i]
			break
		}
	}
	rec.mu.Unlock()
	if first == nil || first.Outcome != amqpidem.Abandoned || first.Reason != "lease lost" {
		t.Fatalf("k2's first event: got %+v, want abandoned, lease lost", first)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, k := range keys {
		want := 1
		if k == "k2" {
			want = 2
		}
		if runs[k] != want {
			t.Errorf("%s ran %d times, want %d", k, runs[k], want)
		}
	}
}
