package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// TestBatchHandlerRedis: a batch consumer on a store that takes leases one
// by one (Redis) and a plain BatchHandler, whose records amqpidem
// completes after it returns. Every new message succeeds in exactly one
// batch and is acked once as completed; duplicates never reach the
// handler; a message failing its batch is split out and dead-lettered
// after its attempts, its neighbours completed on their first; a message
// answered Permanent is dead-lettered at once. A batch split by the
// poison is observed with its runs counted.
func TestBatchHandlerRedis(t *testing.T) {
	e := newEnv(t, nil)
	rec := &recorder{}
	var mu sync.Mutex
	done := map[string]int{} // successful executions per key
	sizes := map[int]int{}
	h := amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if d.MessageId == "poison" {
				return nil, errors.New("the batch broke")
			}
		}
		rs := make([]amqpidem.BatchResult, len(ds))
		mu.Lock()
		defer mu.Unlock()
		sizes[len(ds)]++
		for i, d := range ds {
			if d.MessageId == "declined" {
				rs[i].Err = amqpidem.Permanent(errors.New("declined"))
				continue
			}
			done[d.MessageId]++
			rs[i].Result = []byte("ok")
		}
		return rs, nil
	})
	obs := &batchObserver{}
	cfg := amqpidem.ConsumerConfig{
		URL: e.url, BatchSize: 10, BatchWait: 20 * time.Millisecond,
		Config: amqpidem.Config{
			Queue: e.queue, MaxAttempts: 3, Observer: amqpidem.Observers(rec, obs), Logger: slog.New(slog.DiscardHandler),
			Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
		},
	}
	c, err := amqpidem.NewBatchConsumer(e.store, cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	var keys []string
	for i := range 40 {
		keys = append(keys, fmt.Sprintf("b%02d", i))
	}
	keys = append(keys, "poison", "declined")
	for _, k := range keys {
		e.publish(amqp.Publishing{MessageId: k, Body: []byte(k)})
	}
	for _, k := range keys[:5] {
		e.publish(amqp.Publishing{MessageId: k, Body: []byte(k)}) // duplicates
	}
	rec.waitFor(t, 30*time.Second, "every message settled", func(evs []amqpidem.Event) bool {
		for _, k := range keys[:40] {
			if count(evs, k, amqpidem.Completed) != 1 {
				return false
			}
		}
		dups := 0
		for _, k := range keys[:5] {
			dups += count(evs, k, amqpidem.Duplicate)
		}
		return dups == 5 && count(evs, "poison", amqpidem.DeadLettered) == 1 && count(evs, "declined", amqpidem.DeadLettered) == 1
	})
	mu.Lock()
	defer mu.Unlock()
	for _, k := range keys[:40] {
		if done[k] != 1 {
			t.Errorf("%s succeeded in %d batches, want 1", k, done[k])
		}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, ev := range rec.events {
		if ev.Outcome == amqpidem.Completed && ev.Attempt != 1 {
			t.Errorf("%s completed at attempt %d, want 1 (a neighbour's failure is not its attempt)", ev.Key, ev.Attempt)
		}
		if ev.Key == "poison" && ev.Outcome == amqpidem.DeadLettered && ev.Attempt != 3 {
			t.Errorf("poison dead-lettered at attempt %d, want 3", ev.Attempt)
		}
	}
	big := 0
	for n := range sizes {
		big = max(big, n)
	}
	if big < 2 {
		t.Errorf("batch sizes %v: never more than one message", sizes)
	}
	// The poison message's batches were split: their runs are counted.
	obs.mu.Lock()
	defer obs.mu.Unlock()
	runs := 0
	for _, b := range obs.batches {
		runs = max(runs, b.Runs)
		if b.Runs < 1 {
			t.Errorf("batch observed with %d runs", b.Runs)
		}
	}
	if runs < 2 {
		t.Errorf("batches observed %+v: none ran more than once, want the poison's split counted", obs.batches)
	}
}

// TestBatchConsumerConfig: what NewBatchConsumer refuses.
func TestBatchConsumerConfig(t *testing.T) {
	store, _ := lock.NewMemoryStore(lock.Config{})
	other, _ := lock.NewMemoryStore(lock.Config{})
	base := amqpidem.ConsumerConfig{URL: "amqp://localhost/", Config: amqpidem.Config{Queue: "q"}}
	h := amqpidem.BatchHandlerFunc(func(context.Context, []*amqp.Delivery) ([]amqpidem.BatchResult, error) { return nil, nil })
	for _, c := range []struct {
		name  string
		store lock.Store
		tune  func(*amqpidem.ConsumerConfig)
		h     amqpidem.BatchHandler
	}{
		{"negative BatchSize", store, func(c *amqpidem.ConsumerConfig) { c.BatchSize = -1 }, h},
		{"negative BatchWait", store, func(c *amqpidem.ConsumerConfig) { c.BatchWait = -time.Second }, h},
		{"nil handler", store, nil, nil},
		{"completer of another store", store, nil, completerOf{h, other}},
	} {
		cfg := base
		if c.tune != nil {
			c.tune(&cfg)
		}
		if _, err := amqpidem.NewBatchConsumer(c.store, cfg, c.h); err == nil {
			t.Errorf("%s: accepted", c.name)
		}
	}
	if _, err := amqpidem.NewBatchConsumer(store, base, completerOf{h, store}); err != nil {
		t.Errorf("completer of its store: %v", err)
	}
}

// completerOf is a BatchCompleter of store that completes nothing.
type completerOf struct {
	amqpidem.BatchHandlerFunc
	store lock.Store
}

func (c completerOf) CompleterStore() lock.Store { return c.store }

func (c completerOf) HandleBatchComplete(context.Context, []amqpidem.BatchItem, func(int, []byte) ([]byte, error)) ([]amqpidem.BatchResult, error) {
	return nil, errors.New("not used")
}

// TestBatchShutdownForced: Shutdown whose deadline passes while a batch
// runs cancels the batch's context; Run returns once the handler did, its
// messages go back to the queue ("shutdown", leases released), and a new
// consumer runs each of them once.
func TestBatchShutdownForced(t *testing.T) {
	e := newEnv(t, nil)
	rec := &recorder{}
	started := make(chan int, 1)
	block := amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		select {
		case started <- len(ds):
		default:
		}
		<-ctx.Done()
		return nil, ctx.Err()
	})
	cfg := amqpidem.ConsumerConfig{
		URL: e.url, BatchSize: 5, BatchWait: 50 * time.Millisecond,
		Config: amqpidem.Config{Queue: e.queue, Observer: rec, Logger: slog.New(slog.DiscardHandler)},
	}
	c, err := amqpidem.NewBatchConsumer(e.store, cfg, block)
	if err != nil {
		t.Fatal(err)
	}
	keys := []string{"s0", "s1", "s2", "s3", "s4"}
	for _, k := range keys {
		e.publish(amqp.Publishing{MessageId: k, Body: []byte(k)})
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	select {
	case n := <-started:
		t.Logf("first batch of %d", n)
	case <-time.After(10 * time.Second):
		t.Fatal("no batch started")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := c.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown: %v, want the deadline passed", err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, amqpidem.ErrConsumerClosed) {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after a forced Shutdown")
	}
	rec.mu.Lock()
	for _, ev := range rec.events {
		if ev.Outcome != amqpidem.Abandoned {
			t.Errorf("%s: %v %q during the forced shutdown, want abandoned", ev.Key, ev.Outcome, ev.Reason)
		}
	}
	rec.mu.Unlock()

	var mu sync.Mutex
	runs := map[string]int{}
	rec2 := &recorder{}
	cfg.Observer = rec2
	c2, err := amqpidem.NewBatchConsumer(e.store, cfg, amqpidem.BatchHandlerFunc(func(_ context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		mu.Lock()
		defer mu.Unlock()
		for _, d := range ds {
			runs[d.MessageId]++
		}
		return nil, nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c2)
	rec2.waitFor(t, 20*time.Second, "every message completed by the second consumer", func(evs []amqpidem.Event) bool {
		for _, k := range keys {
			if count(evs, k, amqpidem.Completed) != 1 {
				return false
			}
		}
		return true
	})
	mu.Lock()
	defer mu.Unlock()
	for _, k := range keys {
		if runs[k] != 1 {
			t.Errorf("%s ran %d times after the shutdown, want 1", k, runs[k])
		}
	}
}
