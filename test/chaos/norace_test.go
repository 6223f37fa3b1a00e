//go:build linux && !race

package chaos_test

// raceEnabled says the tests run with the race detector.
const raceEnabled = false
