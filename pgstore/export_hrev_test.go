package pgstore

// SetLoseAnswer makes every handler's commit that succeeded call f, and
// answer as one whose answer was lost when f says so, until the test ends.
func SetLoseAnswer(t interface{ Cleanup(func()) }, f func() bool) {
	loseAnswer = f
	t.Cleanup(func() { loseAnswer = nil })
}
