package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestInspectLocation: Location names the row in SQL that finds it, for
// keys of any bytes, and for a Store whose table is found through the
// search_path (an empty Config.Schema).
func TestInspectLocation(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	cfg.Prefix = "it's"
	onPath := cfg
	onPath.Schema = ""
	pc := pool.Config()
	pc.ConnConfig.RuntimeParams["search_path"] = cfg.Schema
	other, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)

	ctx := context.Background()
	for _, s := range []*pgstore.Store{newStore(t, pool, cfg), newStore(t, other, onPath)} {
		for _, key := range []string{"pay-1", "o'brien", `back\slash`, "a\x00b", "\xff\xfe", "naïve"} {
			res, err := s.Acquire(ctx, lock.Request{Key: key})
			if err != nil || res.Status != lock.Acquired && res.Status != lock.InProgress {
				t.Fatalf("Acquire(%q): %+v, %v", key, res, err)
			}
			r, err := s.Inspect(ctx, key)
			if err != nil {
				t.Fatalf("Inspect(%q): %v", key, err)
			}
			want := "postgres table " + pgx.Identifier{cfg.Schema, pgstore.DefaultTable}.Sanitize() + " ns='it''s' key="
			if !strings.HasPrefix(r.Location, want) {
				t.Fatalf("Inspect(%q): location %q, want it to start with %q", key, r.Location, want)
			}
			table, where, _ := strings.Cut(strings.TrimPrefix(r.Location, "postgres table "), " ")
			where = strings.Replace(where, " key=", " AND key=", 1)
			var fence int64
			if err := pool.QueryRow(ctx, "SELECT fence FROM "+table+" WHERE "+where).Scan(&fence); err != nil || fence != r.Fence {
				t.Fatalf("the row at %q: fence %d, %v; want %d", r.Location, fence, err, r.Fence)
			}
		}
	}
}

// TestAdminExpiredIsAbsent: a record past its retention, not yet deleted
// by Cleanup, is not found by Inspect nor Forget, as Acquire treats it.
func TestAdminExpiredIsAbsent(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	s := newStore(t, pool, schema(t, pool, pgstore.Config{CleanupInterval: -1}))
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k", Retention: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, res.Lease); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if _, err := s.Inspect(ctx, "k"); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Inspect of an expired record: %v, want ErrNotFound", err)
	}
	if err := s.Forget(ctx, "k", lock.StateReleased, res.Lease.Fence); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Forget of an expired record: %v, want ErrNotFound", err)
	}
	if _, err := s.Inspect(ctx, strings.Repeat("k", lock.MaxKeyLen+1)); !errors.Is(err, lock.ErrInvalidKey) {
		t.Fatalf("Inspect of a key too long: %v, want ErrInvalidKey", err)
	}
	if err := s.Forget(ctx, "", lock.StateReleased, 1); !errors.Is(err, lock.ErrInvalidKey) {
		t.Fatalf("Forget of an empty key: %v, want ErrInvalidKey", err)
	}
}

// TestForgetDeletedMeanwhile: a Forget that waits for the row of a
// record another transaction deletes answers ErrNotFound once that one
// commits, as if it came after it, not ErrChanged ("not the record seen"):
// its statement's snapshot still saw the record. Before, two concurrent
// Forgets of one record answered nil and ErrChanged.
func TestForgetDeletedMeanwhile(t *testing.T) {
	pool := pgenv.Pool(t, 3)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	cfg.Prefix = "gone"
	s := newStore(t, pool, cfg)
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k"})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %+v, %v", res, err)
	}
	if err := s.Complete(ctx, res.Lease, []byte("done")); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	table := pgx.Identifier{cfg.Schema, pgstore.DefaultTable}.Sanitize()
	if tag, err := tx.Exec(ctx, "DELETE FROM "+table+" WHERE ns = $1 AND key = $2", cfg.Prefix, []byte("k")); err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("delete the row in a transaction: %v, %v", tag, err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Forget(ctx, "k", lock.StateCompleted, res.Lease.Fence) }()
	select {
	case err := <-done:
		t.Fatalf("Forget did not wait for the row: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, lock.ErrNotFound) {
			t.Fatalf("Forget of a record deleted while it waited: %v, want ErrNotFound", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Forget still waiting 10 s after the deleting transaction committed")
	}
}

// TestForgetLockedRecord: Forget of a row held by a transaction that does
// not end fails as unavailable after the lock timeout, and Inspect does
// not wait for it; the lock timeout does not stay on the connection.
func TestForgetLockedRecord(t *testing.T) {
	pool := pgenv.Pool(t, 2) // one for lockRow's transaction, one for the rest
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	s := newStore(t, pool, cfg)
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "stuck"})
	if err != nil {
		t.Fatal(err)
	}
	lockRow(t, pool, cfg, "stuck")

	start := time.Now()
	if r, err := s.Inspect(ctx, "stuck"); err != nil || r.Fence != res.Lease.Fence || time.Since(start) > time.Second {
		t.Fatalf("Inspect of the locked record: %+v, %v after %v", r, err, time.Since(start))
	}
	start = time.Now()
	err = s.Forget(ctx, "stuck", lock.StateInProgress, res.Lease.Fence)
	if took := time.Since(start); !errors.Is(err, lock.ErrUnavailable) || took > 10*time.Second {
		t.Fatalf("Forget of the locked record: %v after %v; want unavailable within the lock timeout", err, took)
	}
	if _, err := s.Inspect(ctx, "stuck"); err != nil {
		t.Fatalf("Inspect after the failed Forget: %v, want the record still there", err)
	}

	free, err := s.Acquire(ctx, lock.Request{Key: "free"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Forget(ctx, "free", lock.StateInProgress, free.Lease.Fence); err != nil {
		t.Fatalf("Forget: %v", err)
	}
	var setting, reset string
	if err := pool.QueryRow(ctx, "SELECT setting, reset_val FROM pg_settings WHERE name = 'lock_timeout'").Scan(&setting, &reset); err != nil {
		t.Fatal(err)
	}
	if setting != reset {
		t.Fatalf("lock_timeout on the connection after Forget: %s ms, want the session's %s ms", setting, reset)
	}
}

func TestPing(t *testing.T) {
	pool := pgenv.Pool(t, 2)
	s := newStore(t, pool, schema(t, pool, pgstore.Config{CleanupInterval: -1}))
	if err := s.Ping(context.Background()); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	bad, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/test?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(bad.Close)
	down, err := pgstore.New(bad, pgstore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(down.Close)
	if err := down.Ping(context.Background()); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Ping of a database that is not there: got %v, want ErrUnavailable", err)
	}
}
