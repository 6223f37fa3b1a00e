package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// TestBatchTxHandlerStage: a batch function stages one message per
// delivery through amqpidem.DeliveryContext, whose Info is that
// delivery's. One message fails once (the transaction rolls back and the
// rest run again: what the first run staged is dropped), another
// Permanently, and a poison message fails its batch (split, each run's
// staging dropped). Each completed message's staged message is stored in
// its record by the batch's commit and published exactly once, with the
// body staged by the run that committed; the failed ones publish nothing.
func TestBatchTxHandlerStage(t *testing.T) {
	r := newRig(t)
	next := r.queue + ".next"
	if _, err := r.ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = r.ch.QueueDelete(next, false, false, false) })
	var runs atomic.Int32
	var retried atomic.Int32
	var mu sync.Mutex
	infoErrs := []string{}
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		run := runs.Add(1)
		rs := make([]amqpidem.BatchResult, len(ds))
		for i, d := range ds {
			dctx := amqpidem.DeliveryContext(ctx, d)
			info, ok := amqpidem.FromContext(dctx)
			if !ok || info.Key != d.MessageId || info.Queue != r.queue || info.Fence == 0 || info.Attempt == 0 {
				mu.Lock()
				infoErrs = append(infoErrs, fmt.Sprintf("%s: FromContext: %+v %v", d.MessageId, info, ok))
				mu.Unlock()
			}
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
			body := fmt.Sprintf("%s run %d", d.MessageId, run)
			if err := amqpidem.Stage(dctx, "", next, amqp.Publishing{Body: []byte(body)}); err != nil {
				// A rerun without the failed messages stages afresh: it
				// must not find its outbox sealed by the run before.
				mu.Lock()
				infoErrs = append(infoErrs, fmt.Sprintf("%s: run %d: Stage: %v", d.MessageId, run, err))
				mu.Unlock()
				return nil, err
			}
			switch {
			case d.MessageId == "s009":
				return nil, errors.New("poison") // the batch's error
			case d.MessageId == "s003" && retried.Add(1) == 1:
				rs[i].Err = errors.New("try again")
			case d.MessageId == "s005":
				rs[i].Err = amqpidem.Permanent(errors.New("declined"))
			}
		}
		return rs, nil
	}), nil)
	if err := amqpidem.Stage(context.Background(), "", next, amqp.Publishing{}); !errors.Is(err, amqpidem.ErrNoOutbox) {
		t.Fatalf("Stage outside a handler: %v, want ErrNoOutbox", err)
	}
	ops := ids("s", 12)
	r.publish(ops...)
	evs := r.settled(ops, amqpidem.Completed, amqpidem.DeadLettered)
	mu.Lock()
	for _, e := range infoErrs {
		t.Error(e)
	}
	mu.Unlock()

	// What was published downstream, by the op its body names.
	published := map[string][]string{}
	for {
		m, ok, err := r.ch.Get(next, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		op, _, _ := strings.Cut(string(m.Body), " ")
		published[op] = append(published[op], string(m.Body))
	}
	failed := map[string]bool{"s005": true, "s009": true}
	for _, op := range ops {
		last := evs[op][len(evs[op])-1]
		if failed[op] {
			if len(published[op]) != 0 {
				t.Errorf("%s failed, published %q: want nothing", op, published[op])
			}
			continue
		}
		if got, want := last.Outbox, (amqpidem.OutboxCounts{Staged: 1, Published: 1}); got != want {
			t.Errorf("%s: outbox counts %+v, want %+v", op, got, want)
		}
		if len(published[op]) != 1 {
			t.Errorf("%s: published %q, want one message", op, published[op])
			continue
		}
		res, err := r.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(r.queue, op)})
		if err != nil || res.Status != lock.Completed {
			t.Fatalf("%s: %v %v", op, res.Status, err)
		}
		msgs, err := amqpidem.StoredOutbox(res.Value)
		if err != nil || len(msgs) != 1 || msgs[0].State != amqpidem.OutboxPublished || string(msgs[0].Msg.Body) != published[op][0] {
			t.Errorf("%s: record's outbox %+v %v, want the one published message %q, published", op, msgs, err, published[op][0])
		}
	}
	if got := r.effects(); got["s005"] != 0 || got["s009"] != 0 || got["s003"] != 1 {
		t.Errorf("effects %v: want none for s005 and s009, one for s003", got)
	}
	if retried.Load() < 2 {
		t.Fatalf("s003 ran %d times, want a retry", retried.Load())
	}
}
