package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// record is what a key's record row says, or nil when it has none.
type record struct {
	state    string
	attempts int
	owner    string
	fence    int64
}

func (r *rig) record(key string) *record {
	r.t.Helper()
	var rec record
	err := r.pool.QueryRow(context.Background(), "SELECT state, attempts, owner, fence FROM "+
		pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()+" WHERE key = $1", []byte(key)).
		Scan(&rec.state, &rec.attempts, &rec.owner, &rec.fence)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		r.t.Fatal(err)
	}
	return &rec
}

// taker is a TxHandler of r's store as the LeaseTaker amqpidem sees.
func (r *rig) taker(fn pgstore.TxFunc) amqpidem.LeaseTaker {
	return r.store.TxHandler(fn).(amqpidem.LeaseTaker)
}

// idle waits until the pool has given back every connection: no
// transaction is left holding one. Then it checks that none of them holds
// a key's advisory lock: a pooled connection that kept the session-level
// lock of a held lease would make that key busy for every other
// connection, and acquirable again by its own.
func (r *rig) idle() {
	r.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for r.pool.Stat().AcquiredConns() != 0 {
		if time.Now().After(deadline) {
			r.t.Fatalf("%d pooled connections still acquired: a held transaction was not ended", r.pool.Stat().AcquiredConns())
		}
		time.Sleep(5 * time.Millisecond)
	}
	conns := r.pool.AcquireAllIdle(context.Background())
	if len(conns) == 0 {
		return
	}
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	var pids []int32
	for _, c := range conns {
		pids = append(pids, int32(c.Conn().PgConn().PID()))
	}
	var n int
	err := conns[0].QueryRow(context.Background(), `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND classid = 1634562409 AND pid = ANY($1)`, pids).Scan(&n)
	if err != nil {
		r.t.Fatal(err)
	}
	if n != 0 {
		r.t.Fatalf("%d advisory locks of held leases kept by pooled connections", n)
	}
}

var same = func(b []byte) ([]byte, error) { return b, nil }

// TestHeldLeaseOneCommit: a first delivery's lease is held by the handler's
// transaction: no record row exists while the handler runs, a duplicate
// meanwhile is answered busy at once (by Acquire and by another
// AcquireLease), and the record is written once, by the transaction that
// writes the effect, with the fence the handler was given.
func TestHeldLeaseOneCommit(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	key := "one-commit"
	var during *record
	var busy, busyHeld lock.Result
	var busyTook time.Duration
	var fence int64
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		during = r.record(key)
		t0 := time.Now()
		var err error
		if busy, err = r.store.Acquire(ctx, lock.Request{Key: key}); err != nil {
			return nil, err
		}
		busyTook = time.Since(t0)
		if busyHeld, err = r.taker(nil).AcquireLease(ctx, lock.Request{Key: key}, &amqp.Delivery{}); err != nil {
			return nil, err
		}
		return []byte("done"), r.insert(ctx, tx, d.MessageId)
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: key, TTL: 5 * time.Second}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired || res.Lease.Attempt != 1 || res.Lease.Fence <= 0 {
		t.Fatalf("AcquireLease: %+v, %v; want acquired, attempt 1, a fence", res, err)
	}
	fence = res.Lease.Fence
	if _, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "x"}, res.Lease, same); err != nil {
		t.Fatalf("HandleComplete: %v", err)
	}
	if during != nil {
		t.Fatalf("a record row existed while the handler ran: %+v (the lease should be the transaction's)", during)
	}
	if busy.Status != lock.InProgress || busyHeld.Status != lock.InProgress {
		t.Fatalf("duplicates while held: Acquire %v, AcquireLease %v; want both in progress", busy.Status, busyHeld.Status)
	}
	if busyTook > time.Second {
		t.Fatalf("Acquire of a held key took %v: it waited instead of answering busy", busyTook)
	}
	rec := r.record(key)
	if rec == nil || rec.state != "c" || rec.attempts != 1 || rec.fence != fence || rec.owner != res.Lease.Owner {
		t.Fatalf("record %+v, want completed, attempt 1, fence %d, owner %s", rec, fence, res.Lease.Owner)
	}
	var sameTx bool
	err = r.pool.QueryRow(ctx, fmt.Sprintf(
		`SELECT (SELECT xmin::text FROM %s WHERE op = 'x') = (SELECT xmin::text FROM %s WHERE key = $1)`,
		pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize(), pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()),
		[]byte(key)).Scan(&sameTx)
	if err != nil || !sameTx {
		t.Fatalf("effect and record written by one transaction: %v, %v", sameTx, err)
	}
	again, err := h.AcquireLease(ctx, lock.Request{Key: key}, &amqp.Delivery{})
	if err != nil || again.Status != lock.Completed || string(again.Value) != "done" {
		t.Fatalf("AcquireLease after completion: %+v, %v; want completed with its value", again, err)
	}
	// A duplicate is answered from the record even while another
	// consumer's acquire holds the key's lock: it is not made busy.
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(1634562409, hashtext($1 || $2 || ':' || encode($3, 'hex')))",
		pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()+":", lock.DefaultPrefix, []byte(key)); err != nil {
		t.Fatal(err)
	}
	if got, err := h.AcquireLease(ctx, lock.Request{Key: key}, &amqp.Delivery{}); err != nil || got.Status != lock.Completed {
		t.Fatalf("AcquireLease of a completed key while its lock is held: %+v, %v; want completed", got, err)
	}
	if got, err := r.store.Acquire(ctx, lock.Request{Key: key}); err != nil || got.Status != lock.Completed {
		t.Fatalf("Acquire of a completed key while its lock is held: %+v, %v; want completed", got, err)
	}
	if got, err := h.AcquireLease(ctx, lock.Request{Key: "other-" + key}, &amqp.Delivery{}); err != nil || got.Status != lock.Acquired {
		t.Fatalf("AcquireLease of another key: %+v, %v; want acquired", got, err)
	} else if err := r.store.Cancel(ctx, got.Lease); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	r.idle()
}

