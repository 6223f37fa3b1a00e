package pgstore_test

import (
	"context"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// hrev12SlowTracer makes the publish of message "slow" outlast
// PublishTimeout: its StartPublish waits for the publish's context to end
// (a body too large for the link, a broker slow to confirm it), so that
// the publish gives up at once, without clogging the connection for the
// others as a slow link would. It counts those publishes.
type hrev12SlowTracer struct {
	nopTracer
	slow atomic.Int64
}

func (t *hrev12SlowTracer) StartPublish(ctx context.Context, p amqpidem.Publish) func(error) {
	if p.MessageID == "slow" {
		t.slow.Add(1)
		<-ctx.Done()
	}
	return nil
}

// hrev12SlowRow writes the row of message "slow" and returns its id.
func hrev12SlowRow(t *testing.T, r *outboxRig) int64 {
	t.Helper()
	slow := r.msg("slow")
	slow.Publishing.MessageId = "slow"
	r.write(true, slow)
	var id int64
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	if err := r.pool.QueryRow(context.Background(), "SELECT id FROM "+table+" WHERE message_id = 'slow'").Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// hrev12Tries returns the relay's warnings of publishes the broker did not
// take that name row id: one a try of it that failed.
func hrev12Tries(log string, id int64) []string {
	re := regexp.MustCompile(fmt.Sprintf(`\(row ids ([0-9]+ )*%d[ )]`, id))
	var out []string
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "level=WARN") && re.MatchString(line) {
			out = append(out, line)
		}
	}
	return out
}

// hrev12RetryIn returns the retry_in of a warning line, or 0.
func hrev12RetryIn(line string) time.Duration {
	m := regexp.MustCompile(` retry_in=(\S+)`).FindStringSubmatch(line)
	if m == nil {
		return 0
	}
	d, _ := time.ParseDuration(m[1])
	return d
}

// hrev12Log keeps the end of a relay's log for the test's output.
func hrev12Log(t *testing.T, log *testenv.SyncBuffer) {
	t.Cleanup(func() {
		s := log.String()
		if len(s) > 4000 {
			s = s[len(s)-4000:]
		}
		t.Logf("relay log (its end):\n%s", s)
	})
}

// TestHrev12LoneSlowRowBacksRelayOff: one row whose publish always
// outlasts PublishTimeout, and no other traffic (a quiet hour). Each of
// its rounds holds only that row, so nothing of the round was confirmed:
// 0b8bfce treats it as a broker that cannot be reached, and the relay's
// backoff (RetryBackoff doubled, up to MaxBackoff or 30 s) grows round
// after round, during which a notification does not wake it: a message
// written then waits out the rest of the backoff (up to 30 s) though the
// broker confirms it at once. The row is one the relay has already seen
// time out: its own wait may grow, the relay's must not. Checked on the
// logged retry_in (computed, not measured: a loaded machine only makes
// fewer rounds): at most 4 times RetryBackoff.
func TestHrev12LoneSlowRowBacksRelayOff(t *testing.T) {
	r := newOutboxRig(t)
	id := hrev12SlowRow(t, r)
	var log testenv.SyncBuffer
	hrev12Log(t, &log)
	const backoff = 100 * time.Millisecond
	tr := &hrev12SlowTracer{}
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Tracer: tr, PublishTimeout: 100 * time.Millisecond,
		RetryBackoff: backoff, MaxBackoff: time.Minute, PollInterval: 50 * time.Millisecond, Logger: logTo(&log)}, nil)
	time.Sleep(6 * time.Second)
	// What it costs: a message written now waits out the relay's backoff.
	written := time.Now()
	small := r.msg("small")
	small.Publishing.MessageId = "small"
	r.write(true, small)
	for deadline := time.Now().Add(40 * time.Second); ; {
		d, ok, err := r.ch.Get(r.queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok && d.MessageId == "small" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the small message did not arrive within 40 s")
		}
		if !ok {
			time.Sleep(5 * time.Millisecond)
		}
	}
	t.Logf("a small message written after 6 s of the lone slow row arrived %v after its commit", time.Since(written))
	stop()
	tries := hrev12Tries(log.String(), id)
	if len(tries) < 2 {
		t.Fatalf("%d failed tries of the slow row logged: the reproduction did not reproduce", len(tries))
	}
	var most time.Duration
	for _, line := range tries[1:] { // the first: the relay could not know the row
		most = max(most, hrev12RetryIn(line))
	}
	t.Logf("%d failed tries of the slow row; the relay's longest backoff after one it had seen before: %v", len(tries), most)
	if most > 4*backoff {
		t.Errorf("the relay backed off %v (RetryBackoff %v) from a round whose only failure was a row it had seen "+
			"time out before: the broker is reachable, and every other message waits out that backoff", most, backoff)
	}
}

