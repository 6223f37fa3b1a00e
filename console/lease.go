package console

import (
	"fmt"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// Lease health. A record stores its lease's deadline, not when the lease
// was last renewed: the console takes the consumers' lease TTL
// (Config.LeaseTTL) minus the time the lease has left as how long ago it
// was last taken or renewed. The heartbeat renews a lease about every
// TTL/3 (package heartbeat), so a lease not renewed for more than two of
// those intervals, stallAfter of its TTL, has a heartbeat that stalled:
// its consumer is paused, cut off from the store or overloaded, and the
// lease expires within TTL/3 unless it is renewed.
const (
	// stallNum/stallDen of the TTL is stallAfter: two heartbeat
	// intervals of TTL/3.
	stallNum, stallDen = 2, 3
)

// leaseHealth is what the console says of an in-progress record's lease.
type leaseHealth struct {
	// Renewed is how long ago the lease was last taken or renewed
	// (TTL - LeaseLeft); Known is false when that cannot be told: the
	// lease expired, or it has more left than the TTL the console was
	// told (the consumer uses a longer one).
	Renewed time.Duration
	Known   bool
	// Stalled: live, but not renewed for more than two heartbeat
	// intervals. Expired: in progress with its lease expired (its
	// consumer died or stopped renewing it; the next delivery of the key
	// takes it over).
	Stalled, Expired bool
}

// health tells rec's lease under ttl; the zero leaseHealth for a record
// that is not in progress.
func health(rec lock.Record, ttl time.Duration) leaseHealth {
	if rec.State != lock.StateInProgress {
		return leaseHealth{}
	}
	if !rec.Live() {
		return leaseHealth{Expired: true}
	}
	if rec.LeaseLeft > ttl {
		return leaseHealth{}
	}
	renewed := ttl - rec.LeaseLeft
	return leaseHealth{Renewed: renewed, Known: true, Stalled: renewed > ttl*stallNum/stallDen}
}

// String describes h for a table cell: "renewed 3s ago", "heartbeat
// stalled: renewed 25s ago", "expired"; "" when there is nothing to say.
func (h leaseHealth) String() string {
	switch {
	case h.Expired:
		return "expired"
	case h.Stalled:
		return fmt.Sprintf("heartbeat stalled: renewed %v ago", h.Renewed.Round(100*time.Millisecond))
	case h.Known:
		return fmt.Sprintf("renewed %v ago", h.Renewed.Round(100*time.Millisecond))
	}
	return ""
}