// TestHeldLeasePausedHolderLosesIt: a holder that stops talking to the
// server (a paused process) for its lease's TTL loses its session, and the
// lease with it: another consumer takes the key, and the paused holder's
// work, when it resumes, commits nothing.
func TestHeldLeasePausedHolderLosesIt(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	key := "paused"
	var resumed atomic.Bool
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if !resumed.Swap(true) {
			time.Sleep(1500 * time.Millisecond) // paused, idle in its transaction
		}
		return nil, r.insert(ctx, tx, d.MessageId)
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: key, TTL: 500 * time.Millisecond}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	// The paused holder, and a second consumer taking the key over once
	// the server ended the first one's session.
	type outcome struct {
		result []byte
		err    error
	}
	first := make(chan outcome, 1)
	go func() {
		out, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "stale"}, res.Lease, same)
		first <- outcome{out, err}
	}()
	var took lock.Result
	deadline := time.Now().Add(5 * time.Second)
	for {
		took, err = h.AcquireLease(ctx, lock.Request{Key: key, TTL: 5 * time.Second}, &amqp.Delivery{})
		if err != nil {
			t.Fatal(err)
		}
		if took.Status == lock.Acquired || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if took.Status != lock.Acquired || took.Lease.Fence <= res.Lease.Fence {
		t.Fatalf("takeover: %+v, want acquired with a fence above %d", took, res.Lease.Fence)
	}
	if _, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "new"}, took.Lease, same); err != nil {
		t.Fatalf("the new holder's HandleComplete: %v", err)
	}
	o := <-first
	if o.err == nil || !errors.Is(o.err, lock.ErrUnavailable) {
		t.Fatalf("the paused holder's HandleComplete: %v, want an error wrapping lock.ErrUnavailable", o.err)
	}
	// amqpidem releases it next: the record is the new holder's and stays.
	if err := r.store.Release(ctx, res.Lease); !errors.Is(err, lock.ErrLeaseLost) {
		t.Fatalf("Release of the paused holder's lease: %v, want lock.ErrLeaseLost", err)
	}
	if got := r.effects(); got["stale"] != 0 || got["new"] != 1 {
		t.Fatalf("effects %v, want only the new holder's", got)
	}
	if rec := r.record(key); rec == nil || rec.state != "c" || rec.fence != took.Lease.Fence {
		t.Fatalf("record %+v, want the new holder's completion", rec)
	}
	r.idle()
}