// TestHrev12SlowRowTriesGrow: one row whose publish always outlasts
// PublishTimeout beside a stream of small rows the broker confirms, so
// that the relay never backs off (0b8bfce). A timeout is not a refusal
// (a slow broker gives the same error), so the row is tried for good; but
// each try copies its body to the queue (the broker took it after the
// relay gave up), and before, it was tried every RetryBackoff. Its wait
// between tries must grow: RetryBackoff doubled after each timeout (less
// at most 20%, were it jittered), so that within a window W at most
// 1 + log2(W/(0.8 RetryBackoff) + 1) tries fit (a loaded machine only
// makes fewer), plus one of margin.
func TestHrev12SlowRowTriesGrow(t *testing.T) {
	r := newOutboxRig(t)
	id := hrev12SlowRow(t, r)
	var log testenv.SyncBuffer
	hrev12Log(t, &log)
	const backoff = 100 * time.Millisecond
	tr := &hrev12SlowTracer{}
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Tracer: tr, PublishTimeout: 100 * time.Millisecond,
		RetryBackoff: backoff, MaxBackoff: time.Minute, PollInterval: 50 * time.Millisecond, Logger: logTo(&log)}, nil)
	const window = 8 * time.Second
	start := time.Now()
	for i := 0; time.Since(start) < window; i++ {
		m := r.msg(strconv.Itoa(i))
		m.Publishing.MessageId = "m" + strconv.Itoa(i)
		r.write(true, m)
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	elapsed := time.Since(start)
	tries := hrev12Tries(log.String(), id)
	if n := tr.slow.Load(); n != int64(len(tries)) {
		t.Logf("%d publishes of the slow row, %d failed tries logged", n, len(tries))
	}
	bound := 2 + int(math.Log2(float64(elapsed)/(0.8*float64(backoff))+1))
	t.Logf("the slow row failed %d tries in %v (bound %d)", len(tries), elapsed, bound)
	if len(tries) < 2 {
		t.Fatalf("%d failed tries of the slow row logged: the reproduction did not reproduce", len(tries))
	}
	if len(tries) > bound {
		t.Errorf("the slow row was tried %d times in %v, each a copy of its body in the queue: want at most %d, "+
			"its wait doubled from RetryBackoff %v after each timeout", len(tries), elapsed, bound, backoff)
	}
}

// hrev12HungTracer makes every publish outlast PublishTimeout: a broker
// that has blocked its publishers (a memory alarm) or a dial that hangs.
type hrev12HungTracer struct{ hrev12SlowTracer }

func (*hrev12HungTracer) StartPublish(ctx context.Context, _ amqpidem.Publish) func(error) {
	<-ctx.Done()
	return nil
}

