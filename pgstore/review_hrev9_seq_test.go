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

// hrev9DeadThenRedriven makes, on r's outbox, the state that a re-drive
// after a counter is gone leaves: a message of order key "k" refused until
// dead, lose called (Cleanup, which deleted the counter of a key without
// pending rows before d9da6a5, or the counters deleted outright), a new
// message of "k" written, and the dead one re-driven. It returns the
// table's name.
func hrev9DeadThenRedriven(t *testing.T, r *outboxRig, lose func(context.Context) error) string {
	t.Helper()
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	later := r.queue + "-later"
	dead := pgstore.Message{RoutingKey: later, OrderKey: "k", Publishing: amqp.Publishing{MessageId: "dead", Body: []byte("dead")}}
	r.write(true, dead)
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Ordered: true, MaxAttempts: 1, PollInterval: 20 * time.Millisecond}, nil)
	r.waitCount("d", 1, 10*time.Second)
	stop()
	if err := lose(ctx); err != nil {
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
	return table
}

// TestHrev9RedriveAfterCounterCleanupSeq: a dead message's order key
// keeps its place in the numbering: after the key's counter was cleaned
// up (no pending row) and a new message written, the re-driven one does
// not share a number with a pending one. Two pending rows of a key with
// one seq are both the key's head (neither has a lower seq): relays
// publish them, and the chains behind them, side by side.
func TestHrev9RedriveAfterCounterCleanupSeq(t *testing.T) {
	r := newOutboxRig(t)
	table := hrev9DeadThenRedriven(t, r, hrev9Cleanup(r))
	hrev9NoSharedSeq(t, r, table, "the re-driven dead row and the one written after its key's counter was cleaned up")
}

// hrev9Cleanup is Outbox.Cleanup of r's sent rows past an hour, as a lose
// function of hrev9DeadThenRedriven.
func hrev9Cleanup(r *outboxRig) func(context.Context) error {
	return func(ctx context.Context) error {
		_, err := r.ob.Cleanup(ctx, time.Hour, 0)
		return err
	}
}

// hrev9NoSharedSeq fails t if two pending rows of order key "k" in table
// share a seq (both the key's head), saying which, and why they would.
func hrev9NoSharedSeq(t *testing.T, r *outboxRig, table, why string) {
	t.Helper()
	rows, err := r.pool.Query(context.Background(), "SELECT message_id, seq FROM "+table+" WHERE order_key = 'k' AND state = 'p' ORDER BY id")
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
			t.Errorf("order key k: seq %d taken by %d pending rows %v (message=seq: %v): %s", seq, len(ids), ids, got, why)
		}
	}
}

// TestHrev9RelaysClaimAFollowerOnce: two relays whose claims both reach
// an order key's next rows (two heads of one key, as a re-drive after a
// counter cleanup makes them), while those rows are locked: the claim
// that waits for the other re-reads only the row's state, and takes the
// rows the other just claimed. Each message must be published once.
func TestHrev9RelaysClaimAFollowerOnce(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	table := hrev9DeadThenRedriven(t, r, hrev9Cleanup(r))
	// Make the two heads of k whatever the numbering does: the re-driven
	// row and the fresh one share seq 1, and two rows follow them.
	if _, err := r.pool.Exec(ctx, "UPDATE "+table+" SET seq = 1 WHERE order_key = 'k' AND state = 'p'"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable + "_keys"}.Sanitize()+` (order_key, seq) VALUES ('k', 1)
		ON CONFLICT (order_key) DO UPDATE SET seq = 1`); err != nil {
		t.Fatal(err)
	}
	var follow []string
	for _, id := range []string{"f2", "f3"} {
		m := r.msg(id)
		m.OrderKey, m.Publishing.MessageId = "k", id
		follow = append(follow, r.write(true, m)...)
	}
	// One transaction holds the fresh head, another the first follower.
	lock := func(id string) pgx.Tx {
		tx, err := r.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		if _, err := tx.Exec(ctx, "SELECT 1 FROM "+table+" WHERE message_id = $1 FOR UPDATE", id); err != nil {
			t.Fatal(err)
		}
		return tx
	}
	head, first := lock("fresh"), lock("f2")
	waiting := func(n int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			var w int
			if err := r.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
				AND query LIKE '%WITH h AS%' AND query LIKE '%'||$1||'%'`, r.cfg.Schema).Scan(&w); err != nil {
				t.Fatal(err)
			}
			if w >= n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d relay claims wait for a lock after 10 s, want %d", w, n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	cfg := pgstore.RelayConfig{Ordered: true, Batch: 8, Concurrency: 4, PollInterval: 20 * time.Millisecond}
	startRelay(t, r.ob, cfg, nil) // claims the re-driven head and the followers: waits for f2
	waiting(1)
	if err := head.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	startRelay(t, r.ob, cfg, nil) // claims the fresh head and the followers: waits for f2
	waiting(2)
	if err := first.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	r.waitCount("s", 4, 20*time.Second)
	got := r.take(3, 10*time.Second)
	seen := map[string]int{}
	for _, d := range got {
		seen[d.MessageId]++
	}
	// The re-driven row goes to its own queue.
	for {
		d, ok, err := r.ch.Get(r.queue+"-later", true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		seen[d.MessageId]++
	}
	for _, id := range append([]string{"dead", "fresh"}, follow...) {
		if seen[id] != 1 {
			t.Errorf("%s arrived %d times, want once (deliveries %v)", id, seen[id], seen)
		}
	}
}