// TestHeldLeaseEndings: every way amqpidem ends a held lease ends its
// transaction and gives its connection back, with the record each one
// means: cancelled (nothing, the attempt not counted), failed before or
// after the handler ran, released after a handler error or panic, and
// failed for a result too large; none of the handler's writes commit.
func TestHeldLeaseEndings(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	fail := errors.New("handler failed")
	work := func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		switch d.MessageId {
		case "error":
			return nil, fail
		case "panic":
			panic("handler panicked")
		case "large":
			return make([]byte, 2<<20), nil
		}
		return nil, nil
	}
	for _, c := range []struct {
		key    string
		run    bool                          // HandleComplete is called first
		end    func(l lock.Lease) error      // then this
		want   func(rec *record) bool        // the record after
		effect int                           // effect rows of the key
		check  func(l lock.Lease, err error) // HandleComplete's error
	}{
		{key: "cancel", end: func(l lock.Lease) error { return r.store.Cancel(ctx, l) },
			want: func(rec *record) bool { return rec == nil }},
		{key: "fail-first", end: func(l lock.Lease) error { return r.store.Fail(ctx, l, "attempts exhausted") },
			want: func(rec *record) bool { return rec != nil && rec.state == "f" && rec.attempts == 1 }},
		{key: "error", run: true, end: func(l lock.Lease) error { return r.store.Release(ctx, l) },
			want: func(rec *record) bool { return rec != nil && rec.state == "r" && rec.attempts == 1 }},
		{key: "panic", run: true, end: func(l lock.Lease) error { return r.store.Release(ctx, l) },
			want: func(rec *record) bool { return rec != nil && rec.state == "r" && rec.attempts == 1 }},
		{key: "large", run: true, end: func(l lock.Lease) error { return r.store.Fail(ctx, l, "result too large") },
			want: func(rec *record) bool { return rec != nil && rec.state == "f" }},
		{key: "ok", run: true, end: func(l lock.Lease) error { return nil },
			want: func(rec *record) bool { return rec != nil && rec.state == "c" }, effect: 1},
	} {
		t.Run(c.key, func(t *testing.T) {
			h := r.taker(work)
			res, err := h.AcquireLease(ctx, lock.Request{Key: c.key, TTL: 5 * time.Second}, &amqp.Delivery{})
			if err != nil || res.Status != lock.Acquired {
				t.Fatalf("AcquireLease: %+v, %v", res, err)
			}
			if c.run {
				func() {
					defer func() { _ = recover() }() // amqpidem recovers a handler's panic
					_, err = h.HandleComplete(ctx, &amqp.Delivery{MessageId: c.key}, res.Lease, same)
				}()
				if c.key == "ok" && err != nil {
					t.Fatalf("HandleComplete: %v", err)
				}
				if c.key == "error" && !errors.Is(err, fail) {
					t.Fatalf("HandleComplete: %v, want the handler's error", err)
				}
			}
			if err := c.end(res.Lease); err != nil {
				t.Fatalf("ending the lease: %v", err)
			}
			if rec := r.record(c.key); !c.want(rec) {
				t.Fatalf("record %+v, not what %s means", rec, c.key)
			}
			if got := r.effects()[c.key]; got != c.effect {
				t.Fatalf("%d effect rows, want %d", got, c.effect)
			}
			r.idle()
			// The key is free again: a record that counts attempts sends
			// the next lease to a record row.
			next, err := h.AcquireLease(ctx, lock.Request{Key: c.key}, &amqp.Delivery{})
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case c.key == "cancel" && next.Status != lock.Acquired:
				t.Fatalf("after cancel: %+v, want acquired", next)
			case c.key == "error" && (next.Status != lock.Acquired || next.Lease.Attempt != 2 || r.record(c.key).state != "p"):
				t.Fatalf("after a release: %+v, record %+v; want a record-row lease, attempt 2", next, r.record(c.key))
			}
			if next.Status == lock.Acquired {
				if err := r.store.Cancel(ctx, next.Lease); err != nil {
					t.Fatal(err)
				}
			}
			r.idle()
		})
	}
}

