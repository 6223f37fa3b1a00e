package pgstore_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrelay3RefusalRecordedWhenMarkFails: one round publishes a row the
// broker confirms and one it refuses (no queue bound), and the mark of the
// confirmed row fails (another session holds its row lock, taken between
// the claim and the mark, past every try of the mark). The refusal must
// still be recorded: the refused row's attempts count every refusal, so
// that it is dead after exactly MaxAttempts of them, and it is due again
// after its backoff, not only once its claim ends.
func TestHrelay3RefusalRecordedWhenMarkFails(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	ok := r.msg("ok")
	ok.Publishing.MessageId = "ok"
	lost := pgstore.Message{RoutingKey: r.queue + "-nobody", Publishing: amqp.Publishing{MessageId: "lost", Body: []byte("lost")}}
	r.write(true, ok, lost) // one claim takes both

	var log testenv.SyncBuffer
	t.Cleanup(func() { t.Logf("relay log:\n%s", log.String()) })
	lockTx, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var unlock sync.Once
	release := func() { unlock.Do(func() { _ = lockTx.Rollback(ctx) }) }
	t.Cleanup(release)
	var locked sync.Once
	const claimTTL = 3 * time.Second
	rl, stop := startRelay(t, r.ob, pgstore.RelayConfig{ClaimTTL: claimTTL, PublishTimeout: time.Second, MaxAttempts: 2,
		RetryBackoff: 100 * time.Millisecond, PollInterval: 50 * time.Millisecond, Logger: logTo(&log)},
		func(rl *pgstore.Relay) {
			pgstore.SetBeforeMark(rl, func() {
				locked.Do(func() {
					if _, err := lockTx.Exec(ctx, "SELECT 1 FROM "+table+" WHERE message_id = 'ok' FOR UPDATE"); err != nil {
						t.Errorf("lock the confirmed row: %v", err)
					}
				})
			})
		})
	waitLog(t, &log, "mark ", 10*time.Second)
	// The mark gives up after a third of ClaimTTL; well before the claim
	// ends, the refusal must be in the row.
	deadline := time.Now().Add(claimTTL / 3 * 2)
	var attempts int
	for time.Now().Before(deadline) {
		if err := r.pool.QueryRow(ctx, "SELECT attempts FROM "+table+" WHERE message_id = 'lost'").Scan(&attempts); err != nil {
			t.Fatal(err)
		}
		if attempts > 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if attempts == 0 {
		t.Errorf("the refused row has 0 attempts %v after its refusal: the round whose mark failed did not record it", claimTTL/3*2)
	}
	r.waitCount("d", 1, 3*claimTTL)
	release()
	r.waitCount("s", 1, 3*claimTTL)
	stop()
	_, refusedN, dead := rl.Counts()
	if refusedN != 2 || dead != 1 {
		t.Errorf("the broker refused the row %d times before it was dead (%d dead), want MaxAttempts (2)", refusedN, dead)
	}
	// The confirmed row whose mark failed is published again once its
	// claim ends: a copy, by design.
	t.Logf("%d deliveries of the confirmed row", len(r.take(1, 10*time.Second)))
	if err := r.pool.QueryRow(ctx, "SELECT attempts FROM "+table+" WHERE message_id = 'lost'").Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != 2 {
		t.Errorf("the dead row has %d attempts, want 2", attempts)
	}
}
