package pgstore_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHeldBatchExcludes: a lease of a batch held by a session
// (AcquireLeaseBatch), a single lease held by a transaction (TxHandler's
// AcquireLease) and a record-row lease (Acquire, AcquireBatch) of one key
// exclude each other, every way round; once the batch's leases ended
// (one released, one completed with its batch), its session holds no
// lock and no transaction, back in the pool, and the keys are free.
func TestHeldBatchExcludes(t *testing.T) {
	ctx := context.Background()
	pool, store, _ := storeOn(t, func(p *pgxpool.Config) { p.MaxConns = 8 })
	bh := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		return nil, nil
	}).(amqpidem.BatchLeaseTaker)
	th := store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) { return nil, nil }).(amqpidem.LeaseTaker)
	req := func(key string) lock.Request { return lock.Request{Key: key, TTL: time.Minute, Retention: time.Hour} }
	batch := func(keys ...string) []lock.Result {
		t.Helper()
		reqs := make([]lock.Request, len(keys))
		ds := make([]*amqp.Delivery, len(keys))
		for i, k := range keys {
			reqs[i], ds[i] = req(k), &amqp.Delivery{}
		}
		rs, errs := bh.AcquireLeaseBatch(ctx, reqs, ds)
		for i, err := range errs {
			if err != nil {
				t.Fatalf("AcquireLeaseBatch %s: %v", keys[i], err)
			}
		}
		return rs
	}
	want := func(what string, res lock.Result, err error, st lock.Status) {
		t.Helper()
		if err != nil || res.Status != st {
			t.Errorf("%s: %v %v, want %v", what, res.Status, err, st)
		}
	}

	rs := batch("k1", "k2")
	for _, r := range rs {
		if r.Status != lock.Acquired || r.Lease.Owner[0] != 't' {
			t.Fatalf("batch lease: %+v, want acquired, held", r)
		}
	}
	res, err := store.Acquire(ctx, req("k1"))
	want("Acquire of a batch-held key", res, err, lock.InProgress)
	brs, berrs := store.AcquireBatch(ctx, []lock.Request{req("k2")})
	want("AcquireBatch of a batch-held key", brs[0], berrs[0], lock.InProgress)
	res, err = th.AcquireLease(ctx, req("k1"), &amqp.Delivery{})
	want("a held lease of a batch-held key", res, err, lock.InProgress)
	want("a batch lease of a batch-held key", batch("k2")[0], nil, lock.InProgress)

	single, err := th.AcquireLease(ctx, req("k3"), &amqp.Delivery{})
	want("a held lease", single, err, lock.Acquired)
	want("a batch lease of a held key", batch("k3")[0], nil, lock.InProgress)
	if err := store.Cancel(ctx, single.Lease); err != nil {
		t.Fatal(err)
	}
	row, err := store.Acquire(ctx, req("k4"))
	want("a record-row lease", row, err, lock.Acquired)
	want("a batch lease of a record-row key", batch("k4")[0], nil, lock.InProgress)

	pid, err := strconv.ParseUint(rs[0].Lease.Owner[1:9], 16, 32)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Release(ctx, rs[0].Lease); err != nil {
		t.Fatal(err)
	}
	out, err := bh.HandleBatchComplete(ctx, []amqpidem.BatchItem{{Delivery: &amqp.Delivery{}, Lease: rs[1].Lease}},
		func(_ int, r []byte) ([]byte, error) { return r, nil })
	if err != nil || out[0].Err != nil {
		t.Fatalf("HandleBatchComplete: %v %v", out, err)
	}
	// (The question may be asked on that very session, back in the pool.)
	var locks int
	var state string
	if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory'), "+
		"(SELECT CASE WHEN pid = pg_backend_pid() THEN 'idle' ELSE state END FROM pg_stat_activity WHERE pid = $1)", int(pid)).Scan(&locks, &state); err != nil {
		t.Fatal(err)
	}
	if locks != 0 || state != "idle" {
		t.Errorf("the batch's session, all its leases ended: %d advisory locks, %q, want 0, idle", locks, state)
	}
	res, err = store.Acquire(ctx, req("k1"))
	want("Acquire of the released key", res, err, lock.Acquired)
	res, err = store.Acquire(ctx, req("k2"))
	want("Acquire of the completed key", res, err, lock.Completed)
}

