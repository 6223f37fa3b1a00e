package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// batchKeys are the messages of the idiom suite's batch.
var batchKeys = []string{"op0", "op1"}

// batchAttempt runs fn once on a batch of keys as amqpidem runs a
// BatchTxHandler: a record-row lease per key, one HandleBatchComplete,
// then, for each message it did not complete, Fail for a Permanent error
// (its own, or the batch's: amqpidem splits a batch down to single
// messages, whose error is then their own) and Release for another. It
// returns HandleBatchComplete's answer.
func (r *rig) batchAttempt(keys []string, fn pgstore.BatchTxFunc) ([]amqpidem.BatchResult, error) {
	r.t.Helper()
	return r.batchAttemptOn(false, keys, fn)
}

// batchAttemptOn is batchAttempt with, when held is true, the leases
// taken as a batch consumer takes them from a BatchLeaseTaker: one
// AcquireLeaseBatch call, held by the session of one pooled connection.
func (r *rig) batchAttemptOn(held bool, keys []string, fn pgstore.BatchTxFunc) ([]amqpidem.BatchResult, error) {
	r.t.Helper()
	ctx := context.Background()
	h := r.store.BatchTxHandler(fn).(amqpidem.BatchCompleter)
	items := make([]amqpidem.BatchItem, len(keys))
	if held {
		reqs := make([]lock.Request, len(keys))
		ds := make([]*amqp.Delivery, len(keys))
		for i, k := range keys {
			reqs[i], ds[i] = lock.Request{Key: k, TTL: 5 * time.Second}, &amqp.Delivery{MessageId: k}
		}
		rs, errs := h.(amqpidem.BatchLeaseTaker).AcquireLeaseBatch(ctx, reqs, ds)
		for i, k := range keys {
			if errs[i] != nil || rs[i].Status != lock.Acquired || rs[i].Lease.Owner[0] != 't' {
				r.t.Fatalf("AcquireLeaseBatch %s: %+v, %v (want a held lease)", k, rs[i], errs[i])
			}
			items[i] = amqpidem.BatchItem{Delivery: ds[i], Lease: rs[i].Lease}
		}
	}
	for i, k := range keys {
		if held {
			break
		}
		res, err := r.store.Acquire(ctx, lock.Request{Key: k, TTL: 5 * time.Second})
		if err != nil || res.Status != lock.Acquired {
			r.t.Fatalf("Acquire %s: %+v, %v", k, res, err)
		}
		items[i] = amqpidem.BatchItem{Delivery: &amqp.Delivery{MessageId: k}, Lease: res.Lease}
	}
	var rs []amqpidem.BatchResult
	err := func() (err error) {
		defer func() {
			if p := recover(); p != nil { // amqpidem recovers a handler's panic
				err = fmt.Errorf("panic: %v", p)
			}
		}()
		rs, err = h.HandleBatchComplete(ctx, items, func(_ int, b []byte) ([]byte, error) { return b, nil })
		return err
	}()
	for i, it := range items {
		var merr error
		switch {
		case err != nil:
			merr = err
		case rs != nil:
			merr = rs[i].Err
		}
		switch {
		case merr == nil:
		case amqpidem.IsPermanent(merr):
			if ferr := r.store.Fail(ctx, it.Lease, merr.Error()); ferr != nil {
				r.t.Fatalf("Fail %s after %v: %v", it.Lease.Key, merr, ferr)
			}
		default:
			if rerr := r.store.Release(ctx, it.Lease); rerr != nil {
				r.t.Fatalf("Release %s after %v: %v", it.Lease.Key, merr, rerr)
			}
		}
	}
	return rs, err
}

