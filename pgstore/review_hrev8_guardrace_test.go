package pgstore

import (
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
)

// Review h-rev8: putHeld and guardBatch arm a held lease's guard before
// they put the lease in Store.held, and look at Store.closed before both.
// heldStoreHook stands for the goroutine being held up between the two
// (preempted, descheduled on a loaded machine) while time passes, or
// while Close runs.

// putOne puts a member of b, holding l, in s: alone (putHeld) or as a
// batch of one (putHeldBatch).
func putOne(s *Store, l lock.Lease, b *heldBatch, batch bool) {
	h := &heldTx{batch: b, key: []byte(l.Key)}
	if batch {
		s.putHeldBatch([]lock.Lease{l}, []*heldTx{h})
	} else {
		s.putHeld(l, h)
	}
}

// withStoreHook sets heldStoreHook to f for the rest of the test.
func withStoreHook(t *testing.T, f func()) {
	heldStoreHook = f
	t.Cleanup(func() { heldStoreHook = nil })
}

// A guard that fires before its lease is in Store.held finds nothing to
// end, and does not fire again: the lease (with its batch's session and
// pooled connection, or its transaction) waits there for ever unless a
// call takes it, which is what the guard is for (a bug, or a lost end).
func TestReviewHrev8HeldGuardFiresBeforePut(t *testing.T) {
	s := testStore(t, pgenv.Pool(t, 2))
	const ttl = 20 * time.Millisecond
	withStoreHook(t, func() { time.Sleep(3 * ttl) })
	for _, batch := range []bool{false, true} {
		b := &heldBatch{s: s, ttl: time.Hour, locked: map[string]bool{"k": true}, members: 1}
		l := lock.Lease{Key: "k", Owner: heldOwner(1), Fence: 1, TTL: ttl, Retention: time.Hour}
		putOne(s, l, b, batch)
		deadline := time.Now().Add(2 * time.Second)
		for waiting(s, l) && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if waiting(s, l) {
			t.Errorf("batch %v: a lease of TTL %v still waits in Store.held 2s after it was put (its guard fired before the put)", batch, ttl)
		}
	}
}

// Close ends the leases waiting in Store.held; one put meanwhile (after
// putHeld or putHeldBatch looked at Store.closed) is missed, and waits
// for its guard, a whole TTL, holding its connection (a pool's Close
// waits for it).
func TestReviewHrev8HeldPutDuringClose(t *testing.T) {
	for _, batch := range []bool{false, true} {
		s := testStore(t, pgenv.Pool(t, 2))
		var once sync.Once
		withStoreHook(t, func() { once.Do(s.Close) })
		b := &heldBatch{s: s, ttl: time.Hour, locked: map[string]bool{"k": true}, members: 1}
		l := lock.Lease{Key: "k", Owner: heldOwner(1), Fence: 1, TTL: time.Hour, Retention: time.Hour}
		putOne(s, l, b, batch)
		if waiting(s, l) {
			t.Errorf("batch %v: a lease put while Close ran still waits in Store.held after Close (for its TTL, %v)", batch, l.TTL)
		}
		heldStoreHook = nil
	}
}
