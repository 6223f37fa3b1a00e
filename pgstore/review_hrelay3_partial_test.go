package pgstore_test

import (
	"bytes"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrelay3OneSlowRowHoldsNoOtherBack: one row whose publish always
// outlasts PublishTimeout (an 8 MiB body through a link of 8 MiB/s,
// against 100 ms) beside a stream of small rows (10 a second for 10 s)
// that the broker confirms at once. The broker is reachable, so the relay
// must not back off as if it were not: before, every round holding the
// slow row counted as a failure, and the relay's backoff (RetryBackoff
// doubled, up to MaxBackoff or 30 s) grew between all its rounds, so the
// small rows waited longer and longer. A round waits for its slowest
// publish (about a second here), so they may wait that: the bound is
// 4 s, under what the backoff reaches in 10 s (6.4 s; before, 5.97 s).
func TestHrelay3OneSlowRowHoldsNoOtherBack(t *testing.T) {
	if testing.Short() {
		t.Skip("10 s of a stream")
	}
	r := newOutboxRig(t)
	slow := r.msg("")
	slow.Publishing.MessageId = "slow"
	slow.Publishing.Body = bytes.Repeat([]byte{'s'}, 8<<20)
	r.write(true, slow)
	var log testenv.SyncBuffer
	t.Cleanup(func() {
		s := log.String()
		if len(s) > 4000 {
			s = s[len(s)-4000:]
		}
		t.Logf("relay log (its end):\n%s", s)
	})
	startRelay(t, r.ob, pgstore.RelayConfig{Dial: hrelay3SlowLink(t, 8<<20), PublishTimeout: 100 * time.Millisecond,
		RetryBackoff: 100 * time.Millisecond, MaxBackoff: time.Minute, PollInterval: 50 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	const n = 100
	var mu sync.Mutex
	sent := map[string]time.Time{}
	var waited []time.Duration
	done := make(chan struct{})
	go func() {
		defer close(done)
		deadline := time.Now().Add(n*100*time.Millisecond + 40*time.Second)
		for time.Now().Before(deadline) {
			mu.Lock()
			got := len(waited)
			mu.Unlock()
			if got == n {
				return
			}
			d, ok, err := r.ch.Get(r.queue, true)
			if err != nil {
				t.Error(err)
				return
			}
			if !ok {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			mu.Lock()
			if at, ok := sent[d.MessageId]; ok {
				waited = append(waited, time.Since(at))
				delete(sent, d.MessageId)
			}
			mu.Unlock()
		}
	}()
	for i := range n {
		m := r.msg(strconv.Itoa(i))
		m.Publishing.MessageId = "m" + strconv.Itoa(i)
		mu.Lock()
		sent[m.Publishing.MessageId] = time.Now()
		mu.Unlock()
		r.write(true, m)
		time.Sleep(100 * time.Millisecond)
	}
	<-done
	mu.Lock()
	defer mu.Unlock()
	if len(waited) != n {
		t.Fatalf("%d of %d small rows arrived", len(waited), n)
	}
	slices.Sort(waited)
	t.Logf("small rows from commit to arrival: p50 %v, p90 %v, max %v", waited[n/2], waited[n*9/10], waited[n-1])
	if waited[n-1] > 4*time.Second {
		t.Errorf("a small row waited %v beside one slow row (p90 %v): the relay backed off from a broker that confirmed",
			waited[n-1], waited[n*9/10])
	}
}