// TestHeldBatchRerunKeepsLocks: a run of a held lease batch that fails as
// a batch rolls back and keeps every key held (its session's locks
// outlive the transaction); a second run, of half the batch, commits
// those records; the other lease, still held (Extend), released, frees
// its key; and the session then holds no lock.
func TestHeldBatchRerunKeepsLocks(t *testing.T) {
	ctx := context.Background()
	pool, store, _ := storeOn(t, func(p *pgxpool.Config) { p.MaxConns = 8 })
	runs := 0
	bh := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		runs++
		if runs == 1 {
			return nil, errors.New("poison")
		}
		return nil, nil
	}).(amqpidem.BatchLeaseTaker)
	req := func(key string) lock.Request { return lock.Request{Key: key, TTL: time.Minute, Retention: time.Hour} }
	rs, errs := bh.AcquireLeaseBatch(ctx, []lock.Request{req("r1"), req("r2")}, []*amqp.Delivery{{}, {}})
	for i := range rs {
		if errs[i] != nil || rs[i].Status != lock.Acquired {
			t.Fatalf("AcquireLeaseBatch: %v %v", rs[i].Status, errs[i])
		}
	}
	items := []amqpidem.BatchItem{{Delivery: &amqp.Delivery{}, Lease: rs[0].Lease}, {Delivery: &amqp.Delivery{}, Lease: rs[1].Lease}}
	value := func(_ int, r []byte) ([]byte, error) { return r, nil }
	if _, err := bh.HandleBatchComplete(ctx, items, value); err == nil {
		t.Fatal("the poisoned run answered no batch error")
	}
	for _, k := range []string{"r1", "r2"} {
		if res, err := store.Acquire(ctx, req(k)); err != nil || res.Status != lock.InProgress {
			t.Errorf("Acquire %s after the failed run: %v %v, want in progress", k, res.Status, err)
		}
	}
	out, err := bh.HandleBatchComplete(ctx, items[:1], value)
	if err != nil || out[0].Err != nil {
		t.Fatalf("second run: %v %v", out, err)
	}
	if res, err := store.Acquire(ctx, req("r1")); err != nil || res.Status != lock.Completed {
		t.Errorf("Acquire r1 after its commit: %v %v, want completed", res.Status, err)
	}
	if res, err := store.Acquire(ctx, req("r2")); err != nil || res.Status != lock.InProgress {
		t.Errorf("Acquire r2, still held: %v %v, want in progress", res.Status, err)
	}
	if errs := store.Extend(ctx, rs[1].Lease); errs[0] != nil {
		t.Errorf("Extend of r2, held by the batch's session: %v", errs[0])
	}
	if err := store.Release(ctx, rs[1].Lease); err != nil {
		t.Fatal(err)
	}
	if errs := store.Extend(ctx, rs[1].Lease); !errors.Is(errs[0], lock.ErrLeaseLost) {
		t.Errorf("Extend of r2 after its release: %v, want lease lost", errs[0])
	}
	if res, err := store.Acquire(ctx, req("r2")); err != nil || res.Status != lock.Acquired {
		t.Errorf("Acquire r2 after its release: %v %v, want acquired", res.Status, err)
	}
	pid, err := strconv.ParseUint(rs[0].Lease.Owner[1:9], 16, 32)
	if err != nil {
		t.Fatal(err)
	}
	var locks int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE pid = $1 AND locktype = 'advisory'", int(pid)).Scan(&locks); err != nil {
		t.Fatal(err)
	}
	if locks != 0 {
		t.Errorf("the batch's session, all its leases ended, holds %d advisory locks", locks)
	}
}

