package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// heldLease takes key's lease as a lease batch of its own (one
// AcquireLeaseBatch call: its own session), held.
func (r *rig) heldLease(bh amqpidem.BatchLeaseTaker, key string) lock.Lease {
	r.t.Helper()
	rs, errs := bh.AcquireLeaseBatch(context.Background(), []lock.Request{{Key: key, TTL: 5 * time.Second}}, []*amqp.Delivery{{MessageId: key}})
	if errs[0] != nil || rs[0].Status != lock.Acquired || rs[0].Lease.Owner[0] != 't' {
		r.t.Fatalf("AcquireLeaseBatch %s: %+v %v, want a held lease", key, rs[0], errs[0])
	}
	return rs[0].Lease
}

// settleAsConsumer does what amqpidem's runBatch and settleBatched do
// with a BatchCompleter's answer for items: a batch error splits the
// batch in halves, each run again (down to single messages, whose error
// is then their own); a message's own error is settled as its own: an
// attempt charged (Release here, as for a retryable error), Fail for a
// Permanent one. It returns, by key, the errors each message was
// settled with (nil: completed).
func (r *rig) settleAsConsumer(bh amqpidem.BatchCompleter, items []amqpidem.BatchItem) map[string]error {
	r.t.Helper()
	ctx := context.Background()
	out := map[string]error{}
	value := func(_ int, b []byte) ([]byte, error) { return b, nil }
	var run func(items []amqpidem.BatchItem)
	run = func(items []amqpidem.BatchItem) {
		rs, err := bh.HandleBatchComplete(ctx, items, value)
		if err != nil && len(items) > 1 && !errors.Is(err, lock.ErrUnavailable) {
			mid := len(items) / 2
			run(items[:mid])
			run(items[mid:])
			return
		}
		for i, it := range items {
			var merr error
			switch {
			case err != nil:
				merr = err
			case rs != nil:
				merr = rs[i].Err
			}
			out[it.Delivery.MessageId] = merr
			switch {
			case merr == nil:
			case amqpidem.IsPermanent(merr):
				_ = r.store.Fail(ctx, it.Lease, merr.Error())
			default:
				_ = r.store.Release(ctx, it.Lease)
			}
		}
	}
	run(items)
	return out
}

// TestHeldBatchPartsPoisonChargesNeighbours: a run batch holding two
// lease batches (common: two partial lease batches gathered into one run
// batch), the first {a}, the second {b, poison}. The function returns a
// batch error whenever the poison is in its batch, which is how a
// BatchTxFunc says "split me" (BatchHandler: "a poison message costs
// about log2(len(ds)) reruns of its neighbours, not their attempts").
// On record-row leases (one transaction) amqpidem splits and b
// completes. On held lease batches, part {a} commits first, and part
// {b, poison}'s batch error is then made each of its messages' own
// error: b, innocent, is charged the poison's attempt (retried, and
// dead-lettered after MaxAttempts) though its batch was never split.
func TestHeldBatchPartsPoisonChargesNeighbours(t *testing.T) {
	r := newRig(t)
	fn := func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if d.MessageId == "poison" {
				return nil, errors.New("poison in the batch")
			}
		}
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		return nil, nil
	}
	bh := r.store.BatchTxHandler(fn).(amqpidem.BatchLeaseTaker)
	a := r.heldLease(bh, "a")
	rs, errs := bh.AcquireLeaseBatch(context.Background(),
		[]lock.Request{{Key: "b", TTL: 5 * time.Second}, {Key: "poison", TTL: 5 * time.Second}},
		[]*amqp.Delivery{{MessageId: "b"}, {MessageId: "poison"}})
	for i := range rs {
		if errs[i] != nil || rs[i].Status != lock.Acquired {
			t.Fatalf("AcquireLeaseBatch: %+v %v", rs[i], errs[i])
		}
	}
	items := []amqpidem.BatchItem{
		{Delivery: &amqp.Delivery{MessageId: "a"}, Lease: a},
		{Delivery: &amqp.Delivery{MessageId: "b"}, Lease: rs[0].Lease},
		{Delivery: &amqp.Delivery{MessageId: "poison"}, Lease: rs[1].Lease},
	}
	out := r.settleAsConsumer(bh, items)
	if out["a"] != nil || out["b"] != nil || out["poison"] == nil {
		t.Errorf("settled with a: %v; b: %v; poison: %v; want a and b completed, the poison alone failed", out["a"], out["b"], out["poison"])
	}
	if rec := r.record("b"); rec == nil || rec.state != "c" {
		t.Errorf("b's record %+v: want completed (an innocent neighbour of a poison message)", rec)
	}
	r.idle()
}

// TestHeldBatchPartsCommittedWorkRerun: a run batch holding two lease
// batches {a} and {b}. The function commits a's work itself (Exec
// COMMIT) and then fails (the "Exec COMMIT, then a batch error" idiom:
// each message fails on its own, Permanent, never run again); b's part
// then fails as a batch (a transient error). The committed part answered
// only errors, so HandleBatchComplete counts nothing committed and
// returns b's batch error as the whole run's: amqpidem splits, and a's
// work commits a second time. (BatchCompleter: "a non-nil [batch error]
// means nothing was committed".)
func TestHeldBatchPartsCommittedWorkRerun(t *testing.T) {
	r := newRig(t)
	fn := func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		if ds[0].MessageId == "b" {
			return nil, errors.New("a transient failure of b's part")
		}
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		return nil, errors.New("failed after its own COMMIT")
	}
	bh := r.store.BatchTxHandler(fn).(amqpidem.BatchLeaseTaker)
	a, b := r.heldLease(bh, "a"), r.heldLease(bh, "b")
	items := []amqpidem.BatchItem{
		{Delivery: &amqp.Delivery{MessageId: "a"}, Lease: a},
		{Delivery: &amqp.Delivery{MessageId: "b"}, Lease: b},
	}
	// As amqpidem does: a batch error is split, each half run again.
	out := r.settleAsConsumer(bh, items)
	if n := r.effects()["a"]; n != 1 {
		t.Errorf("a: %d effect rows, want 1 (settled with a: %v; b: %v)", n, out["a"], out["b"])
	}
	r.idle()
}
