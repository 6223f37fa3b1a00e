package amqpidem

import (
	"testing"

	"github.com/amqpidem/amqpidem/lock"
)

// ClaimRace runs TestOutboxClaimRace's race on store, for the stores
// package amqpidem cannot import (pgstore imports it).
func ClaimRace(t *testing.T, store lock.Store) { testClaimRace(t, store) }