// TestHrev12AllTimeoutsStillBackOff: with every publish timing out (a
// blocked broker) and a backlog larger than a claim, the relay's rounds
// alternate between rows it has seen time out (due again after their own
// wait, claimed first: lowest ids) and rows new to it. A round of only the
// former is not backed off from (TestHrev12LoneSlowRowBacksRelayOff), but
// it must not end the run of failed rounds either: else the relay's
// backoff never grows past RetryBackoff, and a blocked broker gets a
// round of Batch publishes every RetryBackoff. Checked on the logged
// retry_in (computed, not measured): it must reach 3 times RetryBackoff.
func TestHrev12AllTimeoutsStillBackOff(t *testing.T) {
	r := newOutboxRig(t)
	var msgs []pgstore.Message
	for i := range 40 {
		m := r.msg(strconv.Itoa(i))
		m.Publishing.MessageId = "m" + strconv.Itoa(i)
		msgs = append(msgs, m)
	}
	r.write(true, msgs...)
	var log testenv.SyncBuffer
	hrev12Log(t, &log)
	const backoff = 100 * time.Millisecond
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Tracer: &hrev12HungTracer{}, PublishTimeout: 100 * time.Millisecond,
		Batch: 4, Concurrency: 4, ClaimTTL: 2 * time.Second,
		RetryBackoff: backoff, MaxBackoff: time.Minute, PollInterval: 50 * time.Millisecond, Logger: logTo(&log)}, nil)
	time.Sleep(6 * time.Second)
	stop()
	var most time.Duration
	rounds := 0
	for _, line := range strings.Split(log.String(), "\n") {
		if strings.Contains(line, "relay: publish ") {
			rounds++
			most = max(most, hrev12RetryIn(line))
		}
	}
	t.Logf("%d failed rounds in 6 s; the relay's longest backoff %v", rounds, most)
	if rounds < 4 {
		t.Fatalf("%d failed rounds logged: the reproduction did not reproduce", rounds)
	}
	if most < 3*backoff {
		t.Errorf("the relay's backoff grew to %v at most (RetryBackoff %v) though every publish timed out for 6 s: "+
			"its rounds of rows seen to time out before ended each run of failed rounds", most, backoff)
	}
}

// TestHrev12ShutdownCutsMixedRoundQuietly: Shutdown whose ctx ends while
// a round waits for one confirm (here a publish that would outlast a long
// PublishTimeout) after the broker confirmed the round's other message:
// the publish gives up (its row released), as Shutdown documents. That is
// no fault of the broker nor the database: the relay logs no warning of
// it, as for a round in which nothing was confirmed (Run mutes those once
// stopping). 0b8bfce logs a mixed round's error whatever the cause.
func TestHrev12ShutdownCutsMixedRoundQuietly(t *testing.T) {
	r := newOutboxRig(t)
	hrev12SlowRow(t, r)
	small := r.msg("small")
	small.Publishing.MessageId = "small"
	r.write(true, small)
	var log testenv.SyncBuffer
	hrev12Log(t, &log)
	tr := &hrev12SlowTracer{}
	rl, err := pgstore.NewRelay(r.ob, pgstore.RelayConfig{URL: testenv.AMQPURL(t), Tracer: tr, PublishTimeout: time.Minute,
		ClaimTTL: 3 * time.Minute, PollInterval: 50 * time.Millisecond, Logger: logTo(&log)})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rl.Run(context.Background()) }()
	t.Cleanup(func() { _ = rl.Shutdown(context.Background()); <-done })
	for deadline := time.Now().Add(20 * time.Second); ; {
		d, ok, err := r.ch.Get(r.queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok && d.MessageId == "small" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the small message did not arrive within 20 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if tr.slow.Load() == 0 {
		t.Fatal("the slow row's publish has not started")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := rl.Shutdown(ctx); err == nil {
		t.Fatal("Shutdown returned nil: the round was not cut short, nothing to check")
	}
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
	done <- nil
	for _, line := range strings.Split(log.String(), "\n") {
		if strings.Contains(line, "level=WARN") {
			t.Errorf("a warning of a round Shutdown cut short: %s", line)
		}
	}
}
