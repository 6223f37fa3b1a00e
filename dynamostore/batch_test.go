package dynamostore_test

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
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
)

// TestBatchTxHandler runs a batch consumer with a BatchTxHandler whose
// effect per message is two counter writes: a batch of 40 (120 items
// with its records) does not fit in one TransactWriteItems and is split
// until its halves fit; every message's counters end at 1, copies of
// messages are duplicates that run nothing, and a message answered
// Permanent is dead-lettered with nothing written.
func TestBatchTxHandler(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, prefix := srv.effects(t), testenv.Name(t)
		queue := testenv.Name(t)
		ch := testenv.QueueChannel(t, queue)
		var mu sync.Mutex
		var events []amqpidem.Event
		tooLarge := 0
		h := s.BatchTxHandler(func(ctx context.Context, tx *dynamostore.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			rs := make([]amqpidem.BatchResult, len(ds))
			for i, d := range ds {
				// Written before the call that declines it, as users
				// write handlers: the declined message's writes must
				// never be sent.
				bump(tx, table, prefix+"-"+d.MessageId)
				bump(tx, table, prefix+"-"+d.MessageId+"-twin")
				if d.MessageId == "declined" {
					rs[i].Err = amqpidem.Permanent(errors.New("declined"))
				}
			}
			if 3*len(ds) > dynamostore.MaxTxItems {
				mu.Lock()
				tooLarge++
				mu.Unlock()
			}
			return rs, nil
		})
		c, err := amqpidem.NewBatchConsumer(s, amqpidem.ConsumerConfig{
			URL: testenv.AMQPURL(t), BatchSize: 40, BatchWait: 200 * time.Millisecond,
			Config: amqpidem.Config{
				Queue: queue, LeaseTTL: 5 * time.Second, UnavailableDelay: 100 * time.Millisecond,
				Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
				Logger:  slog.New(slog.DiscardHandler),
				Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) {
					mu.Lock()
					events = append(events, e)
					mu.Unlock()
				}),
			},
		}, h)
		if err != nil {
			t.Fatal(err)
		}
		testrun.Consumer(t, c)
		var ids []string
		for i := range 40 {
			ids = append(ids, fmt.Sprintf("d%02d", i))
		}
		publish := func(ids ...string) {
			for _, id := range ids {
				if err := ch.PublishWithContext(context.Background(), "", queue, false, false,
					amqp.Publishing{MessageId: id, DeliveryMode: amqp.Persistent, Body: []byte(id)}); err != nil {
					t.Fatal(err)
				}
			}
		}
		publish(append(ids, "declined")...)
		outcomes := func() map[string][]amqpidem.Outcome {
			mu.Lock()
			defer mu.Unlock()
			m := map[string][]amqpidem.Outcome{}
			for _, e := range events {
				m[e.Key] = append(m[e.Key], e.Outcome)
			}
			return m
		}
		waitUntil := func(what string, ok func(map[string][]amqpidem.Outcome) bool) {
			deadline := time.Now().Add(30 * time.Second)
			for !ok(outcomes()) {
				if time.Now().After(deadline) {
					t.Fatalf("%s: not in 30s: %v", what, outcomes())
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
		waitUntil("every message settled", func(m map[string][]amqpidem.Outcome) bool {
			for _, id := range ids {
				if len(m[id]) == 0 {
					return false
				}
			}
			return len(m["declined"]) > 0
		})
		publish(ids[:5]...)
		waitUntil("the copies acked as duplicates", func(m map[string][]amqpidem.Outcome) bool {
			for _, id := range ids[:5] {
				if len(m[id]) < 2 {
					return false
				}
			}
			return true
		})
		m := outcomes()
		for _, id := range ids {
			want := []amqpidem.Outcome{amqpidem.Completed}
			if id < "d05" {
				want = append(want, amqpidem.Duplicate)
			}
			if fmt.Sprint(m[id]) != fmt.Sprint(want) {
				t.Errorf("%s: %v, want %v", id, m[id], want)
			}
			if n, twin := srv.count(t, prefix+"-"+id), srv.count(t, prefix+"-"+id+"-twin"); n != 1 || twin != 1 {
				t.Errorf("%s: counters %d and %d, want 1 and 1", id, n, twin)
			}
		}
		if fmt.Sprint(m["declined"]) != fmt.Sprint([]amqpidem.Outcome{amqpidem.DeadLettered}) || srv.count(t, prefix+"-declined") != 0 {
			t.Errorf("declined: %v, counter %d; want dead-lettered, 0", m["declined"], srv.count(t, prefix+"-declined"))
		}
		mu.Lock()
		t.Logf("%d batches too large to commit, split", tooLarge)
		mu.Unlock()
	})
}
