package pgstore

import "time"

// SetCleanupFloor sets the least bound of a relay's cleanup statement,
// until the test ends.
func SetCleanupFloor(t interface{ Cleanup(func()) }, d time.Duration) {
	old := cleanupFloor
	cleanupFloor = d
	t.Cleanup(func() { cleanupFloor = old })
}

// SetListenWait sets the bound of a relay listener's connect and LISTEN,
// until the test ends.
func SetListenWait(t interface{ Cleanup(func()) }, d time.Duration) {
	old := listenWait
	listenWait = d
	t.Cleanup(func() { listenWait = old })
}