// TestHeldLeaseGuard: a held lease that nothing ends (a bug) is rolled
// back after its TTL, with a warning, and its connection given back.
func TestHeldLeaseGuard(t *testing.T) {
	logs := &testenv.SyncBuffer{}
	r := newRigWith(t, pgstore.Config{})
	cfg := r.cfg
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	s := newStore(t, r.pool, cfg)
	h := s.TxHandler(nil).(amqpidem.LeaseTaker)
	res, err := h.AcquireLease(context.Background(), lock.Request{Key: "forgotten", TTL: 200 * time.Millisecond}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	r.idle()
	if !strings.Contains(logs.String(), "was not ended within its TTL") {
		t.Fatalf("logs %q, want the guard's warning", logs.String())
	}
	again, err := s.Acquire(context.Background(), lock.Request{Key: "forgotten"})
	if err != nil || again.Status != lock.Acquired {
		t.Fatalf("Acquire after the guard: %+v, %v; want acquired", again, err)
	}
}

// TestHeldLeaseRowLeases: a redelivered message (its first delivery may
// have crashed the consumer), every message with Config.RowLeases, and
// every message under an isolation level above READ COMMITTED (a snapshot
// older than the lock could miss a lease committed just before it) take a
// record-row lease: the execution is counted before it runs.
func TestHeldLeaseRowLeases(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name string
		cfg  pgstore.Config
		d    amqp.Delivery
	}{
		{name: "redelivered", d: amqp.Delivery{Redelivered: true}},
		{name: "RowLeases", cfg: pgstore.Config{RowLeases: true}},
		{name: "repeatable read", cfg: pgstore.Config{TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRigWith(t, c.cfg)
			res, err := r.taker(nil).AcquireLease(ctx, lock.Request{Key: "k"}, &c.d)
			if err != nil || res.Status != lock.Acquired {
				t.Fatalf("AcquireLease: %+v, %v", res, err)
			}
			if rec := r.record("k"); rec == nil || rec.state != "p" || rec.attempts != 1 {
				t.Fatalf("record %+v, want a lease row counting attempt 1", rec)
			}
			r.idle()
		})
	}
}

// TestHeldLeaseRespectsRowLease: a live record-row lease makes a held
// acquire busy, and the completed record of a held lease answers Acquire
// as a duplicate.
func TestHeldLeaseRespectsRowLease(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	row, err := r.store.Acquire(ctx, lock.Request{Key: "row"})
	if err != nil || row.Status != lock.Acquired {
		t.Fatalf("Acquire: %+v, %v", row, err)
	}
	got, err := r.taker(nil).AcquireLease(ctx, lock.Request{Key: "row"}, &amqp.Delivery{})
	if err != nil || got.Status != lock.InProgress || got.Remaining <= 0 {
		t.Fatalf("AcquireLease of a key with a live row lease: %+v, %v; want in progress", got, err)
	}
	r.idle()
}

// TestHeldLeaseIdleHandlerRetriesOnRow: a handler that leaves its
// transaction idle longer than the lease's TTL loses its session on a
// first delivery; its retry takes a record-row lease, which the heartbeat
// renews, and completes once, rather than losing its session again.
func TestHeldLeaseIdleHandlerRetriesOnRow(t *testing.T) {
	r := newRig(t)
	var runs atomic.Int32
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		runs.Add(1)
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		time.Sleep(1500 * time.Millisecond) // a slow call elsewhere, the transaction idle
		return nil, r.insert(ctx, tx, d.MessageId+"-after")
	}), func(c *amqpidem.ConsumerConfig) { c.LeaseTTL = time.Second })
	r.publish("slow")
	evs := r.waitFor("slow", amqpidem.Completed)
	if len(evs) != 2 || evs[0].Outcome != amqpidem.Abandoned {
		t.Fatalf("events %s, want abandoned (its session ended), then completed", outcomes(evs))
	}
	if got := r.effects(); got["slow"] != 1 || got["slow-after"] != 1 || runs.Load() != 2 {
		t.Fatalf("effects %v after %d runs, want one row of each after 2 runs", got, runs.Load())
	}
	if rec := r.record(amqpidem.StoreKey(r.queue, "slow")); rec == nil || rec.state != "c" || rec.attempts != 2 {
		t.Fatalf("record %+v, want completed by attempt 2 (a record-row lease)", rec)
	}
}

