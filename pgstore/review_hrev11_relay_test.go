package pgstore_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// hrev11WaitingClaims counts the server's sessions that run a relay claim
// on r's outbox and wait for a lock: each is a connection slot of the
// server (max_connections), whatever the client's pool thinks of it.
func hrev11WaitingClaims(t *testing.T, r *outboxRig) int {
	t.Helper()
	var n int
	if err := r.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE wait_event_type = 'Lock' AND query LIKE '%SET claimed_by = $1%' AND query LIKE '%'||$1||'%'`,
		r.cfg.Schema).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestHrev11RelayClaimTimeoutLeavesNoServerSessions: a lock held on the
// outbox table (a migration, a CREATE INDEX, VACUUM FULL, an operator's
// LOCK TABLE) for several claims' bound. The relay gives each claim up
// after ClaimTTL less PublishTimeout (1909789), and pgx closes its
// connection: but the server does not look at a closed socket while its
// session waits for a lock, so the session stays, waiting, and runs the
// claim once the lock goes. Each backoff's new claim adds one more: with
// the defaults (a claim every 20 s plus up to 30 s of backoff) about 70
// server sessions an hour per relay, up to max_connections (100 by
// default), when the whole database refuses connections. Before the
// bound, the relay waited in one claim: one session. At most one
// session may wait for the lock on a relay's behalf.
func TestHrev11RelayClaimTimeoutLeavesNoServerSessions(t *testing.T) {
	r := newOutboxRig(t)
	var log testenv.SyncBuffer
	startRelay(t, r.ob, pgstore.RelayConfig{ClaimTTL: time.Second, PublishTimeout: 250 * time.Millisecond, Batch: 4, Concurrency: 4,
		PollInterval: 50 * time.Millisecond, RetryBackoff: 50 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	var ids []string
	ids = append(ids, r.write(true, r.msg("before"))...)
	r.waitCount("s", 1, 10*time.Second)

	release := r.lockTable("ACCESS EXCLUSIVE")
	var writer sync.WaitGroup
	var during []string
	writer.Add(1)
	go func() { // waits for the lock too
		defer writer.Done()
		during = r.write(true, r.msg("during"))
	}()
	// About six claims' bounds (750 ms each, 50-100 ms apart).
	most := 0
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); {
		most = max(most, hrev11WaitingClaims(t, r))
		time.Sleep(100 * time.Millisecond)
	}
	if most > 1 {
		t.Errorf("%d server sessions ran a claim of the relay and waited for the lock at once, want at most 1: each claim "+
			"given up at its bound (pgx closes the connection, sends no cancel request) left its session on the server, "+
			"waiting", most)
	}
	t.Logf("at most %d claim sessions waited for the lock", most)
	release()
	writer.Wait()
	ids = append(ids, during...)
	r.waitCount("s", 2, 20*time.Second)
	r.once(t, ids)
	if n := hrev11WaitingClaims(t, r); n != 0 {
		t.Errorf("%d claim sessions still wait after the lock was released", n)
	}
}
