package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrelay3PublishOutlastsTimeout: a row whose publish outlasts
// PublishTimeout (here a 32 MiB body against 100 ms; in production a body
// near max_message_size on a slow link) is not a refusal: the confirm
// not awaited to the end says nothing about the message, and the same
// error comes from a broker that is slow or blocked (a memory alarm),
// when counting it would turn healthy rows dead. So its row stays pending
// with no attempts, never dead, published again after each backoff
// (copies reach the queue when the broker took it after the relay gave
// up), and, Ordered, its key's next row waits behind it; the warning
// names the row. This documents the behaviour (docs/relay.md), and checks
// the warning names the row's id so that an operator can find it.
func TestHrelay3PublishOutlastsTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("32 MiB publishes")
	}
	r := newOutboxRig(t)
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	slow := r.msg("")
	slow.OrderKey = "k"
	slow.Publishing.MessageId = "slow"
	slow.Publishing.Body = bytes.Repeat([]byte{'s'}, 32<<20)
	next := r.msg("next")
	next.OrderKey = "k"
	next.Publishing.MessageId = "next"
	other := r.msg("other")
	other.Publishing.MessageId = "other"
	r.write(true, slow, next, other)
	var slowID int64
	if err := r.pool.QueryRow(ctx, "SELECT id FROM "+table+" WHERE message_id = 'slow'").Scan(&slowID); err != nil {
		t.Fatal(err)
	}
	var log testenv.SyncBuffer
	t.Cleanup(func() {
		s := log.String()
		if len(s) > 3000 {
			s = s[:3000]
		}
		t.Logf("relay log:\n%s", s)
	})
	rl, stop := startRelay(t, r.ob, pgstore.RelayConfig{Ordered: true, PublishTimeout: 100 * time.Millisecond, MaxAttempts: 2,
		RetryBackoff: 100 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, PollInterval: 50 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	const watch = 8 * time.Second
	time.Sleep(watch)
	stopping := time.Now()
	stop()
	t.Logf("Shutdown took %v", time.Since(stopping))
	var state string
	var attempts int
	if err := r.pool.QueryRow(ctx, "SELECT state, attempts FROM "+table+" WHERE message_id = 'slow'").Scan(&state, &attempts); err != nil {
		t.Fatal(err)
	}
	tries := strings.Count(log.String(), "level=WARN msg=\"pgstore: relay: publish ")
	deliveries := map[string]int{}
	for {
		d, ok, err := r.ch.Get(r.queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		deliveries[d.MessageId]++
	}
	pub, refusedN, dead := rl.Counts()
	t.Logf("after %v: slow row %s with %d attempts; %d failed rounds logged; deliveries %v; counts published %d refused %d dead %d",
		watch, state, attempts, tries, deliveries, pub, refusedN, dead)
	if tries < 3 {
		t.Fatalf("%d publishes of the slow row timed out in %v: the reproduction did not reproduce", tries, watch)
	}
	if state != "p" || attempts != 0 || refusedN != 0 {
		t.Errorf("slow row %s with %d attempts (%d refusals): a publish that outlasts PublishTimeout is not a refusal", state, attempts, refusedN)
	}
	if deliveries["other"] != 1 || deliveries["next"] != 0 {
		t.Errorf("deliveries %v: want other once, next held back behind its key's slow head", deliveries)
	}
	if !strings.Contains(log.String(), fmt.Sprintf("(row ids %d)", slowID)) {
		t.Errorf("no warning names the slow row's id %d: the operator cannot tell which row holds its key back", slowID)
	}
}