// TestHeldBatchParts: a run batch holding the leases of two lease batches
// runs each on its own session, one transaction each. A part that fails
// as a batch first fails the whole run, nothing committed, the other
// part not run and its lease still held; once a part committed, a later
// part's batch error is each of its messages' own.
func TestHeldBatchParts(t *testing.T) {
	ctx := context.Background()
	_, store, _ := storeOn(t, func(p *pgxpool.Config) { p.MaxConns = 8 })
	bh := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if d.MessageId == "bad" {
				return nil, errors.New("poison")
			}
		}
		return nil, nil
	}).(amqpidem.BatchLeaseTaker)
	req := func(key string) lock.Request { return lock.Request{Key: key, TTL: time.Minute, Retention: time.Hour} }
	lease := func(key string) lock.Lease {
		t.Helper()
		rs, errs := bh.AcquireLeaseBatch(ctx, []lock.Request{req(key)}, []*amqp.Delivery{{}})
		if errs[0] != nil || rs[0].Status != lock.Acquired {
			t.Fatalf("AcquireLeaseBatch %s: %v %v", key, rs[0].Status, errs[0])
		}
		return rs[0].Lease
	}
	good, bad := lease("p1"), lease("p2")
	value := func(_ int, r []byte) ([]byte, error) { return r, nil }
	items := []amqpidem.BatchItem{
		{Delivery: &amqp.Delivery{MessageId: "bad"}, Lease: bad},
		{Delivery: &amqp.Delivery{MessageId: "good"}, Lease: good},
	}
	if _, err := bh.HandleBatchComplete(ctx, items, value); err == nil {
		t.Fatal("the failing first part answered no batch error")
	}
	for _, k := range []string{"p1", "p2"} {
		if res, err := store.Acquire(ctx, req(k)); err != nil || res.Status != lock.InProgress {
			t.Errorf("Acquire %s after the failed run: %v %v, want in progress", k, res.Status, err)
		}
	}
	items[0], items[1] = items[1], items[0]
	out, err := bh.HandleBatchComplete(ctx, items, value)
	if err != nil {
		t.Fatalf("a committed part, then a failing one: batch error %v", err)
	}
	if out[0].Err != nil || out[1].Err == nil {
		t.Errorf("results %v: want the good one done, the bad one failed", out)
	}
	if res, err := store.Acquire(ctx, req("p1")); err != nil || res.Status != lock.Completed {
		t.Errorf("Acquire p1: %v %v, want completed", res.Status, err)
	}
	if res, err := store.Acquire(ctx, req("p2")); err != nil || res.Status != lock.InProgress {
		t.Errorf("Acquire p2: %v %v, want in progress (its lease still held)", res.Status, err)
	}
	if err := store.Release(ctx, bad); err != nil {
		t.Fatal(err)
	}
}

