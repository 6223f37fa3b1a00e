package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestCount: Count counts a prefix's records by state, the expired leases
// and the live ones with little left, leaving out other prefixes and
// namespaces; a count that waits longer than its budget (here behind a
// lock on the table) fails with lock.ErrCountBudget.
func TestCount(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1, Config: lock.Config{Prefix: "count"}})
	s := newStore(t, pool, cfg)
	otherNS := cfg
	otherNS.Prefix = "other"
	other := newStore(t, pool, otherNS)
	take := func(s *pgstore.Store, key string, ttl time.Duration) lock.Lease {
		res, err := s.Acquire(ctx, lock.Request{Key: key, TTL: ttl})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire(%q): %v %v", key, res.Status, err)
		}
		return res.Lease
	}
	for i := range 3 {
		if err := s.Complete(ctx, take(s, fmt.Sprintf("a/done-%d", i), time.Minute), []byte("ok")); err != nil {
			t.Fatal(err)
		}
		take(s, fmt.Sprintf("b/running-%d", i), time.Minute) // another prefix
		take(other, fmt.Sprintf("a/running-%d", i), time.Minute)
	}
	for i := range 2 {
		if err := s.Fail(ctx, take(s, fmt.Sprintf("a/failed-%d", i), time.Minute), "no"); err != nil {
			t.Fatal(err)
		}
	}
	take(s, "a/running", time.Minute)
	take(s, "a/low", 10*time.Second)
	take(s, "a/expired", 20*time.Millisecond)
	time.Sleep(50 * time.Millisecond)
	got, err := s.Count(ctx, lock.CountRequest{Prefix: "a/", LeaseBelow: 20 * time.Second, Budget: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := fmt.Sprint(got), "{map[completed:3 failed:2 in_progress:3] 1 1}"; got != want {
		t.Fatalf("Count: got %s, want %s", got, want)
	}

	// A lock on the table makes the count wait past its budget.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "LOCK TABLE "+pgx.Identifier{cfg.Schema, "amqpidem_records"}.Sanitize()+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = s.Count(ctx, lock.CountRequest{Prefix: "a/", Budget: 50 * time.Millisecond})
	if !errors.Is(err, lock.ErrCountBudget) {
		t.Fatalf("Count behind a lock: got %v, want ErrCountBudget", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Count behind a lock took %v for a budget of 50ms", d)
	}
}
