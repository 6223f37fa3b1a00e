package pgstore_test

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// slowLastTracer makes the publish of message "slow" outlast
// PublishTimeout (it waits for its context to end) and counts the
// publishes of other messages that overlapped one of the slow row's
// after its first: on one connection, a body that fills the link holds
// back every message sent after it, which then times out too.
type slowLastTracer struct {
	nopTracer
	mu          sync.Mutex
	slowTries   int
	slowOn      bool // a publish of "slow" runs
	othersOn    int  // publishes of other messages running
	overlapping int  // other publishes running beside a later try of "slow"
}

// nopTracer is an amqpidem.PublishTracer's consumer side that does
// nothing, for tracers that only watch publishes.
type nopTracer struct{}

func (nopTracer) Start(ctx context.Context, _ string, _ *amqp.Delivery) context.Context { return ctx }
func (nopTracer) Inject(context.Context, amqp.Table)                                    {}
func (nopTracer) End(context.Context, amqpidem.Event)                                   {}
func (t *slowLastTracer) StartPublish(ctx context.Context, p amqpidem.Publish) func(error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p.MessageID == "slow" {
		t.slowTries++
		if t.slowTries > 1 && t.othersOn > 0 {
			t.overlapping += t.othersOn
		}
		t.slowOn = true
		t.mu.Unlock()
		<-ctx.Done()
		t.mu.Lock()
		t.slowOn = false
		return nil
	}
	if t.slowOn && t.slowTries > 1 {
		t.overlapping++
	}
	t.othersOn++
	return func(error) {
		t.mu.Lock()
		t.othersOn--
		t.mu.Unlock()
	}
}

// TestRelayPublishesKnownSlowRowsLast: a row whose publish timed out
// before is published in its round after the round's other messages were
// confirmed, so that on one connection its body cannot hold them back
// (time them out, and lock them into its growing wait: rows that timed
// out together stay due together). Rows are written in bursts, so that
// rounds hold the slow row with others.
func TestRelayPublishesKnownSlowRowsLast(t *testing.T) {
	r := newOutboxRig(t)
	hrev12SlowRow(t, r)
	var log testenv.SyncBuffer
	hrev12Log(t, &log)
	tr := &slowLastTracer{}
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Tracer: tr, PublishTimeout: 100 * time.Millisecond,
		RetryBackoff: 50 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, PollInterval: 20 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	start := time.Now()
	for i := 0; time.Since(start) < 3*time.Second; i++ {
		var ms []pgstore.Message
		for j := 0; j < 20; j++ {
			m := r.msg(strconv.Itoa(i*20 + j))
			m.Publishing.MessageId = "m" + strconv.Itoa(i*20+j)
			ms = append(ms, m)
		}
		r.write(true, ms...)
		time.Sleep(5 * time.Millisecond)
	}
	stop()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	t.Logf("slow row tried %d times; %d other publishes overlapped a later try of it", tr.slowTries, tr.overlapping)
	if tr.slowTries < 3 {
		t.Fatalf("the slow row was tried %d times: the reproduction did not reproduce", tr.slowTries)
	}
	if tr.overlapping > 0 {
		t.Errorf("%d publishes of other messages ran beside a try of the row known to be slow: on one connection its body "+
			"holds them back; want it published after its round's others", tr.overlapping)
	}
}

// stuckTracer stands for one connection that a body too large for its
// link fills: the publish of "slow" outlasts PublishTimeout, and so does
// a publish that starts while one of "slow" runs (sent behind its body);
// the first publish of "other" times out too (it was sent behind the
// body in the round both were first tried in). It counts the publishes
// of "other" started beside one of "slow".
type stuckTracer struct {
	nopTracer
	mu         sync.Mutex
	slowOn     int
	otherTries int
	beside     int
}

func (t *stuckTracer) StartPublish(ctx context.Context, p amqpidem.Publish) func(error) {
	t.mu.Lock()
	stuck := false
	switch p.MessageID {
	case "slow":
		t.slowOn++
		stuck = true
	case "other":
		t.otherTries++
		if t.otherTries > 1 {
			// Sent at once, its frames would beat the slow body
			// started a moment later on the link; give that body
			// its moment, as a real link's scheduling may.
			t.mu.Unlock()
			time.Sleep(20 * time.Millisecond)
			t.mu.Lock()
		}
		stuck = t.otherTries == 1 || t.slowOn > 0
		if t.otherTries > 1 && t.slowOn > 0 {
			t.beside++
		}
	}
	t.mu.Unlock()
	if stuck {
		<-ctx.Done()
	}
	if p.MessageID == "slow" {
		t.mu.Lock()
		t.slowOn--
		t.mu.Unlock()
	}
	return nil
}

