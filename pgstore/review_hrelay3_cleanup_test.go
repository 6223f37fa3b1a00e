package pgstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrelay3CleanupBlockedByLock: another session holds a lock on the
// outbox table (SHARE, as a CREATE INDEX without CONCURRENTLY takes) that
// the relay's cleanup DELETE waits for. The relay must say so, at warning
// level, within its bound (CleanupInterval, at least a floor shortened
// here), instead of waiting in silence with a pool connection held; once
// the lock is released, the expired rows are deleted.
func TestHrelay3CleanupBlockedByLock(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	const expired = 5
	if _, err := r.pool.Exec(ctx, `INSERT INTO `+table+` (message_id, message, state, created_at, sent_at)
		SELECT 'old-' || g, '\x00', 's', now() - interval '2 days', now() - interval '2 days'
		FROM generate_series(1, $1) g`, expired); err != nil {
		t.Fatal(err)
	}
	release := r.lockTable("SHARE")
	pgstore.SetCleanupFloor(t, 300*time.Millisecond)
	var log testenv.SyncBuffer
	t.Cleanup(func() { t.Logf("relay log:\n%s", log.String()) })
	start := time.Now()
	// ClaimTTL long: the claim, blocked by the lock too, warns only after
	// 50 s, so that what is logged here is the cleanup's.
	startRelay(t, r.ob, pgstore.RelayConfig{Retention: time.Hour, CleanupInterval: 200 * time.Millisecond,
		ClaimTTL: time.Minute, PollInterval: 50 * time.Millisecond, Logger: logTo(&log)}, nil)
	const within = 5 * time.Second
	deadline := time.Now().Add(within)
	for !hrelay3CleanupWarned(log.String()) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if !hrelay3CleanupWarned(log.String()) {
		t.Errorf("the relay's cleanup waited %v for a lock on the outbox table: the relay logged nothing of it", within)
	} else {
		t.Logf("the cleanup's warning came %v after the relay started", time.Since(start))
	}
	if n := r.count("s"); n != expired {
		t.Fatalf("%d sent rows while the lock is held, want %d", n, expired)
	}
	release()
	r.waitCount("s", 0, 10*time.Second)
}

// hrelay3CleanupWarned reports whether log holds a warning of the relay
// about its cleanup.
func hrelay3CleanupWarned(log string) bool {
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "level=WARN") && strings.Contains(line, "cleanup") {
			return true
		}
	}
	return false
}