// TestHeldBatchIdleSessionEnds: a lease batch whose holder stops talking
// to the server (paused, cut off: here, its batch's lock taken, as a
// paused process leaves it, PauseBatch) loses its session once it
// sat idle for the leases' TTL, whether it waits for its first run or
// between runs (after a failed one), and its keys with it: the session
// is kept in a transaction whose idle_in_transaction_session_timeout is
// the TTL. Extend then finds the leases lost, and another holder takes
// the keys.
func TestHeldBatchIdleSessionEnds(t *testing.T) {
	ctx := context.Background()
	pool, store, _ := storeOn(t, func(p *pgxpool.Config) { p.MaxConns = 8 })
	bh := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		return nil, errors.New("poison")
	}).(amqpidem.BatchLeaseTaker)
	const ttl = 500 * time.Millisecond
	for _, failedRun := range []bool{false, true} {
		a, b := "i1-"+strconv.FormatBool(failedRun), "i2-"+strconv.FormatBool(failedRun)
		reqs := []lock.Request{{Key: a, TTL: ttl, Retention: time.Hour}, {Key: b, TTL: ttl, Retention: time.Hour}}
		rs, errs := bh.AcquireLeaseBatch(ctx, reqs, []*amqp.Delivery{{}, {}})
		for i := range rs {
			if errs[i] != nil || rs[i].Status != lock.Acquired {
				t.Fatalf("AcquireLeaseBatch: %v %v", rs[i].Status, errs[i])
			}
		}
		if failedRun {
			items := []amqpidem.BatchItem{{Delivery: &amqp.Delivery{}, Lease: rs[0].Lease}, {Delivery: &amqp.Delivery{}, Lease: rs[1].Lease}}
			if _, err := bh.HandleBatchComplete(ctx, items, func(_ int, r []byte) ([]byte, error) { return r, nil }); err == nil {
				t.Fatal("the failing run answered no batch error")
			}
		}
		if res, err := store.Acquire(ctx, lock.Request{Key: a, TTL: time.Minute}); err != nil || res.Status != lock.InProgress {
			t.Fatalf("failedRun=%v: Acquire while held: %v %v, want in progress", failedRun, res.Status, err)
		}
		pid, err := strconv.ParseUint(rs[0].Lease.Owner[1:9], 16, 32)
		if err != nil {
			t.Fatal(err)
		}
		resume := pgstore.PauseBatch(store, rs[0].Lease.Owner)
		time.Sleep(4 * ttl)
		var alive bool
		if err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)", int(pid)).Scan(&alive); err != nil {
			t.Fatal(err)
		}
		if alive {
			t.Errorf("failedRun=%v: the paused batch's session is still there after 4 TTLs", failedRun)
		}
		if errs := store.Extend(ctx, rs[0].Lease, rs[1].Lease); !errors.Is(errs[0], lock.ErrLeaseLost) || !errors.Is(errs[1], lock.ErrLeaseLost) {
			t.Errorf("failedRun=%v: Extend after the session sat idle past the TTL: %v, want lease lost", failedRun, errs)
		}
		for _, k := range []string{a, b} {
			if res, err := store.Acquire(ctx, lock.Request{Key: k, TTL: time.Minute}); err != nil || res.Status != lock.Acquired {
				t.Errorf("failedRun=%v: Acquire %s after the session ended: %v %v, want acquired", failedRun, k, res.Status, err)
			}
		}
		for _, r := range rs {
			if err := store.Release(ctx, r.Lease); err != nil && !errors.Is(err, lock.ErrLeaseLost) {
				t.Errorf("Release after the session ended: %v", err)
			}
		}
		resume()
	}
}

// TestHeldBatchWholeOrNone: a lease batch is held by its session whole,
// or is record rows whole: one redelivered delivery, or one key whose
// record counts attempts (a retry), makes every lease of the call a
// record row, and the session taken for the others gives back every
// lock (a run batch of held and record-row leases would be two
// transactions, committing and failing apart).
func TestHeldBatchWholeOrNone(t *testing.T) {
	ctx := context.Background()
	pool, store, _ := storeOn(t, func(p *pgxpool.Config) { p.MaxConns = 8 })
	bh := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		return nil, nil
	}).(amqpidem.BatchLeaseTaker)
	req := func(key string) lock.Request { return lock.Request{Key: key, TTL: time.Minute, Retention: time.Hour} }
	// A record that counts attempts: acquired, then released.
	res, err := store.Acquire(ctx, req("w-retry"))
	if err != nil || res.Status != lock.Acquired {
		t.Fatal(res, err)
	}
	if err := store.Release(ctx, res.Lease); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name        string
		keys        []string
		redelivered int // index of the redelivered delivery, or -1
	}{
		{"redelivered", []string{"w-a1", "w-a2", "w-a3"}, 1},
		{"retry", []string{"w-b1", "w-retry", "w-b2"}, -1},
	} {
		reqs := make([]lock.Request, len(c.keys))
		ds := make([]*amqp.Delivery, len(c.keys))
		for i, k := range c.keys {
			reqs[i], ds[i] = req(k), &amqp.Delivery{Redelivered: i == c.redelivered}
		}
		rs, errs := bh.AcquireLeaseBatch(ctx, reqs, ds)
		for i, r := range rs {
			if errs[i] != nil || r.Status != lock.Acquired || r.Lease.Owner[0] == 't' {
				t.Errorf("%s: %s: %+v %v, want a record-row lease", c.name, c.keys[i], r, errs[i])
				continue
			}
			if err := store.Release(ctx, r.Lease); err != nil {
				t.Errorf("%s: release %s: %v", c.name, c.keys[i], err)
			}
		}
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections out of the pool after every lease ended, want 0", n)
	}
}
