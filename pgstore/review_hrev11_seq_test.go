package pgstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
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
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	keys := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable + "_keys"}.Sanitize()
	later := r.queue + "-later"
	r.write(true, pgstore.Message{RoutingKey: later, OrderKey: "k", Publishing: amqp.Publishing{MessageId: "dead", Body: []byte("dead")}})
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Ordered: true, MaxAttempts: 1, PollInterval: 20 * time.Millisecond}, nil)
	r.waitCount("d", 1, 10*time.Second)
	stop()
	// The counters lost: the outbox table moved without them (or an
	// older release's Cleanup).
	if _, err := r.pool.Exec(ctx, "DELETE FROM "+keys); err != nil {
		t.Fatal(err)
	}
	fresh := r.msg("fresh")
	fresh.OrderKey, fresh.Publishing.MessageId = "k", "fresh"
	r.write(true, fresh)
	if _, err := r.ch.QueueDeclare(later, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	testenv.DeleteQueues(t, testenv.AMQPURL(t), later)
	if n, err := r.ob.Redrive(ctx); err != nil || n != 1 {
		t.Fatalf("Redrive() = %d, %v; want 1", n, err)
	}
	rows, err := r.pool.Query(ctx, "SELECT message_id, seq FROM "+table+" WHERE order_key = 'k' AND state = 'p' ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	seqs := map[int64][]string{}
	got, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (string, error) {
		var id string
		var seq int64
		err := row.Scan(&id, &seq)
		seqs[seq] = append(seqs[seq], id)
		return fmt.Sprintf("%s=%d", id, seq), err
	})
	if err != nil {
		t.Fatal(err)
	}
	for seq, ids := range seqs {
		if len(ids) > 1 {
			t.Errorf("order key k: seq %d taken by %d pending rows %v (message=seq: %v): Write's new counter started after "+
				"the key's pending rows only, not its dead one", seq, len(ids), ids, got)
		}
	}
}
