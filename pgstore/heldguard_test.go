package pgstore

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
)

// heldBatchOfTTL takes the leases of keys as one lease batch, held by a
// session, with ttl.
func heldBatchOfTTL(t *testing.T, s *Store, ttl time.Duration, keys ...string) []lock.Lease {
	t.Helper()
	bh := s.BatchTxHandler(func(context.Context, pgx.Tx, []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		return nil, nil
	}).(amqpidem.BatchLeaseTaker)
	reqs := make([]lock.Request, len(keys))
	ds := make([]*amqp.Delivery, len(keys))
	for i, k := range keys {
		reqs[i], ds[i] = lock.Request{Key: k, TTL: ttl}, &amqp.Delivery{MessageId: k}
	}
	rs, errs := bh.AcquireLeaseBatch(context.Background(), reqs, ds)
	ls := make([]lock.Lease, len(keys))
	for i := range rs {
		if errs[i] != nil || rs[i].Status != lock.Acquired || !isHeld(rs[i].Lease) {
			t.Fatalf("AcquireLeaseBatch %s: %+v %v, want a held lease", keys[i], rs[i], errs[i])
		}
		ls[i] = rs[i].Lease
	}
	return ls
}

// waiting reports whether the member of l still waits in s, held (not
// ended: what is left of an ended one has no batch).
func waiting(s *Store, l lock.Lease) bool {
	h, ok := s.held.Load(l.Owner)
	return ok && h.batch != nil
}

// TestHeldBatchGuardEndsEach: the members of a lease batch, put in the
// Store together under one guard (putHeldBatch), are each ended once
// their TTL passed with nothing taking them: their keys are free again,
// and what is left of each waits for the outcome.
func TestHeldBatchGuardEndsEach(t *testing.T) {
	s := testStore(t, pgenv.Pool(t, 4))
	ctx := context.Background()
	keys := []string{"ge-a", "ge-b", "ge-c"}
	ls := heldBatchOfTTL(t, s, 300*time.Millisecond, keys...)
	for _, k := range keys {
		if r, err := s.Acquire(ctx, lock.Request{Key: k, TTL: time.Second}); err != nil || r.Status != lock.InProgress {
			t.Fatalf("Acquire %s while held: %+v %v, want in progress", k, r, err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for _, l := range ls {
		for waiting(s, l) && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if waiting(s, l) {
			t.Fatalf("%s still waits held long past its TTL", l.Key)
		}
		if _, ok := s.held.Load(l.Owner); !ok {
			t.Fatalf("%s: nothing left of it waits for its outcome", l.Key)
		}
	}
	// The guard takes a member out of the Store before it rolls its
	// transaction back (endInPlace): the key's lock goes a moment later.
	for _, k := range keys {
		for {
			r, err := s.Acquire(ctx, lock.Request{Key: k, TTL: time.Second})
			if err == nil && r.Status == lock.Acquired {
				break
			}
			if err != nil || r.Status != lock.InProgress || time.Now().After(deadline) {
				t.Fatalf("Acquire %s after the guard: %+v %v, want acquired (its lock released)", k, r, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// TestHeldBatchGuardTakenPutBack: a member taken from the Store and put
// back (as a run does with the members it did not end) is under the
// guard of its put, not its first: the first one, firing, ends the
// member that stayed, not the one put back later, which its own guard
// ends a TTL after it was put back. And members all taken stop their
// guard.
func TestHeldBatchGuardTakenPutBack(t *testing.T) {
	s := testStore(t, pgenv.Pool(t, 4))
	const ttl = 400 * time.Millisecond
	ls := heldBatchOfTTL(t, s, ttl, "gp-a", "gp-b")
	start := time.Now()
	a := s.takeHeld(ls[0].Owner)
	if a == nil || a.batch == nil {
		t.Fatalf("takeHeld a: %+v", a)
	}
	g := a.shared.Load()
	if g == nil || g.left.Load() != 1 {
		t.Fatalf("a's shared guard: %v, want one left (b)", g)
	}
	time.Sleep(ttl / 2)
	s.putHeldBatch([]lock.Lease{ls[0]}, []*heldTx{a})
	for waiting(s, ls[1]) && time.Since(start) < 5*time.Second {
		time.Sleep(5 * time.Millisecond)
	}
	if waiting(s, ls[1]) {
		t.Fatal("b still waits held past its TTL")
	}
	if since := time.Since(start); since < ttl+ttl/2 && !waiting(s, ls[0]) {
		t.Fatalf("a, put back after %v, was ended %v after the batch's first put: by the first guard", ttl/2, since)
	}
	for waiting(s, ls[0]) && time.Since(start) < 5*time.Second {
		time.Sleep(5 * time.Millisecond)
	}
	if waiting(s, ls[0]) {
		t.Fatal("a still waits held past the TTL of its second put")
	}

	// Both taken: their guard is stopped.
	ls = heldBatchOfTTL(t, s, time.Hour, "gp-c", "gp-d")
	c, d := s.takeHeld(ls[0].Owner), s.takeHeld(ls[1].Owner)
	if c == nil || d == nil || c.shared.Load() != d.shared.Load() {
		t.Fatalf("members c, d: %+v %+v, want one shared guard", c, d)
	}
	if g := c.shared.Load(); g.left.Load() != 0 || g.t.Stop() {
		t.Fatalf("the guard of c, d, both taken: %d left, and it was not stopped", g.left.Load())
	}
	c.batch.end(c)
	d.batch.end(d)
}