// TestBatchTxHandlerIdioms: the pgx idioms users write out of habit, in a
// batch function, never ack a message without its effect nor commit an
// effect twice: a deferred Rollback after Commit is harmless, Commit keeps
// the work for the batch's own commit, a transaction the function ended
// itself is completed only if its work committed and is then never run
// again (a batch error after it would be split, and its halves run
// again: so each message fails on its own, Permanent), work rolled back
// then reported as done fails loudly, an aborted transaction neither
// completes nor loses its outcome, and the savepoint-per-message idiom
// commits the good messages only.
func TestBatchTxHandlerIdioms(t *testing.T) {
	errBad := errors.New("the card was declined")
	none := func(err error) bool { return err == nil }
	permanent := func(target error) func(error) bool {
		return func(err error) bool { return amqpidem.IsPermanent(err) && errors.Is(err, target) }
	}
	retryable := func(target error) func(error) bool {
		return func(err error) bool { return err != nil && !amqpidem.IsPermanent(err) && errors.Is(err, target) }
	}
	type want struct {
		batchErr func(error) bool // HandleBatchComplete's error
		// itemErr checks each message's BatchResult.Err, when the batch
		// error is nil (nil: every one nil).
		itemErr []func(error) bool
		errText string
		effects [2]int    // effect rows of op0, op1
		states  [2]string // their records after amqpidem ended the leases
	}
	idioms := []struct {
		name string
		fn   func(r *rig) pgstore.BatchTxFunc
		want want
	}{
		{"return tx.Commit", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				return nil, tx.Commit(ctx)
			}
		}, want{batchErr: none, errText: "nil", effects: [2]int{1, 1}, states: [2]string{"c", "c"}}},
		{"defer tx.Rollback, return tx.Commit", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				defer func() { _ = tx.Rollback(ctx) }()
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				return nil, tx.Commit(ctx)
			}
		}, want{batchErr: none, errText: "nil", effects: [2]int{1, 1}, states: [2]string{"c", "c"}}},
		{"defer tx.Rollback, return nil", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				defer func() { _ = tx.Rollback(ctx) }()
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				return nil, nil
			}
		}, want{batchErr: permanent(pgstore.ErrRolledBack), errText: "Permanent, wrapping pgstore.ErrRolledBack", states: [2]string{"f", "f"}}},
		{"tx.Commit per message (tx closed after the first)", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
					if err := tx.Commit(ctx); err != nil {
						return nil, err
					}
				}
				return nil, nil
			}
		}, want{batchErr: retryable(pgx.ErrTxClosed), errText: "a retryable error wrapping pgx.ErrTxClosed", states: [2]string{"r", "r"}}},
		{"Exec COMMIT", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				_, err := tx.Exec(ctx, "COMMIT")
				return nil, err
			}
		}, want{batchErr: none, errText: "nil", effects: [2]int{1, 1}, states: [2]string{"c", "c"}}},
		{"Exec COMMIT, then a batch error", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
					return nil, err
				}
				return nil, errBad
			}
		}, want{batchErr: none, itemErr: []func(error) bool{permanent(pgstore.ErrTxEnded), permanent(pgstore.ErrTxEnded)},
			errText: "no batch error (a batch error is split, its halves run again: their work would commit twice), each message Permanent, wrapping pgstore.ErrTxEnded",
			effects: [2]int{1, 1}, states: [2]string{"f", "f"}}},
		{"Exec COMMIT, then a retryable error for one message", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				rs := make([]amqpidem.BatchResult, len(ds))
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
					return nil, err
				}
				rs[1].Err = errBad
				return rs, nil
			}
		}, want{batchErr: none, itemErr: []func(error) bool{none, permanent(pgstore.ErrTxEnded)},
			errText: "op0 completed, op1 Permanent, wrapping pgstore.ErrTxEnded (its work committed: never retried)",
			effects: [2]int{1, 1}, states: [2]string{"c", "f"}}},
		{"Exec ROLLBACK", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				_, err := tx.Exec(ctx, "ROLLBACK")
				return nil, err
			}
		}, want{batchErr: none, itemErr: []func(error) bool{permanent(pgstore.ErrTxEnded), permanent(pgstore.ErrTxEnded)},
			// After its own ROLLBACK, a function's later statements run on
			// their own (a library's transactions commit): no rerun is safe.
			errText: "no batch error (split, its halves would run again), each message Permanent, wrapping pgstore.ErrTxEnded",
			states:  [2]string{"f", "f"}}},
		{"a library given tx.Conn()", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				own, err := tx.Conn().Begin(ctx)
				if err != nil {
					return nil, err
				}
				defer func() { _ = own.Rollback(ctx) }()
				for _, d := range ds {
					if err := r.insert(ctx, own, d.MessageId); err != nil {
						return nil, err
					}
				}
				return nil, own.Commit(ctx)
			}
		}, want{batchErr: none, errText: "nil", effects: [2]int{1, 1}, states: [2]string{"c", "c"}}},
		{"a savepoint per message, rolled back for the failed one", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				rs := make([]amqpidem.BatchResult, len(ds))
				for i, d := range ds {
					sp, err := tx.Begin(ctx)
					if err != nil {
						return nil, err
					}
					if err := r.insert(ctx, sp, d.MessageId); err != nil {
						return nil, err
					}
					if d.MessageId == "op1" {
						if err := sp.Rollback(ctx); err != nil {
							return nil, err
						}
						rs[i].Err = amqpidem.Permanent(errBad)
						continue
					}
					if err := sp.Commit(ctx); err != nil {
						return nil, err
					}
				}
				return rs, nil
			}
		}, want{batchErr: none, itemErr: []func(error) bool{none, permanent(errBad)}, errText: "op0 completed, op1 its Permanent error",
			effects: [2]int{1, 0}, states: [2]string{"c", "f"}}},
		{"SAVEPOINT and ROLLBACK TO by the function", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				for _, sql := range []string{"SAVEPOINT mine", "INSERT INTO effects (op) VALUES ('undone')", "ROLLBACK TO SAVEPOINT mine"} {
					if _, err := tx.Exec(ctx, strings.Replace(sql, "effects", pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize(), 1)); err != nil {
						return nil, err
					}
				}
				return nil, nil
			}
		}, want{batchErr: none, errText: "nil", effects: [2]int{1, 1}, states: [2]string{"c", "c"}}},
		{"a failed statement whose error is swallowed", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return nil, nil
			}
		}, want{batchErr: retryable(pgx.ErrTxCommitRollback), errText: "a retryable error wrapping pgx.ErrTxCommitRollback", states: [2]string{"r", "r"}}},
		{"a swallowed failure, then return tx.Commit", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return nil, tx.Commit(ctx)
			}
		}, want{batchErr: retryable(pgx.ErrTxCommitRollback), errText: "a retryable error wrapping pgx.ErrTxCommitRollback", states: [2]string{"r", "r"}}},
		{"an aborted transaction, then per-message answers", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return []amqpidem.BatchResult{{}, {Err: errBad}}, nil
			}
		}, want{batchErr: retryable(pgx.ErrTxCommitRollback), errText: "a retryable error wrapping pgx.ErrTxCommitRollback", states: [2]string{"r", "r"}}},
		{"an aborted transaction, then a Permanent batch error", func(r *rig) pgstore.BatchTxFunc {
			return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return nil, amqpidem.Permanent(errBad)
			}
		}, want{batchErr: permanent(errBad), errText: "the function's Permanent error", states: [2]string{"f", "f"}}},
	}
	for _, c := range idioms {
		for _, held := range []bool{false, true} {
			t.Run(map[bool]string{false: "row/", true: "held/"}[held]+c.name, func(t *testing.T) {
				r := newRig(t)
				rs, err := r.batchAttemptOn(held, batchKeys, c.fn(r))
				ok := c.want.batchErr(err)
				if ok && err == nil {
					for i := range batchKeys {
						var ierr error
						if rs != nil {
							ierr = rs[i].Err
						}
						check := none
						if c.want.itemErr != nil {
							check = c.want.itemErr[i]
						}
						ok = ok && check(ierr)
					}
				}
				if !ok {
					t.Errorf("HandleBatchComplete: results %+v, error %v; want %s", rs, err, c.want.errText)
				}
				effects := r.effects()
				for i, k := range batchKeys {
					if got, want := effects[k], c.want.effects[i]; got != want {
						t.Errorf("%s: %d effect rows, want %d", k, got, want)
					}
					if rec := r.record(k); rec == nil || rec.state != c.want.states[i] || rec.attempts != 1 {
						t.Errorf("%s: record %+v, want state %q, attempt 1", k, rec, c.want.states[i])
					}
				}
				if n := effects["undone"]; n != 0 {
					t.Errorf("%d rows the function rolled back to its savepoint", n)
				}
				r.idle()
			})
		}
	}
}

