package pgstore_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrev11RedriveAfterCounterLostSeq: d9da6a5 keeps the counter of an
// order key with dead rows at cleanup, but a key can still be without its
// counter while it has dead rows: the outbox moved without its counters
// (which Write's statement says it handles: "a new counter starts after
// the key's pending rows"), or counters deleted by a Cleanup of the
// release before d9da6a5, which did not spare dead rows. Write's new
// counter then starts after the pending rows only, not the dead ones: the
// key's next message takes the dead row's seq, and once the dead row is
// re-driven, two pending rows of the key share one seq (both heads,
// published side by side), as TestHrev9RedriveAfterCounterCleanupSeq
// showed before d9da6a5.
func TestHrev11RedriveAfterCounterLostSeq(t *testing.T) {
	r := newOutboxRig(t)
	keys := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable + "_keys"}.Sanitize()
	// The counters lost: the outbox table moved without them (or an
	// older release's Cleanup).
	table := hrev9DeadThenRedriven(t, r, func(ctx context.Context) error {
		_, err := r.pool.Exec(ctx, "DELETE FROM "+keys)
		return err
	})
	hrev9NoSharedSeq(t, r, table, "Write's new counter started after the key's pending rows only, not its dead one")
}
