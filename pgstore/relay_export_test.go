package pgstore

import "time"

// SetBeforeMark makes r call f before each mark of published rows as sent
// (before the first try): a test ends the relay's sessions there. Call it
// before Run.
func SetBeforeMark(r *Relay, f func()) { r.beforeMark = f }

// SetPoolWait sets how long a relay's statement waits for a pool
// connection, until the test ends.
func SetPoolWait(t interface{ Cleanup(func()) }, d time.Duration) {
	old := poolWait
	poolWait = d
	t.Cleanup(func() { poolWait = old })
}