// TestRelaySlowRowsOneAtATime: two rows that timed out together behind
// one slow body (due again together: their waits grow alike) are
// published one after the other in their next rounds, so that the one
// not at fault gets the link alone and is published, rather than sent
// behind the slow body round after round.
func TestRelaySlowRowsOneAtATime(t *testing.T) {
	r := newOutboxRig(t)
	hrev12SlowRow(t, r)
	other := r.msg("other")
	other.Publishing.MessageId = "other"
	r.write(true, other)
	var log testenv.SyncBuffer
	hrev12Log(t, &log)
	tr := &stuckTracer{}
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Tracer: tr, PublishTimeout: 100 * time.Millisecond,
		RetryBackoff: 50 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, PollInterval: 20 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	time.Sleep(3 * time.Second)
	stop()
	delivered := r.drain()["other"]
	tr.mu.Lock()
	defer tr.mu.Unlock()
	t.Logf("other tried %d times, %d of them beside a publish of the slow row; delivered %d times", tr.otherTries, tr.beside, delivered)
	if tr.otherTries < 2 {
		t.Fatalf("other was tried %d times: the reproduction did not reproduce", tr.otherTries)
	}
	if tr.beside > 0 || delivered == 0 {
		t.Errorf("other, which timed out once behind the slow row, was published %d times beside it and delivered %d times in 3s: "+
			"want it published alone, and delivered", tr.beside, delivered)
	}
}

// runTracer makes every publish of a message whose id starts with
// "slow" outlast PublishTimeout and counts the longest run of later tries
// of such messages (a first try is not known to be slow) with no publish
// of another message started between them.
type runTracer struct {
	nopTracer
	mu      sync.Mutex
	tries   map[string]int
	slow    int
	run     int
	longest int
	others  int
}

func (t *runTracer) StartPublish(ctx context.Context, p amqpidem.Publish) func(error) {
	t.mu.Lock()
	if !strings.HasPrefix(p.MessageID, "slow") {
		t.others++
		t.run = 0
		t.mu.Unlock()
		return nil
	}
	t.slow++
	t.tries[p.MessageID]++
	if t.tries[p.MessageID] > 1 {
		t.run++
		t.longest = max(t.longest, t.run)
	}
	t.mu.Unlock()
	<-ctx.Done()
	return nil
}

// TestRelayRoundTriesOneSlowRow: with several rows known to outlast
// PublishTimeout, a round tries them one at a time only until one of
// them times out (the rest wait for the next round), so that a round
// lasts about one PublishTimeout beyond its other publishes, as before
// the known-slow rows went one at a time, and rows written meanwhile are
// not held back for a PublishTimeout per slow row.
func TestRelayRoundTriesOneSlowRow(t *testing.T) {
	r := newOutboxRig(t)
	var slow []pgstore.Message
	for i := range 6 {
		m := r.msg("slow")
		m.Publishing.MessageId = "slow" + strconv.Itoa(i)
		slow = append(slow, m)
	}
	r.write(true, slow...)
	var log testenv.SyncBuffer
	hrev12Log(t, &log)
	tr := &runTracer{tries: map[string]int{}}
	_, stop := startRelay(t, r.ob, pgstore.RelayConfig{Tracer: tr, PublishTimeout: 200 * time.Millisecond,
		RetryBackoff: 50 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, PollInterval: 20 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	start := time.Now()
	for i := 0; time.Since(start) < 4*time.Second; i++ {
		m := r.msg(strconv.Itoa(i))
		m.Publishing.MessageId = "m" + strconv.Itoa(i)
		r.write(true, m)
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	t.Logf("%d publishes of slow rows, %d of others; longest run of later tries of slow rows with no other publish between: %d",
		tr.slow, tr.others, tr.longest)
	if tr.slow < 12 {
		t.Fatalf("%d publishes of slow rows: the reproduction did not reproduce", tr.slow)
	}
	if tr.longest > 2 {
		t.Errorf("%d tries of known-slow rows in a row, each a PublishTimeout, while rows written every 20 ms waited: want a round "+
			"to try its known-slow rows only until one times out", tr.longest)
	}
}
