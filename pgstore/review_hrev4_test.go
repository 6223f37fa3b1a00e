package pgstore_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
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

// TestHeldBatchCommitBeginRollbackBegin: the direct review tests of the
// record-row batch path (TestBatchTxHandlerCommitBeginThenMessageErrorDirect,
// TestBatchTxHandlerRollbackBeginThenNilNotAcked) on a held lease batch:
// a COMMIT then a BEGIN by the function, one message then failing, is not
// run again; a ROLLBACK then a BEGIN, then nil, is not acked as done (the
// commit guard, txGuardSQL, on finishHeldBatch).
func TestHeldBatchCommitBeginRollbackBegin(t *testing.T) {
	t.Run("commit, begin", func(t *testing.T) {
		r := newRig(t)
		runs := 0
		rs, err := r.batchAttemptOn(true, []string{"d0", "d1"}, commitBeginFailing(r, &runs, func(id string) bool { return id == "d0" }))
		if got := r.effects(); got["d1"] != 1 || runs != 1 {
			t.Errorf("d1: %d effect rows after %d runs (answer %v, %v); want 1 row, 1 run", got["d1"], runs, rs, err)
		}
		if len(rs) == 2 && (rs[0].Err == nil || !amqpidem.IsPermanent(rs[0].Err) || !errors.Is(rs[0].Err, pgstore.ErrTxEnded)) {
			t.Errorf("d0's error %v: want Permanent, wrapping ErrTxEnded", rs[0].Err)
		}
		r.idle()
	})
	t.Run("rollback, begin", func(t *testing.T) {
		r := newRig(t)
		rs, err := r.batchAttemptOn(true, []string{"rb0", "rb1"}, func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			for _, d := range ds {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
			}
			if _, err := tx.Conn().Exec(ctx, "ROLLBACK"); err != nil {
				return nil, err
			}
			_, err := tx.Conn().Exec(ctx, "BEGIN")
			return nil, err
		})
		for i, k := range []string{"rb0", "rb1"} {
			rec := r.record(k)
			merr := err
			if err == nil && len(rs) == 2 {
				merr = rs[i].Err
			}
			if !errors.Is(merr, pgstore.ErrTxEnded) || !amqpidem.IsPermanent(merr) || (rec != nil && rec.state == "c") || r.effects()[k] != 0 {
				t.Errorf("%s: error %v, record %+v, %d effect rows: want ErrTxEnded, Permanent, not completed", k, merr, rec, r.effects()[k])
			}
		}
		r.idle()
	})
}

