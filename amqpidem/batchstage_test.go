package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// TestBatchStageRedis: a plain batch handler on Redis stages one message
// per delivery through DeliveryContext, whose FromContext is that
// delivery's; a message answered with an error stages nothing that is
// published, a poison message (the batch's error, split down to it)
// neither. Each completed message's staged message is stored in its
// record by CompleteBatch, published once and marked published there;
// the batch's own ctx stages nothing.
func TestBatchStageRedis(t *testing.T) {
	e := newEnv(t, nil)
	next := e.queue + ".next"
	if _, err := e.ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(next, false, false, false) })
	rec := &recorder{}
	var mu sync.Mutex
	var problems []string
	tries := map[string]int{}
	h := amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		mu.Lock()
		defer mu.Unlock()
		if err := amqpidem.Stage(ctx, "", next, amqp.Publishing{}); !errors.Is(err, amqpidem.ErrNoOutbox) {
			problems = append(problems, fmt.Sprintf("Stage on the batch's ctx: %v, want ErrNoOutbox", err))
		}
		rs := make([]amqpidem.BatchResult, len(ds))
		for i, d := range ds {
			dctx := amqpidem.DeliveryContext(ctx, d)
			if info, ok := amqpidem.FromContext(dctx); !ok || info.Key != d.MessageId || info.Fence == 0 {
				problems = append(problems, fmt.Sprintf("%s: FromContext %+v %v", d.MessageId, info, ok))
			}
			tries[d.MessageId]++
			if err := amqpidem.Stage(dctx, "", next, amqp.Publishing{Body: []byte(fmt.Sprintf("%s %d", d.MessageId, tries[d.MessageId]))}); err != nil {
				problems = append(problems, fmt.Sprintf("%s: Stage: %v", d.MessageId, err))
			}
			switch d.MessageId {
			case "k5":
				return nil, errors.New("poison")
			case "k2":
				rs[i].Err = amqpidem.Permanent(errors.New("declined"))
			}
			rs[i].Result = []byte("ok")
		}
		return rs, nil
	})
	keys := []string{"k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7"}
	for _, k := range keys {
		e.publish(amqp.Publishing{MessageId: k, Body: []byte(k)})
	}
	c, err := amqpidem.NewBatchConsumer(e.store, amqpidem.ConsumerConfig{
		URL: e.url, BatchSize: len(keys), BatchWait: time.Second,
		Config: amqpidem.Config{Queue: e.queue, LeaseTTL: 5 * time.Second, MaxAttempts: 1, Observer: rec, Logger: slog.New(slog.DiscardHandler)},
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	rec.waitFor(t, 30*time.Second, "every message settled", func(evs []amqpidem.Event) bool {
		for _, k := range keys {
			if count(evs, k, amqpidem.Completed)+count(evs, k, amqpidem.DeadLettered) != 1 {
				return false
			}
		}
		return true
	})
	published := map[string]int{}
	for {
		m, ok := e.get(next, 200*time.Millisecond)
		if !ok {
			break
		}
		published[string(m.Body)]++
	}
	mu.Lock()
	defer mu.Unlock()
	for _, p := range problems {
		t.Error(p)
	}
	for _, k := range keys {
		body := fmt.Sprintf("%s %d", k, tries[k])
		res, err := e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, k), TTL: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if k == "k2" || k == "k5" {
			if res.Status != lock.Failed || published[body] != 0 {
				t.Errorf("%s: record %v, its message published %d times: want failed, none", k, res.Status, published[body])
			}
			continue
		}
		if published[body] != 1 {
			t.Errorf("%s: %q published %d times, want 1 (published: %v)", k, body, published[body], published)
		}
		msgs, err := amqpidem.StoredOutbox(res.Value)
		if res.Status != lock.Completed || err != nil || len(msgs) != 1 || string(msgs[0].Msg.Body) != body || msgs[0].State != amqpidem.OutboxPublished {
			t.Errorf("%s: record %v, outbox %+v %v: want completed with %q published", k, res.Status, msgs, err, body)
		}
	}
	if n := len(published); n != len(keys)-2 {
		t.Errorf("%d distinct messages published, want %d: %v", n, len(keys)-2, published)
	}
}
