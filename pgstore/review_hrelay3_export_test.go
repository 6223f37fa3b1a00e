package pgstore

import "time"

// SetCleanupFloor sets the least bound of a relay's cleanup statement,
// until the test ends.
func SetCleanupFloor(t interface{ Cleanup(func()) }, d time.Duration) {
	old := cleanupFloor
	cleanupFloor = d
	t.Cleanup(func() { cleanupFloor = old })
}
