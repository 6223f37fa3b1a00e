package pgstore_test

import (
	"bytes"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrelay3OneSlowRowHoldsNoOtherBack: one row whose publish always
// outlasts PublishTimeout (an 8 MiB body through a link of 8 MiB/s,
// against 100 ms) beside a stream of small rows (10 a second for 10 s)
// that the broker confirms. The broker is reachable, so a round in which
// it confirmed some messages and not the slow one must not be backed off
// from as if it were not: before, every such round counted as a failure,
// and the relay's backoff (RetryBackoff doubled, up to MaxBackoff or
// 30 s) grew between all its rounds, so the small rows waited longer and
// longer (up to 5.97 s, against 2.4 s after). The check is on the relay's
// log, not on the waits (logged), which a loaded machine stretches: no
// warning of such a mixed round carries a retry_in (its rows wait
// RetryBackoff, the relay none). A round in which nothing was confirmed
// (everything timed out behind the slow body on the one connection) is
// backed off from, as before.
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
	mixed, backedOff := 0, 0
	for _, line := range strings.Split(log.String(), "\n") {
		m := hrelay3Publish.FindStringSubmatch(line)
		if m == nil {
			continue // not a publish warning
		}
		failed, _ := strconv.Atoi(m[1])
		all, _ := strconv.Atoi(m[2])
		notTried, _ := strconv.Atoi(m[3]) // 0 when absent
		if all-failed-notTried == 0 {
			continue // nothing of its round confirmed (the rest not tried)
		}
		mixed++
		if strings.Contains(line, " retry_in=") {
			backedOff++
			t.Errorf("the relay backed off from a round whose other messages the broker confirmed: %s", line)
		}
	}
	if mixed == 0 {
		t.Skip("no round mixed confirmed messages with the slow one (each timed out whole): nothing to check")
	}
	t.Logf("%d rounds mixed confirmed messages with ones not taken, %d backed off from", mixed, backedOff)
}

// hrelay3Publish matches the relay's warning of a round's publishes the
// broker did not take: how many, of how many, and how many of the others
// were not tried (left for the next round).
var hrelay3Publish = regexp.MustCompile(`relay: publish (\d+) of (\d+) messages \(row ids [^)]*\)(?:, (\d+) not tried)?`)
