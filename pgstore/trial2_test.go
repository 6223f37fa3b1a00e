package pgstore_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// TestTrial2SplitCommittedHalfWaits: a BatchTxHandler batch with one
// poison message (a batch error) is split; the half without it commits
// its effects, records and staged messages, but its messages are neither
// published nor acked until the whole split is over. When the reruns of
// the other half take longer than a lease TTL (a handler of 1.2 s, a
// lease of 2 s), the committed messages' outbox claim passes: each is
// requeued ("outbox claim passed", Abandoned) and its copy publishes.
// Nobody paused, no lease was taken over: a committed message is
// settled as Completed once, as its part of the batch commits.
func TestTrial2SplitCommittedHalfWaits(t *testing.T) {
	evs, _ := runSplitBatch(t, 1200*time.Millisecond)
	for _, op := range ids("p", 8)[1:] {
		if o := outcomes(evs[op]); len(evs[op]) != 1 || evs[op][0].Outcome != amqpidem.Completed {
			t.Errorf("%s: events %s; want one, completed (its work committed, nobody paused)", op, o)
		}
	}
}

// TestTrial2SplitCommittedNoLeaseWarning: the part of the above that
// shows as soon as the split's remaining runs take longer than a
// heartbeat interval (a third of the lease TTL), well before the claim
// passes: the heartbeat renews the leases of messages whose records the
// batch's commit completed, is refused, and warns "lease cannot be kept,
// cancelling handler" about work that committed, at 3 a.m.
func TestTrial2SplitCommittedNoLeaseWarning(t *testing.T) {
	_, logs := runSplitBatch(t, 700*time.Millisecond)
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, "level=WARN") && !strings.Contains(line, "p000") {
			t.Errorf("warning about a committed message: %s", line)
		}
	}
}

// runSplitBatch runs 8 messages, p000 a poison message failing its
// batch, through a BatchTxHandler whose runs take d, and returns their
// events and the consumer's log.
func runSplitBatch(t *testing.T, d time.Duration) (map[string][]amqpidem.Event, string) {
	r := newRig(t)
	next := r.queue + ".next"
	if _, err := r.ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = r.ch.QueueDelete(next, false, false, false) })
	logs := &testenv.SyncBuffer{}
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		defer tx.Rollback(ctx)
		for _, d := range ds {
			if d.MessageId == "p000" {
				return nil, errors.New("poison")
			}
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
			if err := amqpidem.Stage(amqpidem.DeliveryContext(ctx, d), "", next, amqp.Publishing{Body: []byte(d.MessageId)}); err != nil {
				return nil, err
			}
		}
		select { // a handler that takes its time
		case <-time.After(d):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return nil, tx.Commit(ctx)
	}), func(c *amqpidem.ConsumerConfig) {
		c.BatchSize = 8
		c.BatchWait = 300 * time.Millisecond
		c.MaxAttempts = 1
		c.Logger = slog.New(slog.NewTextHandler(logs, nil))
	})
	ops := ids("p", 8)
	r.publish(ops...)
	evs := r.settled(ops, amqpidem.Completed, amqpidem.Duplicate, amqpidem.DeadLettered)
	if got := r.effects(); len(got) != 7 {
		t.Errorf("effects %v, want one for each of the 7 good ops", got)
	}
	return evs, logs.String()
}
