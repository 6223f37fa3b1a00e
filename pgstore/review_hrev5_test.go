package pgstore

import (
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
)

// TestHeldGuardRearmHidesMember: a held batch member waiting while its
// batch is busy has its TTL guard re-armed; a run (or an end) taking the
// member meanwhile must find it. The re-arm deleted the member and stored
// it again: a takeHeld between the two found nothing, and runHeld
// answered that member "the session holding the lease ended before the
// handler ran" (lock.ErrUnavailable: requeued as store unavailable) though
// its session held it all along.
func TestHeldGuardRearmHidesMember(t *testing.T) {
	s := testStore(t, pgenv.Pool(t, 2))
	b := &heldBatch{s: s, ttl: time.Hour, locked: map[string]bool{"k": true}}
	b.running.Store(true) // a run of another part of its batch goes on
	l := lock.Lease{Key: "k", Owner: heldOwner(1), Fence: 1, TTL: 50 * time.Microsecond}
	s.putHeld(l, &heldTx{batch: b, key: []byte("k")})
	// Watch the map as a taker sees it (takeHeld's LoadAndDelete) while
	// the guard fires every TTL and finds the batch busy.
	misses, looks := 0, 0
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end) && misses == 0; looks++ {
		if _, ok := s.held.Load(l.Owner); !ok {
			misses++
		}
	}
	if m := s.takeHeld(l.Owner); m == nil {
		time.Sleep(10 * time.Millisecond)
		m = s.takeHeld(l.Owner)
	}
	b.running.Store(false)
	if misses > 0 {
		t.Fatalf("a member held all along was not found by takeHeld (%d misses in %d looks): its guard's re-arm took it out of Store.held", misses, looks)
	}
}