// TestHeldBatchSessionKilled: the session holding a lease batch is
// terminated (pg_terminate_backend: a failover, an administrator) before
// the run, during the function, and at the COMMIT (a deferred trigger of
// the handler's table terminating its own backend). Nothing commits
// twice, nothing is acked uncommitted: the run answers an error
// (the store unavailable, or the lease lost), no effect row, no completed
// record; the leases end (Release) without error beyond lost; the pool
// gets its connections back with no lock; the keys can be taken again.
func TestHeldBatchSessionKilled(t *testing.T) {
	for _, when := range []string{"before the run", "during the function", "at the commit"} {
		t.Run(when, func(t *testing.T) {
			r := newRig(t)
			ctx := context.Background()
			kill := r.atCommit("kill", "PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5);")
			fn := func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				switch when {
				case "during the function":
					var pid int
					if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
						return nil, err
					}
					if _, err := r.pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
						return nil, err
					}
					time.Sleep(100 * time.Millisecond)
					return nil, nil // swallowing nothing: returns as if done
				case "at the commit":
					_, err := tx.Exec(ctx, "INSERT INTO "+kill+" VALUES ('x')")
					return nil, err
				}
				return nil, nil
			}
			bh := r.store.BatchTxHandler(fn).(amqpidem.BatchLeaseTaker)
			keys := []string{"k0", "k1"}
			reqs := []lock.Request{{Key: "k0", TTL: 5 * time.Second}, {Key: "k1", TTL: 5 * time.Second}}
			ds := []*amqp.Delivery{{MessageId: "k0"}, {MessageId: "k1"}}
			res, errs := bh.AcquireLeaseBatch(ctx, reqs, ds)
			items := make([]amqpidem.BatchItem, 2)
			for i := range res {
				if errs[i] != nil || res[i].Status != lock.Acquired || res[i].Lease.Owner[0] != 't' {
					t.Fatalf("AcquireLeaseBatch: %+v %v", res[i], errs[i])
				}
				items[i] = amqpidem.BatchItem{Delivery: ds[i], Lease: res[i].Lease}
			}
			if when == "before the run" {
				pid, _ := strconv.ParseUint(res[0].Lease.Owner[1:9], 16, 32)
				if _, err := r.pool.Exec(ctx, "SELECT pg_terminate_backend($1)", int(pid)); err != nil {
					t.Fatal(err)
				}
				time.Sleep(100 * time.Millisecond)
			}
			rs, err := bh.HandleBatchComplete(ctx, items, func(_ int, v []byte) ([]byte, error) { return v, nil })
			for i, k := range keys {
				merr := err
				if err == nil && rs != nil {
					merr = rs[i].Err
				}
				t.Logf("%s: %v", k, merr)
				if merr == nil {
					t.Errorf("%s: answered done though its session was terminated", k)
				}
				if rerr := r.store.Release(ctx, items[i].Lease); rerr != nil && !errors.Is(rerr, lock.ErrLeaseLost) {
					t.Errorf("%s: Release after %v: %v", k, merr, rerr)
				}
				if rec := r.record(k); rec != nil && rec.state == "c" {
					t.Errorf("%s: record completed though its session was terminated (error %v)", k, merr)
				}
				if n := r.effects()[k]; n != 0 {
					t.Errorf("%s: %d effect rows, want 0", k, n)
				}
			}
			r.idle()
			for _, k := range keys {
				if got, err := r.store.Acquire(ctx, lock.Request{Key: k, TTL: 5 * time.Second}); err != nil || got.Status != lock.Acquired {
					t.Errorf("Acquire %s afterwards: %v %v, want acquired", k, got.Status, err)
				}
			}
		})
	}
}

// TestHeldBatchSplitHalfIdledOut: one lease batch {a, b}, its run failing
// as a batch, so amqpidem splits it and runs [a], then [b], on the same
// session. a's run is legitimately long (busy in the database for longer
// than the TTL). b's lease waits meanwhile in the Store with its guard
// (a lease not ended within its TTL is ended: meant for a bug) running
// since the failed run put it back: it fires during a's run, and b is
// answered "the session holding the lease ended before the handler ran"
// though the session is alive and busy with a's half. (On record-row
// leases the heartbeat keeps b's lease, and b completes.)
func TestHeldBatchSplitHalfIdledOut(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	const ttl = time.Second
	fn := func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		if len(ds) > 1 {
			return nil, errors.New("a batch error: split me")
		}
		if ds[0].MessageId == "a" {
			if _, err := tx.Exec(ctx, "SELECT pg_sleep(1.6)"); err != nil {
				return nil, err
			}
		}
		return nil, r.insert(ctx, tx, ds[0].MessageId)
	}
	bh := r.store.BatchTxHandler(fn).(amqpidem.BatchLeaseTaker)
	rs, errs := bh.AcquireLeaseBatch(ctx, []lock.Request{{Key: "a", TTL: ttl}, {Key: "b", TTL: ttl}},
		[]*amqp.Delivery{{MessageId: "a"}, {MessageId: "b"}})
	items := make([]amqpidem.BatchItem, 2)
	for i := range rs {
		if errs[i] != nil || rs[i].Status != lock.Acquired || rs[i].Lease.Owner[0] != 't' {
			t.Fatalf("AcquireLeaseBatch: %+v %v", rs[i], errs[i])
		}
		items[i] = amqpidem.BatchItem{Delivery: &amqp.Delivery{MessageId: []string{"a", "b"}[i]}, Lease: rs[i].Lease}
	}
	out := r.settleAsConsumer(bh, items)
	if out["a"] != nil || out["b"] != nil {
		t.Errorf("settled with a: %v; b: %v; want both completed", out["a"], out["b"])
	}
	r.idle()
}
