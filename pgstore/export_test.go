package pgstore

import "time"

// SetCleanupGrace sets how long Cleanup keeps expired records, until the
// test ends.
func SetCleanupGrace(t interface{ Cleanup(func()) }, d time.Duration) {
	old := cleanupGrace
	cleanupGrace = d
	t.Cleanup(func() { cleanupGrace = old })
}
