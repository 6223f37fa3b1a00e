package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// TestHeldBatchAnswersEachKey: a lease batch's lock and read statements
// answer only the keys they did not lock and the keys that have a
// record, each by its place among the batch's keys (sorted, not in the
// call's order): every key gets its own answer. A fresh key is held; a
// completed one answers its value; one whose record is an unexpired
// lease, and one another session holds, are in progress; and the fresh
// keys of a batch get fences above the earlier leases' of theirs.
func TestHeldBatchAnswersEachKey(t *testing.T) {
	ctx := context.Background()
	_, store, _ := storeOn(t, func(p *pgxpool.Config) { p.MaxConns = 8 })
	bh := store.BatchTxHandler(func(context.Context, pgx.Tx, []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		return nil, nil
	}).(amqpidem.BatchLeaseTaker)
	take := func(keys ...string) ([]lock.Result, []error) {
		reqs := make([]lock.Request, len(keys))
		ds := make([]*amqp.Delivery, len(keys))
		for i, k := range keys {
			reqs[i], ds[i] = lock.Request{Key: k, TTL: time.Minute, Retention: time.Hour}, &amqp.Delivery{}
		}
		return bh.AcquireLeaseBatch(ctx, reqs, ds)
	}
	done, err := store.Acquire(ctx, lock.Request{Key: "sp-done", TTL: time.Minute, Retention: time.Hour})
	if err != nil || done.Status != lock.Acquired {
		t.Fatalf("Acquire sp-done: %+v %v", done, err)
	}
	if err := store.Complete(ctx, done.Lease, []byte("v1")); err != nil {
		t.Fatal(err)
	}
	busy, err := store.Acquire(ctx, lock.Request{Key: "sp-busy", TTL: time.Minute})
	if err != nil || busy.Status != lock.Acquired {
		t.Fatalf("Acquire sp-busy: %+v %v", busy, err)
	}
	other, errs := take("sp-held")
	if errs[0] != nil || other[0].Status != lock.Acquired || other[0].Lease.Owner[0] != 't' {
		t.Fatalf("the other batch's sp-held: %+v %v, want held", other[0], errs[0])
	}
	keys := []string{"sp-new2", "sp-done", "sp-held", "sp-new1", "sp-busy"}
	rs, errs := take(keys...)
	for i, k := range keys {
		if errs[i] != nil {
			t.Fatalf("%s: %v", k, errs[i])
		}
	}
	for _, i := range []int{0, 3} {
		if rs[i].Status != lock.Acquired || rs[i].Lease.Owner[0] != 't' || rs[i].Lease.Key != keys[i] || rs[i].Lease.Fence <= busy.Lease.Fence {
			t.Errorf("%s: %+v, want held, its fence above the earlier leases' (%d)", keys[i], rs[i], busy.Lease.Fence)
		}
	}
	if rs[1].Status != lock.Completed || string(rs[1].Value) != "v1" || rs[1].Fence != done.Lease.Fence {
		t.Errorf("sp-done: %+v, want completed with v1, fence %d", rs[1], done.Lease.Fence)
	}
	if rs[2].Status != lock.InProgress {
		t.Errorf("sp-held (another session holds it): %+v, want in progress", rs[2])
	}
	if rs[4].Status != lock.InProgress || rs[4].Remaining <= 0 || rs[4].Fence != busy.Lease.Fence {
		t.Errorf("sp-busy (a record-row lease): %+v, want in progress, fence %d", rs[4], busy.Lease.Fence)
	}
	for _, l := range []lock.Lease{rs[0].Lease, rs[3].Lease, other[0].Lease, busy.Lease} {
		if err := store.Release(ctx, l); err != nil {
			t.Errorf("Release %s: %v", l.Key, err)
		}
	}
	// Their locks released: the keys are free (released ones count an
	// attempt, as record rows).
	for _, k := range []string{"sp-new1", "sp-new2", "sp-held"} {
		if r, err := store.Acquire(ctx, lock.Request{Key: k, TTL: time.Minute}); err != nil || r.Status != lock.Acquired {
			t.Errorf("Acquire %s after the releases: %+v %v", k, r, err)
		}
	}
}
