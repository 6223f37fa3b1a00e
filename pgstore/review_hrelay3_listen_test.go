package pgstore_test

import (
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrelay3ListenHungDatabase: the database accepts the relay's
// listening connection and does not answer it (a proxy that stops
// copying). The listener must give up within its bound (shortened here),
// say so at warning level, and try again; before, it waited in silence
// for as long as the server's TCP stack answered, and notifications were
// lost without a word (the relay polls meanwhile). Once the database
// answers again, a commit's notification wakes the relay: it publishes
// well before its (long) poll.
func TestHrelay3ListenHungDatabase(t *testing.T) {
	r := newOutboxRig(t)
	pool, g := hrev9GatedPool(t)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	pgstore.SetListenWait(t, 300*time.Millisecond)
	var log testenv.SyncBuffer
	g.pause()
	startRelay(t, ob, pgstore.RelayConfig{PollInterval: time.Minute, RetryBackoff: 100 * time.Millisecond,
		MaxBackoff: 500 * time.Millisecond, Logger: logTo(&log)}, nil)
	t.Cleanup(g.resume) // before the relay's shutdown
	t.Cleanup(func() { t.Logf("relay log:\n%s", log.String()) })
	const within = 5 * time.Second
	deadline := time.Now().Add(within)
	for !hrelay3ListenWarned(log.String()) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if !hrelay3ListenWarned(log.String()) {
		t.Errorf("the relay's listening connection got no answer for %v: the relay logged nothing of it", within)
	}
	g.resume()
	// The listener connects on its next try, a second after its failure;
	// the relay's first claim, blocked meanwhile, is given up after
	// ClaimTTL less PublishTimeout (20 s) at most.
	time.Sleep(2 * time.Second)
	r.write(true, r.msg("woken"))
	start := time.Now()
	r.take(1, 30*time.Second)
	took := time.Since(start) - 300*time.Millisecond // take's check for more
	t.Logf("published %v after its commit", took)
	if took > 10*time.Second {
		t.Errorf("published %v after its commit: not woken by its notification (the poll is a minute)", took)
	}
}

// hrelay3ListenWarned reports whether log holds the relay's warning about
// its listening connection.
func hrelay3ListenWarned(log string) bool {
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "level=WARN") && strings.Contains(line, "listen for notifications") {
			return true
		}
	}
	return false
}
