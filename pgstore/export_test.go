package pgstore

import (
	"sync/atomic"
	"time"
)

// SetCleanupGrace sets how long Cleanup keeps expired records, until the
// test ends.
func SetCleanupGrace(t interface{ Cleanup(func()) }, d time.Duration) {
	old := cleanupGrace
	cleanupGrace = d
	t.Cleanup(func() { cleanupGrace = old })
}

// SetHeldRetry sets how long a Store takes record-row leases after finding
// the database not migrated, until the test ends.
func SetHeldRetry(t interface{ Cleanup(func()) }, d time.Duration) {
	old := heldRetry
	heldRetry = d
	t.Cleanup(func() { heldRetry = old })
}

// SetXactStatusSQL sets the query that asks whether a transaction
// committed, until the test ends.
func SetXactStatusSQL(t interface{ Cleanup(func()) }, q string) {
	old := xactStatusSQL
	xactStatusSQL = q
	t.Cleanup(func() { xactStatusSQL = old })
}

// LoseCommitAnswers makes the first n commits of handlers' transactions
// that succeed answer as if their answer was lost with the connection,
// until the test ends.
func LoseCommitAnswers(t interface{ Cleanup(func()) }, n int32) {
	var left atomic.Int32
	left.Store(n)
	loseAnswer = func() bool { return left.Add(-1) >= 0 }
	t.Cleanup(func() { loseAnswer = nil })
}

// PauseBatch takes the lock of the lease batch holding owner's lease, as
// a paused process leaves it: nothing of s talks on the batch's session
// (not its runs, nor the guard of a lease not ended within its TTL) until
// the returned function is called. It does nothing for a lease no lease
// batch holds.
func PauseBatch(s *Store, owner string) (resume func()) {
	h, ok := s.held.Load(owner)
	if !ok || h.batch == nil {
		return func() {}
	}
	b := h.batch
	b.mu.Lock()
	return b.mu.Unlock
}
