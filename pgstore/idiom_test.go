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

// paths are the two leases a TxHandler takes: held by the transaction (a
// first delivery), and a record row (a redelivery, or Config.RowLeases).
var paths = []struct {
	name        string
	redelivered bool
}{{"held", false}, {"row", true}}

// attempt runs fn once for key as amqpidem runs a TxHandler: AcquireLease
// (a redelivered message takes a record-row lease), HandleComplete, and,
// after an error, Fail for a Permanent one and Release for another. It
// returns HandleComplete's error.
func (r *rig) attempt(key string, redelivered bool, fn pgstore.TxFunc) error {
	r.t.Helper()
	ctx := context.Background()
	h := r.taker(fn)
	res, err := h.AcquireLease(ctx, lock.Request{Key: key, TTL: 5 * time.Second}, &amqp.Delivery{Redelivered: redelivered})
	if err != nil || res.Status != lock.Acquired {
		r.t.Fatalf("AcquireLease %s: %+v, %v", key, res, err)
	}
	err = func() (err error) {
		defer func() {
			if p := recover(); p != nil { // amqpidem recovers a handler's panic
				err = fmt.Errorf("panic: %v", p)
			}
		}()
		_, err = h.HandleComplete(ctx, &amqp.Delivery{MessageId: key, Redelivered: redelivered}, res.Lease, same)
		return err
	}()
	switch {
	case err == nil:
	case amqpidem.IsPermanent(err):
		if ferr := r.store.Fail(ctx, res.Lease, err.Error()); ferr != nil {
			r.t.Fatalf("Fail %s after %v: %v", key, err, ferr)
		}
	default:
		if rerr := r.store.Release(ctx, res.Lease); rerr != nil {
			r.t.Fatalf("Release %s after %v: %v", key, err, rerr)
		}
	}
	return err
}