// TestHandlerTx: the pgx.Tx a handler gets, on either lease, behaves as
// pgx's nested transactions do: Commit and Rollback close it (statements
// after either answer pgx.ErrTxClosed, and a Rollback after Commit does
// nothing), nested transactions and large objects work. (What each way
// of ending comes to: TestTxHandlerIdioms.)
func TestHandlerTx(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			r := newRig(t)
			err := r.attempt("closed", p.redelivered, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				if err := tx.Commit(ctx); err != nil {
					return nil, fmt.Errorf("Commit: %w", err)
				}
				if _, err := tx.Exec(ctx, "SELECT 1"); !errors.Is(err, pgx.ErrTxClosed) {
					return nil, fmt.Errorf("Exec after Commit: %v, want pgx.ErrTxClosed", err)
				}
				if err := tx.Rollback(ctx); !errors.Is(err, pgx.ErrTxClosed) {
					return nil, fmt.Errorf("Rollback after Commit: %v, want pgx.ErrTxClosed", err)
				}
				return nil, nil
			})
			if got := r.effects()["closed"]; err != nil || got != 1 {
				t.Fatalf("Commit, then Rollback: %v, %d effect rows; want nil and 1", err, got)
			}
			err = r.attempt("nested", p.redelivered, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, "kept"); err != nil {
					return nil, err
				}
				inner, err := tx.Begin(ctx)
				if err != nil {
					return nil, err
				}
				if err := r.insert(ctx, inner, "undone"); err != nil {
					return nil, err
				}
				if err := inner.Rollback(ctx); err != nil {
					return nil, err
				}
				lo := tx.LargeObjects()
				oid, err := lo.Create(ctx, 0)
				if err != nil {
					return nil, err
				}
				return nil, lo.Unlink(ctx, oid)
			})
			if got := r.effects(); err != nil || got["kept"] != 1 || got["undone"] != 0 {
				t.Fatalf("nested: %v, effects %v; want the outer write only", err, got)
			}
			r.idle()
		})
	}
}

// TestHeldLeaseNotMigrated: on a database migrated by an earlier release
// (no <table>_held_key), TxHandler takes record-row leases, and Check
// says to run Migrate; once it ran, TxHandler holds leases by transactions
// again when it next looks (heldRetry), not before.
func TestHeldLeaseNotMigrated(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	fn := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable + "_held_key"}.Sanitize()
	if _, err := r.pool.Exec(ctx, "DROP FUNCTION "+fn); err != nil {
		t.Fatal(err)
	}
	if err := r.store.Check(ctx); err == nil || !strings.Contains(err.Error(), "run pgstore.Migrate") {
		t.Fatalf("Check: %v, want an error saying to run pgstore.Migrate", err)
	}
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return nil, r.insert(ctx, tx, d.MessageId)
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: "old"}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v; want a record-row lease", res, err)
	}
	r.completeOnRow(h, "old", res.Lease)

	if err := pgstore.Migrate(ctx, r.pool, r.cfg); err != nil {
		t.Fatal(err)
	}
	res, err = h.AcquireLease(ctx, lock.Request{Key: "soon"}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease right after Migrate: %+v, %v", res, err)
	}
	r.completeOnRow(h, "soon", res.Lease)
	pgstore.SetHeldRetry(t, 0)
	res, err = h.AcquireLease(ctx, lock.Request{Key: "later"}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease once the Store looks again: %+v, %v", res, err)
	}
	if rec := r.record("later"); rec != nil {
		t.Fatalf("record %+v while the lease is held, want none (a lease held by the transaction)", rec)
	}
	if _, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "later"}, res.Lease, same); err != nil {
		t.Fatalf("HandleComplete: %v", err)
	}
	if rec := r.record("later"); rec == nil || rec.state != "c" || r.effects()["later"] != 1 {
		t.Fatalf("record %+v, effects %v; want completed once", rec, r.effects())
	}
	r.idle()
}

// completeOnRow checks that l, key's lease from h, is a record-row lease
// (an in-progress record, attempt 1), and that h's handler completes it
// once: a completed record and one effect.
func (r *rig) completeOnRow(h amqpidem.LeaseTaker, key string, l lock.Lease) {
	r.t.Helper()
	if rec := r.record(key); rec == nil || rec.state != "p" || rec.attempts != 1 {
		r.t.Fatalf("record %+v after AcquireLease, want a record-row lease, attempt 1", rec)
	}
	if _, err := h.HandleComplete(context.Background(), &amqp.Delivery{MessageId: key}, l, same); err != nil {
		r.t.Fatalf("HandleComplete: %v", err)
	}
	if rec := r.record(key); rec == nil || rec.state != "c" || r.effects()[key] != 1 {
		r.t.Fatalf("record %+v, effects %v; want completed once", rec, r.effects())
	}
}

