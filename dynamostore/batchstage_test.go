package dynamostore_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
)

// TestBatchTxHandlerStageRerun: a batch function stages one message per
// delivery through amqpidem.DeliveryContext; one message fails once, so
// the BatchTxHandler runs the function again without it. That rerun
// stages afresh (its outboxes were discarded, not sealed by the run
// before): no Stage fails, and every message's staged message is
// published once, the retried one's too, after its own run.
func TestBatchTxHandlerStageRerun(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, prefix := srv.effects(t), testenv.Name(t)
		queue := testenv.Name(t)
		next := queue + ".next"
		ch := testenv.QueueChannel(t, queue)
		if _, err := ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = ch.QueueDelete(next, false, false, false) })
		var mu sync.Mutex
		var stageErrs []string
		var retried atomic.Int32
		settled := map[string]amqpidem.Outcome{}
		h := s.BatchTxHandler(func(ctx context.Context, tx *dynamostore.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			rs := make([]amqpidem.BatchResult, len(ds))
			for i, d := range ds {
				bump(tx, table, prefix+"-"+d.MessageId)
				if err := amqpidem.Stage(amqpidem.DeliveryContext(ctx, d), "", next, amqp.Publishing{Body: []byte(d.MessageId)}); err != nil {
					mu.Lock()
					stageErrs = append(stageErrs, fmt.Sprintf("%s: %v", d.MessageId, err))
					mu.Unlock()
					return nil, err
				}
				if d.MessageId == "m3" && retried.Add(1) == 1 {
					rs[i].Err = errors.New("try again")
				}
			}
			return rs, nil
		})
		c, err := amqpidem.NewBatchConsumer(s, amqpidem.ConsumerConfig{
			URL: testenv.AMQPURL(t), BatchSize: 6, BatchWait: 300 * time.Millisecond,
			Config: amqpidem.Config{
				Queue: queue, LeaseTTL: 5 * time.Second, UnavailableDelay: 100 * time.Millisecond,
				Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
				Logger:  slog.New(slog.DiscardHandler),
				Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) {
					mu.Lock()
					settled[e.Key] = e.Outcome
					mu.Unlock()
				}),
			},
		}, h)
		if err != nil {
			t.Fatal(err)
		}
		testrun.Consumer(t, c)
		ids := []string{"m0", "m1", "m2", "m3", "m4", "m5"}
		for _, id := range ids {
			if err := ch.PublishWithContext(context.Background(), "", queue, false, false,
				amqp.Publishing{MessageId: id, DeliveryMode: amqp.Persistent}); err != nil {
				t.Fatal(err)
			}
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			mu.Lock()
			done := 0
			for _, id := range ids {
				if settled[id] == amqpidem.Completed {
					done++
				}
			}
			mu.Unlock()
			if done == len(ids) {
				break
			}
			if time.Now().After(deadline) {
				mu.Lock()
				t.Fatalf("not every message completed in 30s: %v (Stage errors: %v)", settled, stageErrs)
			}
			time.Sleep(20 * time.Millisecond)
		}
		mu.Lock()
		for _, e := range stageErrs {
			t.Errorf("Stage in a rerun: %s", e)
		}
		mu.Unlock()
		published := map[string]int{}
		for {
			m, ok, err := ch.Get(next, true)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				break
			}
			published[string(m.Body)]++
		}
		for _, id := range ids {
			if published[id] != 1 {
				t.Errorf("%s: published %d times, want once (%v)", id, published[id], published)
			}
			if n := srv.count(t, prefix+"-"+id); n != 1 {
				t.Errorf("%s: counter %d, want 1", id, n)
			}
		}
		if retried.Load() < 2 {
			t.Errorf("m3 ran %d times, want a retry", retried.Load())
		}
	})
}
