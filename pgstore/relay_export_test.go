package pgstore

import "time"

// SetPoolWait sets how long a relay's statement waits for a pool
// connection, until the test ends.
func SetPoolWait(t interface{ Cleanup(func()) }, d time.Duration) {
	old := poolWait
	poolWait = d
	t.Cleanup(func() { poolWait = old })
}