// TestHeldLeaseClose: Close rolls back the transactions holding leases
// that nothing ended, and gives their connections back.
func TestHeldLeaseClose(t *testing.T) {
	r := newRig(t)
	s, err := pgstore.New(r.pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	res, err := s.TxHandler(nil).(amqpidem.LeaseTaker).AcquireLease(context.Background(), lock.Request{Key: "closed"}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	if n := r.pool.Stat().AcquiredConns(); n != 1 {
		t.Fatalf("%d connections acquired while the lease is held, want 1", n)
	}
	s.Close()
	r.idle() // the pool closes the connection in the background
}

// TestHeldLeaseRecordInTheWay: a record that a held lease did not write
// (written without the key's lock, which no call of this package does)
// makes the completion fail as a lost lease, and the handler's writes
// roll back with it; a record past its retention, not yet deleted, makes
// the acquire take a record-row lease, which replaces it.
func TestHeldLeaseRecordInTheWay(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()
	write := func(key string, expires string) {
		t.Helper()
		_, err := r.pool.Exec(ctx, "INSERT INTO "+table+` (ns, key, state, owner, fence, attempts, fingerprint,
			created_at, ended_at, expires_at) VALUES ($1, $2, 'c', 'intruder', 1, 1, '', now(), now(), now() + $3::interval)`,
			lock.DefaultPrefix, []byte(key), expires)
		if err != nil {
			t.Fatal(err)
		}
	}
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return nil, r.insert(ctx, tx, d.MessageId)
	})

	res, err := h.AcquireLease(ctx, lock.Request{Key: "intruded"}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	write("intruded", "1 hour")
	_, err = h.HandleComplete(ctx, &amqp.Delivery{MessageId: "intruded"}, res.Lease, same)
	if !errors.Is(err, lock.ErrLeaseLost) {
		t.Fatalf("HandleComplete over a record in the way: %v, want lock.ErrLeaseLost", err)
	}
	if rec := r.record("intruded"); rec == nil || rec.owner != "intruder" || r.effects()["intruded"] != 0 {
		t.Fatalf("record %+v, effects %v; want the intruder's record and no effect", rec, r.effects())
	}

	write("expired", "-1 second")
	res, err = h.AcquireLease(ctx, lock.Request{Key: "expired"}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired || res.Fence <= 1 {
		t.Fatalf("AcquireLease of a key whose record expired: %+v, %v; want acquired above fence 1", res, err)
	}
	r.completeOnRow(h, "expired", res.Lease)
	r.idle()
}

// TestHeldLeaseFingerprint: the record a held lease wrote keeps the
// request's fingerprint: a copy with another body is a conflict, a copy
// with the same one a duplicate.
func TestHeldLeaseFingerprint(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return []byte("done"), r.insert(ctx, tx, d.MessageId)
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: "fp", Fingerprint: "body-a"}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	if _, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "fp"}, res.Lease, same); err != nil {
		t.Fatalf("HandleComplete: %v", err)
	}
	for fp, want := range map[string]lock.Status{"body-b": lock.Conflict, "body-a": lock.Completed} {
		got, err := h.AcquireLease(ctx, lock.Request{Key: "fp", Fingerprint: fp}, &amqp.Delivery{})
		if err != nil || got.Status != want {
			t.Fatalf("AcquireLease with fingerprint %s: %+v, %v; want %v", fp, got, err, want)
		}
	}
	r.idle()
}

// TestHeldLeaseSpelledOtherwise: a Store whose Config names the table
// otherwise than the migration did (the schema left to the pool's
// search_path here, named in the migration's Config) takes the same
// advisory lock as the functions: a held lease and a record-row lease of
// one key exclude each other.
func TestHeldLeaseSpelledOtherwise(t *testing.T) {
	pool := pgenv.Pool(t, 8)
	ctx := context.Background()
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1}) // migrated with Schema set
	pcfg := pool.Config().Copy()
	pcfg.ConnConfig.RuntimeParams["search_path"] = cfg.Schema
	local, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(local.Close)
	s := newStore(t, local, pgstore.Config{CleanupInterval: -1}) // no Schema
	if err := s.Check(ctx); err != nil {
		t.Fatalf("Check: %v", err)
	}
	held, err := s.TxHandler(nil).(amqpidem.LeaseTaker).AcquireLease(ctx, lock.Request{Key: "k"}, &amqp.Delivery{})
	if err != nil || held.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", held, err)
	}
	defer func() { _ = s.Cancel(ctx, held.Lease) }()
	if row, err := s.Acquire(ctx, lock.Request{Key: "k"}); err != nil || row.Status != lock.InProgress {
		t.Fatalf("Acquire of a key whose lease a transaction holds: %+v, %v; want in progress", row, err)
	}
}
