package amqpidem_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// answerLost is a RedisStore whose CompleteBatch lands but whose answers
// are lost (a connection dropped after Redis ran the pipeline).
type answerLost struct{ *lock.RedisStore }

func (s answerLost) CompleteBatch(ctx context.Context, leases []lock.Lease, results [][]byte) []error {
	errs := s.RedisStore.CompleteBatch(ctx, leases, results)
	for i := range errs {
		errs[i] = fmt.Errorf("%w: the answer was lost", lock.ErrUnavailable)
	}
	return errs
}

// TestBatchCompleteAnswerLostStaged: a plain BatchHandler on a
// lock.BatchCompleter whose CompleteBatch landed with its answers lost.
// Each message staged one message (DeliveryContext, Stage). amqpidem
// completes each record again alone (completeBatch: "a record it could
// not answer for ... is completed alone, with the retries of a single
// message"), but with a value made anew, whose outbox claim differs from
// the one stored: the record keeps the first. Its staged message is then
// published, its being marked published refused (the stored value is not
// the one amqpidem holds: "outbox changed"), and the delivery requeued;
// the copy finds the message still pending under the first claim, waits
// for it to pass, and publishes it again. Each message should be
// completed on its first delivery with its staged message published
// once, as a single message's Complete retries with the same value.
func TestBatchCompleteAnswerLostStaged(t *testing.T) {
	e := newEnv(t, nil)
	receipts := e.queue + "-receipts"
	if _, err := e.ch.QueueDeclare(receipts, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(receipts, false, false, false) })
	rec := &recorder{}
	h := amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if err := amqpidem.Stage(amqpidem.DeliveryContext(ctx, d), "", receipts, amqp.Publishing{Body: []byte(d.MessageId)}); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	c, err := amqpidem.NewBatchConsumer(answerLost{e.store}, amqpidem.ConsumerConfig{
		URL: e.url, BatchSize: 3, BatchWait: 200 * time.Millisecond,
		Config: amqpidem.Config{
			Queue: e.queue, LeaseTTL: 2 * time.Second, Observer: rec, Logger: slog.New(slog.DiscardHandler),
			Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
		},
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	keys := []string{"r0", "r1", "r2"}
	for _, k := range keys {
		e.publish(amqp.Publishing{MessageId: k, Body: []byte(k)})
	}
	rec.waitFor(t, 30*time.Second, "every message acked", func(evs []amqpidem.Event) bool {
		for _, k := range keys {
			if count(evs, k, amqpidem.Completed)+count(evs, k, amqpidem.Duplicate) == 0 {
				return false
			}
		}
		return true
	})
	time.Sleep(500 * time.Millisecond)
	got := map[string]int{}
	for {
		m, ok, err := e.ch.Get(receipts, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		got[string(m.Body)]++
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, k := range keys {
		var outs []string
		for _, ev := range rec.events {
			if ev.Key == k {
				outs = append(outs, fmt.Sprintf("%s %q", ev.Outcome, ev.Reason))
			}
		}
		if got[k] != 1 || len(outs) != 1 {
			t.Errorf("%s: staged message published %d times, events %v; want once, completed on its first delivery", k, got[k], outs)
		}
	}
}