// TestTxHandlerIdioms: the pgx idioms users write out of habit give the
// same outcome on both leases, and never an ack without the effect or a
// second effect: a deferred Rollback after Commit is harmless, Commit
// keeps the work for TxHandler's own commit, a transaction the handler
// ended itself is completed only if its work committed (and never retried
// if it did), work rolled back then reported as done fails loudly, and an
// aborted transaction neither completes nor loses its outcome.
func TestTxHandlerIdioms(t *testing.T) {
	errBad := errors.New("the card was declined")
	type want struct {
		effects int
		state   string              // the record after amqpidem ended the lease
		err     func(error) bool    // HandleComplete's error
		errText string              // what err should be, for the failure message
		extra   func(r *rig) string // more checks; a non-empty answer fails
	}
	none := func(err error) bool { return err == nil }
	permanent := func(target error) func(error) bool {
		return func(err error) bool { return amqpidem.IsPermanent(err) && errors.Is(err, target) }
	}
	retryable := func(target error) func(error) bool {
		return func(err error) bool { return err != nil && !amqpidem.IsPermanent(err) && errors.Is(err, target) }
	}
	idioms := []struct {
		name string
		fn   func(r *rig) pgstore.TxFunc
		want want
	}{
		{"return tx.Commit", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				return nil, tx.Commit(ctx)
			}
		}, want{effects: 1, state: "c", err: none, errText: "nil"}},
		{"defer tx.Rollback, return tx.Commit", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				defer func() { _ = tx.Rollback(ctx) }()
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				return nil, tx.Commit(ctx)
			}
		}, want{effects: 1, state: "c", err: none, errText: "nil"}},
		{"defer tx.Rollback, return nil", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				defer func() { _ = tx.Rollback(ctx) }()
				return nil, r.insert(ctx, tx, d.MessageId)
			}
		}, want{effects: 0, state: "f", err: permanent(pgstore.ErrRolledBack), errText: "Permanent, wrapping pgstore.ErrRolledBack"}},
		{"Exec COMMIT", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, "COMMIT")
				return nil, err
			}
		}, want{effects: 1, state: "c", err: none, errText: "nil"}},
		{"Exec COMMIT, then an error", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
					return nil, err
				}
				return nil, errBad
			}
		}, want{effects: 1, state: "f", err: permanent(pgstore.ErrTxEnded), errText: "Permanent, wrapping pgstore.ErrTxEnded (its work committed: never retried)"}},
		{"Exec ROLLBACK", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, "ROLLBACK")
				return nil, err
			}
		}, want{effects: 0, state: "f", err: permanent(pgstore.ErrTxEnded), errText: "Permanent, wrapping pgstore.ErrTxEnded"}},
		{"a library given tx.Conn()", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				// What a library that manages its own transactions does
				// on the connection it is given.
				own, err := tx.Conn().Begin(ctx)
				if err != nil {
					return nil, err
				}
				defer func() { _ = own.Rollback(ctx) }()
				if err := r.insert(ctx, own, d.MessageId); err != nil {
					return nil, err
				}
				return nil, own.Commit(ctx)
			}
		}, want{effects: 1, state: "c", err: none, errText: "nil"}},
		{"SAVEPOINT and ROLLBACK TO by the handler", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				for _, sql := range []string{"SAVEPOINT mine", "INSERT INTO effects (op) VALUES ('undone')",
					"ROLLBACK TO SAVEPOINT mine", "SAVEPOINT again", "RELEASE SAVEPOINT again"} {
					if _, err := tx.Exec(ctx, strings.Replace(sql, "effects", pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize(), 1)); err != nil {
						return nil, err
					}
				}
				return nil, nil
			}
		}, want{effects: 1, state: "c", err: none, errText: "nil", extra: func(r *rig) string {
			if n := r.effects()["undone"]; n != 0 {
				return fmt.Sprintf("%d rows the handler rolled back to its savepoint", n)
			}
			return ""
		}}},
		{"a failed statement whose error is swallowed", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return nil, nil
			}
		}, want{effects: 0, state: "r", err: retryable(pgx.ErrTxCommitRollback), errText: "a retryable error wrapping pgx.ErrTxCommitRollback"}},
		{"a swallowed failure, then return tx.Commit", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return nil, tx.Commit(ctx)
			}
		}, want{effects: 0, state: "r", err: retryable(pgx.ErrTxCommitRollback), errText: "a retryable error wrapping pgx.ErrTxCommitRollback"}},
		{"an aborted transaction, then an error", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return nil, errBad
			}
		}, want{effects: 0, state: "r", err: retryable(errBad), errText: "the handler's error"}},
		{"an aborted transaction, then a Permanent error", func(r *rig) pgstore.TxFunc {
			return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				_, _ = tx.Exec(ctx, "SELECT 1/0")
				return nil, amqpidem.Permanent(errBad)
			}
		}, want{effects: 0, state: "f", err: permanent(errBad), errText: "the handler's Permanent error"}},
	}
	for _, p := range paths {
		for _, c := range idioms {
			t.Run(p.name+"/"+c.name, func(t *testing.T) {
				// A rig of its own: a fresh pool, whose statement cache has
				// prepared nothing yet.
				r := newRig(t)
				key := "op"
				err := r.attempt(key, p.redelivered, c.fn(r))
				if !c.want.err(err) {
					t.Errorf("HandleComplete: %v, want %s", err, c.want.errText)
				}
				if got := r.effects()[key]; got != c.want.effects {
					t.Errorf("%d effect rows, want %d", got, c.want.effects)
				}
				if rec := r.record(key); rec == nil || rec.state != c.want.state || rec.attempts != 1 {
					t.Errorf("record %+v, want state %q, attempt 1", rec, c.want.state)
				}
				if c.want.extra != nil {
					if msg := c.want.extra(r); msg != "" {
						t.Error(msg)
					}
				}
				r.idle()
			})
		}
	}
}

// TestHeldLeaseHandlerCommitKeepsTheKey: a handler that commits the
// transaction holding its lease itself (a COMMIT of its own, or a library
// given tx.Conn()) does not free the key before its record is written: a
// duplicate meanwhile is busy, not run a second time.
func TestHeldLeaseHandlerCommitKeepsTheKey(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	other := newStore(t, r.pool, r.cfg)
	var during, duringRow lock.Result
	err := r.attempt("k", false, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		var err error
		if during, err = other.TxHandler(nil).(amqpidem.LeaseTaker).AcquireLease(ctx, lock.Request{Key: "k"}, &amqp.Delivery{}); err != nil {
			return nil, err
		}
		duringRow, err = other.Acquire(ctx, lock.Request{Key: "k"})
		return nil, err
	})
	if err != nil {
		t.Fatalf("HandleComplete: %v", err)
	}
	if during.Status != lock.InProgress || duringRow.Status != lock.InProgress {
		t.Fatalf("a duplicate after the handler's COMMIT: AcquireLease %v, Acquire %v; want both in progress", during.Status, duringRow.Status)
	}
	if got := r.effects()["k"]; got != 1 {
		t.Fatalf("%d effect rows, want 1", got)
	}
	if got, err := other.Acquire(ctx, lock.Request{Key: "k"}); err != nil || got.Status != lock.Completed {
		t.Fatalf("Acquire after: %+v, %v; want completed", got, err)
	}
	r.idle()
}