// TestBatchTxHandlerCommitThenErrorNotRerun: through a batch consumer, a
// function that commits the batch's transaction itself (a COMMIT
// statement) and then fails: its work committed, so no message of it
// may run again. Each message is dead-lettered once, with one effect row;
// a batch error would have been split, its halves run again, their
// effects committed twice. The same when the server cannot say whether
// that COMMIT committed (the status question fails: "unknown").
func TestBatchTxHandlerCommitThenErrorNotRerun(t *testing.T) {
	for _, unknown := range []bool{false, true} {
		t.Run(map[bool]string{false: "committed", true: "unknown"}[unknown], func(t *testing.T) {
			if unknown {
				pgstore.SetXactStatusSQL(t, "SELECT length($1::text) / 0 = 1")
			}
			r := newRig(t)
			r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
					return nil, err
				}
				return nil, errors.New("failed after its own COMMIT")
			}), func(c *amqpidem.ConsumerConfig) { c.BatchWait = 200 * time.Millisecond })
			ops := ids("c", 8)
			r.publish(ops...)
			evs := r.settled(ops, amqpidem.DeadLettered, amqpidem.Completed)
			got := r.effects()
			for _, op := range ops {
				if got[op] != 1 || evs[op][len(evs[op])-1].Outcome != amqpidem.DeadLettered {
					t.Errorf("%s: %d effect rows, events %s; want 1, dead-lettered", op, got[op], outcomes(evs[op]))
				}
			}
		})
	}
}
