package pgstore_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/pgstore"
)

// hrev14SlowTracer makes every publish of a message whose MessageId
// starts with "slow" outlast PublishTimeout (it waits for its context to
// end), and counts them.
type hrev14SlowTracer struct {
	nopTracer
	slow atomic.Int64
}

func (t *hrev14SlowTracer) StartPublish(ctx context.Context, p amqpidem.Publish) func(error) {
	if strings.HasPrefix(p.MessageID, "slow") {
		t.slow.Add(1)
		<-ctx.Done()
	}
	return nil
}

// TestHrev14SlowRowsLeaveTheMarkItsClaim: a round's confirmed rows are
// marked sent only after all of its publishes, those of the known-slow
// rows (published one at a time, after the others) too. markSent is
// given a third of ClaimTTL to write the mark (tried again on failure);
// a mark written after the claim ended comes after another relay may
// have claimed and published the rows again. Before the slow rows were
// published one at a time, a round of Batch <= Concurrency rows lasted
// one PublishTimeout at most, whatever was slow in it; now each known-slow
// row adds a PublishTimeout, up to the heads deadline (ClaimTTL less
// PublishTimeout), so the round's fresh, confirmed rows reach their mark
// with a sliver of their claim left. Checked: the claim left to the
// fresh rows when the relay is about to mark them.
func TestHrev14SlowRowsLeaveTheMarkItsClaim(t *testing.T) {
	r := newOutboxRig(t)
	const nSlow = 5
	var slow []pgstore.Message
	for i := 0; i < nSlow; i++ {
		m := r.msg("slow" + strconv.Itoa(i))
		m.Publishing.MessageId = "slow" + strconv.Itoa(i)
		slow = append(slow, m)
	}
	r.write(true, slow...)
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	const claimTTL, publishTimeout = 1500 * time.Millisecond, 300 * time.Millisecond
	var mu sync.Mutex
	var marks int
	minLeft := time.Hour
	tr := &hrev14SlowTracer{}
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Tracer: tr, ClaimTTL: claimTTL, PublishTimeout: publishTimeout,
		RetryBackoff: 50 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, PollInterval: 20 * time.Millisecond,
		Retention: -1},
		func(rl *pgstore.Relay) {
			pgstore.SetBeforeMark(rl, func() {
				// The claim left to the fresh rows about to be marked
				// (still claimed: the mark has not run).
				var ms *float64
				err := r.pool.QueryRow(context.Background(), "SELECT min(extract(epoch FROM due_at - clock_timestamp()) * 1000) FROM "+
					table+" WHERE state = 'p' AND claimed_by IS NOT NULL AND message_id LIKE 'fresh%'").Scan(&ms)
				if err != nil || ms == nil {
					return
				}
				mu.Lock()
				defer mu.Unlock()
				marks++
				minLeft = min(minLeft, time.Duration(*ms*float64(time.Millisecond)))
			})
		})
	// Let every slow row time out once: known slow from then on.
	deadline := time.Now().Add(10 * time.Second)
	for tr.slow.Load() < nSlow {
		if time.Now().After(deadline) {
			t.Fatalf("the slow rows were tried %d times in 10 s", tr.slow.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	for i := 0; time.Since(start) < 4*time.Second; i++ {
		m := r.msg("fresh" + strconv.Itoa(i))
		m.Publishing.MessageId = "fresh" + strconv.Itoa(i)
		r.write(true, m)
		time.Sleep(100 * time.Millisecond)
	}
	stop()
	mu.Lock()
	defer mu.Unlock()
	t.Logf("slow publishes %d; %d marks of fresh rows; least claim left at a mark: %v of ClaimTTL %v", tr.slow.Load(), marks,
		minLeft, claimTTL)
	if marks == 0 {
		t.Fatal("no mark of fresh rows seen: the reproduction did not reproduce")
	}
	if minLeft < claimTTL/3 {
		t.Errorf("fresh rows confirmed early in their round reached their mark with %v of their %v claim left, less than the "+
			"third of ClaimTTL markSent may take: the known-slow rows published one at a time after them held the mark back; "+
			"a later mark try lands after the claim, when another relay may have published them again", minLeft, claimTTL)
	}
}