// TestHeldLeaseLostCancelsHandler: a held lease whose session the server
// ended (its transaction idle past the lease's TTL) is reported lost by
// Extend, so the heartbeat cancels the handler's context with
// lock.ErrLeaseLost, as for a record-row lease taken over; while held,
// Extend answers nil.
func TestHeldLeaseLostCancelsHandler(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	h := r.taker(nil)
	res, err := h.AcquireLease(ctx, lock.Request{Key: "idle", TTL: 300 * time.Millisecond}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	if errs := r.store.Extend(ctx, res.Lease); errs[0] != nil {
		t.Fatalf("Extend of a held lease: %v, want nil", errs[0])
	}
	deadline := time.Now().Add(5 * time.Second)
	for errs := r.store.Extend(ctx, res.Lease); !errors.Is(errs[0], lock.ErrLeaseLost); errs = r.store.Extend(ctx, res.Lease) {
		if time.Now().After(deadline) {
			t.Fatalf("Extend of a held lease whose session sat idle past its TTL: %v after 5s, want lock.ErrLeaseLost", errs[0])
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := r.store.Release(ctx, res.Lease); err != nil {
		t.Fatalf("Release: %v", err)
	}
	r.idle()

	// Through a Consumer: the handler's context is cancelled.
	causes := make(chan error, 1)
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if info, _ := amqpidem.FromContext(ctx); info.Attempt > 1 {
			return nil, nil
		}
		select {
		case <-ctx.Done():
			causes <- context.Cause(ctx)
		case <-time.After(5 * time.Second):
			causes <- nil
		}
		return nil, ctx.Err()
	}), func(c *amqpidem.ConsumerConfig) { c.LeaseTTL = time.Second })
	r.publish("m")
	if cause := <-causes; !errors.Is(cause, lock.ErrLeaseLost) {
		t.Fatalf("the idle handler's context: cause %v, want lock.ErrLeaseLost", cause)
	}
	evs := r.waitFor("m", amqpidem.Completed)
	if evs[0].Outcome != amqpidem.Abandoned || evs[0].Reason != "lease lost" {
		t.Fatalf("events %s, want abandoned (lease lost), then completed", outcomes(evs))
	}
	if got := r.effects()["m"]; got != 1 {
		t.Fatalf("%d effect rows, want 1", got)
	}
}

// TestHeldLeaseFingerprintKept: the outcome of a held lease written after
// its transaction ended without it (the guard rolled it back, or Close
// did) keeps the request's fingerprint: a copy with another body is then
// a conflict, as on a record-row lease.
func TestHeldLeaseFingerprintKept(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	for _, c := range []struct {
		name string
		end  func(s *pgstore.Store, l lock.Lease)
	}{
		{"guard", func(s *pgstore.Store, l lock.Lease) { time.Sleep(2 * l.TTL) }},
		{"close", func(s *pgstore.Store, l lock.Lease) { s.Close() }},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newStore(t, r.pool, r.cfg)
			res, err := s.TxHandler(nil).(amqpidem.LeaseTaker).AcquireLease(ctx,
				lock.Request{Key: c.name, TTL: 200 * time.Millisecond, Fingerprint: "body one"}, &amqp.Delivery{})
			if err != nil || res.Status != lock.Acquired {
				t.Fatalf("AcquireLease: %+v, %v", res, err)
			}
			c.end(s, res.Lease)
			if err := s.Fail(ctx, res.Lease, "permanent failure"); err != nil {
				t.Fatalf("Fail: %v", err)
			}
			if got, err := r.store.Acquire(ctx, lock.Request{Key: c.name, Fingerprint: "body two"}); err != nil || got.Status != lock.Conflict {
				t.Fatalf("Acquire with another fingerprint: %+v, %v; want a conflict", got, err)
			}
			if got, err := r.store.Acquire(ctx, lock.Request{Key: c.name, Fingerprint: "body one"}); err != nil || got.Status != lock.Failed {
				t.Fatalf("Acquire with the same fingerprint: %+v, %v; want failed", got, err)
			}
			r.idle()
		})
	}
}

