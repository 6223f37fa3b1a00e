package heartbeat

import (
	"fmt"
	"log/slog"
	"time"
)

// Scheduling constants. They are fractions of each lease's own TTL, so
// leases with different TTLs can share one Keeper.
const (
	// marginDivisor sets the default safety margin: TTL/5.
	marginDivisor = 5
	// extendDivisor sets the extension interval: TTL/3 (shortened when
	// the margin leaves less than that, see entry.interval).
	extendDivisor = 3
	// retryDivisor sets the retry delay after a transport error: TTL/10.
	retryDivisor = 10
	// minRetry is the shortest retry delay after a transport error.
	minRetry = 5 * time.Millisecond
)

// Config configures a Keeper. The zero value is valid: every field documents
// its default.
type Config struct {
	// SafetyMargin is how long before a lease's local deadline its
	// context is cancelled when no extension has been confirmed: the
	// handler is cancelled at deadline - SafetyMargin. It must cover the
	// time a handler takes to notice cancellation and stop writing, plus
	// the clock rate difference between this host and Redis over one TTL,
	// and exceed the host's scheduling latency: on a starved CPU the
	// cancellation comes tens of milliseconds late (see "Limits" in the
	// package documentation).
	// Zero means TTL/5 of each lease; negative is an error. A lease whose
	// TTL is not longer than the margin is refused by Keep.
	SafetyMargin time.Duration
	// Logger receives extension failures, lost and unconfirmed leases,
	// each lease logged by key= and fence=; a key of amqpidem's
	// (amqpidem.StoreKey: endpoint, NUL, message key) as endpoint= and
	// key=, the message key alone.
	// Default slog.Default(); slog.New(slog.DiscardHandler) silences it.
	Logger *slog.Logger
}

// Validate reports the first invalid field, by name.
func (c Config) Validate() error {
	if c.SafetyMargin < 0 {
		return fmt.Errorf("heartbeat: Config.SafetyMargin %v must not be negative (zero means TTL/%d)", c.SafetyMargin, marginDivisor)
	}
	return nil
}

// withDefaults returns c with every zero field set to its default. The
// margin's default depends on each lease's TTL; see margin.
func (c Config) withDefaults() Config {
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// margin is the safety margin for a lease with the given TTL.
func (c Config) margin(ttl time.Duration) time.Duration {
	if c.SafetyMargin == 0 {
		return ttl / marginDivisor
	}
	return c.SafetyMargin
}