// TestHeldLeaseLongTTL: a lease longer than the longest idle timeout the
// server takes (2^31-1 ms) is a record-row lease, not a failure.
func TestHeldLeaseLongTTL(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return nil, r.insert(ctx, tx, d.MessageId)
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: "long", TTL: 1 << 31 * time.Millisecond}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease with a TTL of 2^31 ms: %+v, %v; want acquired", res, err)
	}
	if _, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "long"}, res.Lease, same); err != nil {
		t.Fatalf("HandleComplete: %v", err)
	}
	if rec := r.record("long"); rec == nil || rec.state != "c" || r.effects()["long"] != 1 {
		t.Fatalf("record %+v, effects %v; want completed once", rec, r.effects())
	}
	r.idle()
}

// TestHeldLeaseCommitFailsThenRelease: a completion whose session the
// server ended (the backend terminated, here) fails as unavailable,
// nothing committed, and the Release amqpidem makes next writes the
// released record, with the request's fingerprint, on a connection of
// the pool.
func TestHeldLeaseCommitFailsThenRelease(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		pid := tx.Conn().PgConn().PID()
		_, err := r.pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid)
		return nil, err
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: "gone", TTL: 5 * time.Second, Fingerprint: "body one"}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	if _, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "gone"}, res.Lease, same); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("HandleComplete on a terminated session: %v, want lock.ErrUnavailable", err)
	}
	if err := r.store.Release(ctx, res.Lease); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if rec := r.record("gone"); rec == nil || rec.state != "r" || r.effects()["gone"] != 0 {
		t.Fatalf("record %+v, effects %v; want released, no effect", rec, r.effects())
	}
	if got, err := r.store.Acquire(ctx, lock.Request{Key: "gone", Fingerprint: "body two"}); err != nil || got.Status != lock.Conflict {
		t.Fatalf("Acquire with another fingerprint: %+v, %v; want a conflict", got, err)
	}
	r.idle()
}

// TestTxHandlerCommittedThenRecordLost: a handler that commits its work
// itself, after which its lease is taken by another owner, so that its
// record cannot be completed: its work is done, so the error is
// Permanent (dead-lettered), never one that releases the lease for a
// redelivery to run the work again. On both leases.
func TestTxHandlerCommittedThenRecordLost(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			r := newRig(t)
			ctx := context.Background()
			key := "stolen-" + p.name
			table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()
			h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				if _, err := tx.Exec(ctx, "COMMIT"); err != nil { // ends it: tx.Commit would not
					return nil, err
				}
				// Another owner takes the key over: a row lease is
				// rewritten, a held one finds a live record in its way.
				_, err := r.pool.Exec(ctx, `INSERT INTO `+table+` AS t (ns, key, state, owner, fence, deadline, attempts,
						fingerprint, value, created_at, ended_at, expires_at)
					VALUES ($1, $2, 'p', 'thief', 1, now() + interval '1 hour', 1, '', NULL, now(), NULL, now() + interval '1 hour')
					ON CONFLICT (ns, key) DO UPDATE SET owner = 'thief', fence = t.fence + 1`, lock.DefaultPrefix, []byte(key))
				return []byte("done"), err
			})
			res, err := h.AcquireLease(ctx, lock.Request{Key: key, TTL: 5 * time.Second}, &amqp.Delivery{Redelivered: p.redelivered})
			if err != nil || res.Status != lock.Acquired {
				t.Fatalf("AcquireLease: %+v, %v", res, err)
			}
			_, err = h.HandleComplete(ctx, &amqp.Delivery{MessageId: key, Redelivered: p.redelivered}, res.Lease, same)
			if err == nil || !amqpidem.IsPermanent(err) || !errors.Is(err, pgstore.ErrTxEnded) {
				t.Fatalf("HandleComplete: %v; want a Permanent error wrapping ErrTxEnded (the work committed, the record not)", err)
			}
			if got := r.effects()[key]; got != 1 {
				t.Fatalf("effects %d, want 1", got)
			}
		})
	}
}
