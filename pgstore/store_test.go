package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/internal/storetest"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// schema makes a schema of its own for t, migrated for cfg (whose Schema
// it sets), and drops it in t.Cleanup.
func schema(t *testing.T, pool *pgxpool.Pool, cfg pgstore.Config) pgstore.Config {
	t.Helper()
	cfg.Schema = strings.ToLower(testenv.Name(t))
	if err := pgstore.Migrate(context.Background(), pool, cfg); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", cfg.Schema, err)
		}
	})
	return cfg
}

// newStore returns a Store on cfg, closed in t.Cleanup.
func newStore(t *testing.T, pool *pgxpool.Pool, cfg pgstore.Config) *pgstore.Store {
	t.Helper()
	s, err := pgstore.New(pool, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(s.Close)
	return s
}

func TestConformance(t *testing.T) {
	pool := pgenv.Pool(t, 16)
	base := schema(t, pool, pgstore.Config{})
	storetest.Run(t, func(t *testing.T, cfg lock.Config) lock.Store {
		c := base
		c.Config = cfg
		c.CleanupInterval = -1
		return newStore(t, pool, c)
	})
}

// TestConformanceWithCleanup runs the suite with a cleanup deleting
// expired records every few milliseconds, so that records are lost (and
// made again) in the middle of the suite's sequences as well.
func TestConformanceWithCleanup(t *testing.T) {
	pgstore.SetCleanupGrace(t, 0)
	pool := pgenv.Pool(t, 16)
	base := schema(t, pool, pgstore.Config{Table: "records_cleaned"})
	storetest.Run(t, func(t *testing.T, cfg lock.Config) lock.Store {
		c := base
		c.Config = cfg
		c.CleanupInterval = 5 * time.Millisecond
		c.CleanupBatch = 3
		return newStore(t, pool, c)
	})
}

func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	pool := pgenv.Pool(t, 8)
	cfg := schema(t, pool, pgstore.Config{Table: "twice"})
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() { errs[i] = pgstore.Migrate(context.Background(), pool, cfg) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("Migrate %d: %v", i, err)
		}
	}
	if err := newStore(t, pool, cfg).Check(context.Background()); err != nil {
		t.Fatalf("Check after Migrate: %v", err)
	}
}

func TestNotMigrated(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{})
	cfg.Table = "never_migrated"
	s := newStore(t, pool, cfg)
	err := s.Check(context.Background())
	if err == nil || !strings.Contains(err.Error(), "pgstore.Migrate") {
		t.Fatalf("Check: got %v, want an error that says to run pgstore.Migrate", err)
	}
	_, err = s.Acquire(context.Background(), lock.Request{Key: "k"})
	if !errors.Is(err, lock.ErrUnavailable) || !strings.Contains(err.Error(), "pgstore.Migrate") {
		t.Fatalf("Acquire: got %v, want ErrUnavailable saying to run pgstore.Migrate", err)
	}
}

func TestCheckWrongFormat(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{})
	if _, err := pool.Exec(context.Background(), "COMMENT ON TABLE "+pgx.Identifier{cfg.Schema, pgstore.DefaultTable}.Sanitize()+" IS 'amqpidem pgstore records, format 99'"); err != nil {
		t.Fatal(err)
	}
	err := newStore(t, pool, cfg).Check(context.Background())
	if err == nil || !strings.Contains(err.Error(), "format 99") {
		t.Fatalf("Check: got %v, want an error naming the table's format", err)
	}
}

func TestMigrationSQLIsPlainSQL(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(t)), Table: `odd "name"`}
	sql, err := pgstore.MigrationSQL(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	// Applied as a DBA would: the text alone, through psql or any tool.
	if _, err := pool.Exec(context.Background(), sql); err != nil {
		t.Fatalf("applying MigrationSQL: %v", err)
	}
	s := newStore(t, pool, cfg)
	if err := s.Check(context.Background()); err != nil {
		t.Fatalf("Check: %v", err)
	}
	res, err := s.Acquire(context.Background(), lock.Request{Key: "k"})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %+v, %v", res, err)
	}
}

func TestConfigValidate(t *testing.T) {
	bad := []pgstore.Config{
		{Table: strings.Repeat("t", 51)},
		{Table: "a\x00b"},
		{Schema: strings.Repeat("s", 64)},
		{CleanupBatch: -1},
		{Config: lock.Config{LeaseTTL: -time.Second}},
	}
	for _, c := range bad {
		if err := c.Validate(); err == nil {
			t.Errorf("Validate(%+v): nil, want an error", c)
		}
		if _, err := pgstore.New(&pgxpool.Pool{}, c); err == nil {
			t.Errorf("New(%+v): nil error", c)
		}
	}
	if _, err := pgstore.New(nil, pgstore.Config{}); err == nil {
		t.Error("New(nil pool): nil error")
	}
}

// rows counts the records of cfg's table.
func rows(t *testing.T, pool *pgxpool.Pool, cfg pgstore.Config) int {
	t.Helper()
	table := cfg.Table
	if table == "" {
		table = pgstore.DefaultTable
	}
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{cfg.Schema, table}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestCleanupDeletesExpiredInBatches(t *testing.T) {
	pgstore.SetCleanupGrace(t, 0)
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1, CleanupBatch: 7})
	s := newStore(t, pool, cfg)
	ctx := context.Background()
	for i := range 30 {
		key := "short-" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		res, err := s.Acquire(ctx, lock.Request{Key: key, Retention: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, res.Lease, []byte("done")); err != nil {
			t.Fatal(err)
		}
	}
	for _, key := range []string{"long-done", "long-held"} {
		res, err := s.Acquire(ctx, lock.Request{Key: key, TTL: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		if key == "long-done" {
			if err := s.Complete(ctx, res.Lease, nil); err != nil {
				t.Fatal(err)
			}
		}
	}
	time.Sleep(100 * time.Millisecond)
	n, err := s.Cleanup(ctx)
	if err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if n != 30 {
		t.Fatalf("Cleanup deleted %d records, want the 30 expired ones", n)
	}
	if got := rows(t, pool, cfg); got != 2 {
		t.Fatalf("%d records left, want the 2 live ones", got)
	}
	if n, err := s.Cleanup(ctx); err != nil || n != 0 {
		t.Fatalf("second Cleanup: %d, %v; want 0, nil", n, err)
	}
}

func TestBackgroundCleanupStopsOnClose(t *testing.T) {
	pgstore.SetCleanupGrace(t, 0)
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: 20 * time.Millisecond})
	s, err := pgstore.New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k", Retention: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, res.Lease, nil); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for rows(t, pool, cfg) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the background cleanup did not delete the expired record within 5s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.Close()
	s.Close() // a second Close is harmless
	res, err = s.Acquire(ctx, lock.Request{Key: "k2", Retention: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, res.Lease, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if got := rows(t, pool, cfg); got != 1 {
		t.Fatalf("after Close: %d records, want 1 (no cleanup any more)", got)
	}
}

// TestFenceAboveDeletedRecord: a record deleted by the cleanup and made
// again hands out a higher fence (from the clock), as after a lost Redis
// record.
func TestFenceAboveDeletedRecord(t *testing.T) {
	pgstore.SetCleanupGrace(t, 0)
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	s := newStore(t, pool, cfg)
	ctx := context.Background()
	var last int64
	for range 3 {
		res, err := s.Acquire(ctx, lock.Request{Key: "k", Retention: time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		last = res.Lease.Fence
		if err := s.Release(ctx, res.Lease); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(10 * time.Millisecond)
	if n, err := s.Cleanup(ctx); err != nil || n != 1 {
		t.Fatalf("Cleanup: %d, %v", n, err)
	}
	res, err := s.Acquire(ctx, lock.Request{Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if res.Lease.Attempt != 1 || res.Lease.Fence <= last {
		t.Fatalf("after the cleanup: attempt %d fence %d; want attempt 1 and a fence above %d", res.Lease.Attempt, res.Lease.Fence, last)
	}
}

// TestKeysAreBytes: keys are any bytes, as the lock package promises: a
// NUL byte or invalid UTF-8 is a key like any other.
func TestKeysAreBytes(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	s := newStore(t, pool, schema(t, pool, pgstore.Config{CleanupInterval: -1}))
	ctx := context.Background()
	for _, key := range []string{"a\x00b", "a\x00c", "\xff\xfe", strings.Repeat("k", lock.MaxKeyLen)} {
		res, err := s.Acquire(ctx, lock.Request{Key: key, Fingerprint: "\x00\xff"})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire(%q): %+v, %v", key, res, err)
		}
		if err := s.Complete(ctx, res.Lease, []byte(key)); err != nil {
			t.Fatalf("Complete(%q): %v", key, err)
		}
		res, err = s.Acquire(ctx, lock.Request{Key: key})
		if err != nil || res.Status != lock.Completed || string(res.Value) != key {
			t.Fatalf("Acquire(%q) again: %+v, %v", key, res, err)
		}
	}
}

// TestUnavailable: a closed pool (as a database that cannot be reached) is
// lock.ErrUnavailable, for every call.
func TestUnavailable(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	other, err := pgxpool.NewWithConfig(context.Background(), pool.Config())
	if err != nil {
		t.Fatal(err)
	}
	s := newStore(t, other, cfg)
	res, err := s.Acquire(context.Background(), lock.Request{Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	other.Close()
	if _, err := s.Acquire(context.Background(), lock.Request{Key: "k2"}); !errors.Is(err, lock.ErrUnavailable) {
		t.Errorf("Acquire: %v, want ErrUnavailable", err)
	}
	if err := s.Complete(context.Background(), res.Lease, nil); !errors.Is(err, lock.ErrUnavailable) {
		t.Errorf("Complete: %v, want ErrUnavailable", err)
	}
	if errs := s.Extend(context.Background(), res.Lease); !errors.Is(errs[0], lock.ErrUnavailable) {
		t.Errorf("Extend: %v, want ErrUnavailable", errs[0])
	}
	if err := s.Amend(context.Background(), "k", res.Lease.Fence, nil, []byte("v")); !errors.Is(err, lock.ErrUnavailable) {
		t.Errorf("Amend: %v, want ErrUnavailable", err)
	}
	if err := s.Check(context.Background()); !errors.Is(err, lock.ErrUnavailable) {
		t.Errorf("Check: %v, want ErrUnavailable", err)
	}
}

// TestCleanupKeepsRecentlyExpired: a record is deleted only a while after
// it expired (it is absent for Acquire at once), so that its fence still
// counts for a slow Acquire making it again.
func TestCleanupKeepsRecentlyExpired(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	s := newStore(t, pool, cfg)
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k", Retention: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, res.Lease); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if n, err := s.Cleanup(ctx); err != nil || n != 0 {
		t.Fatalf("Cleanup right after expiry: %d, %v; want 0 deleted (the grace)", n, err)
	}
	again, err := s.Acquire(ctx, lock.Request{Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if again.Lease.Attempt != 1 || again.Lease.Fence <= res.Lease.Fence {
		t.Fatalf("after expiry: attempt %d fence %d, want a new record (attempt 1) above fence %d", again.Lease.Attempt, again.Lease.Fence, res.Lease.Fence)
	}
}

// lockRow holds the row of key in an open transaction until the test ends,
// as a TxHandler whose COMMIT hangs (a synchronous standby gone) would.
func lockRow(t *testing.T, pool *pgxpool.Pool, cfg pgstore.Config, key string) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	tag, err := tx.Exec(ctx, "SELECT 1 FROM "+pgx.Identifier{cfg.Schema, pgstore.DefaultTable}.Sanitize()+" WHERE key = $1 FOR UPDATE", []byte(key))
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("locking %q: %v, %v", key, tag, err)
	}
}

// TestLockedRecordIsUnavailable: a record row held by a transaction that
// does not end makes Acquire and Release fail as unavailable after a
// bounded wait, and does not hold up the renewal of other leases.
func TestLockedRecordIsUnavailable(t *testing.T) {
	pool := pgenv.Pool(t, 8)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	s := newStore(t, pool, cfg)
	ctx := context.Background()
	stuck, err := s.Acquire(ctx, lock.Request{Key: "stuck", TTL: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	free, err := s.Acquire(ctx, lock.Request{Key: "free"})
	if err != nil {
		t.Fatal(err)
	}
	lockRow(t, pool, cfg, "stuck")
	time.Sleep(100 * time.Millisecond) // stuck's lease expires: a takeover would update its row

	start := time.Now()
	errs := s.Extend(ctx, stuck.Lease, free.Lease)
	if took := time.Since(start); took > time.Second {
		t.Errorf("Extend waited %v for the locked row", took)
	}
	if !errors.Is(errs[0], lock.ErrUnavailable) || errs[1] != nil {
		t.Fatalf("Extend: %v; want [unavailable (locked, not lost), nil]", errs)
	}

	start = time.Now()
	_, err = s.Acquire(ctx, lock.Request{Key: "stuck"})
	if took := time.Since(start); !errors.Is(err, lock.ErrUnavailable) || took > 10*time.Second {
		t.Fatalf("Acquire of the locked record: %v after %v; want unavailable within the lock timeout", err, took)
	}
	if err := s.Release(ctx, stuck.Lease); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Release of the locked record: %v, want unavailable", err)
	}
}

// TestMigrateRefusesOtherFormat: Migrate leaves a table of another format
// alone and says so, and Check refuses it.
func TestMigrateRefusesOtherFormat(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{})
	if _, err := pool.Exec(context.Background(), "COMMENT ON TABLE "+pgx.Identifier{cfg.Schema, pgstore.DefaultTable}.Sanitize()+" IS 'amqpidem pgstore records, format 0'"); err != nil {
		t.Fatal(err)
	}
	if err := pgstore.Migrate(context.Background(), pool, cfg); err == nil || !strings.Contains(err.Error(), "format 0") {
		t.Fatalf("Migrate over a table of format 0: %v, want an error naming it", err)
	}
	if err := newStore(t, pool, cfg).Check(context.Background()); err == nil {
		t.Fatal("Check of a table of format 0: nil error")
	}
}

// TestExtendStaleAndCurrentLeaseOfOneKey: one batch holding a lease taken
// over and the lease that took it over renews the second only.
func TestExtendStaleAndCurrentLeaseOfOneKey(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	s := newStore(t, pool, schema(t, pool, pgstore.Config{CleanupInterval: -1}))
	ctx := context.Background()
	old, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	cur, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: time.Minute})
	if err != nil || cur.Status != lock.Acquired {
		t.Fatalf("takeover: %+v, %v", cur, err)
	}
	errs := s.Extend(ctx, old.Lease, cur.Lease, old.Lease)
	if !errors.Is(errs[0], lock.ErrLeaseLost) || errs[1] != nil || !errors.Is(errs[2], lock.ErrLeaseLost) {
		t.Fatalf("Extend(stale, current, stale): %v; want [lost, nil, lost]", errs)
	}
}

// TestAmendChangesTheValueAlone: Amend updates the value column of the
// row and nothing else: expires_at stays as the completion set it, to the
// microsecond.
func TestAmendChangesTheValueAlone(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	s := newStore(t, pool, cfg)
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k", Fingerprint: "fp", Retention: time.Hour})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %+v, %v", res, err)
	}
	if err := s.Complete(ctx, res.Lease, []byte("v0")); err != nil {
		t.Fatal(err)
	}
	row := func() (string, []byte) {
		t.Helper()
		var rest string
		var value []byte
		err := pool.QueryRow(ctx, `SELECT (ns, key, state, owner, fence, deadline, attempts, fingerprint,
				created_at, ended_at, expires_at)::text, value
			FROM `+pgx.Identifier{cfg.Schema, pgstore.DefaultTable}.Sanitize()+` WHERE key = $1`, []byte("k")).Scan(&rest, &value)
		if err != nil {
			t.Fatal(err)
		}
		return rest, value
	}
	before, _ := row()
	time.Sleep(20 * time.Millisecond) // a new expires_at would differ
	if err := s.Amend(ctx, "k", res.Lease.Fence, []byte("v0"), []byte("v1")); err != nil {
		t.Fatal(err)
	}
	after, value := row()
	if after != before || string(value) != "v1" {
		t.Fatalf("row after Amend: %s value %q, want %s value v1", after, value, before)
	}
}

// TestAmendLockedRecord: Amend of a row held by a transaction that does
// not end fails as unavailable after the lock timeout, and the lock
// timeout does not stay on the connection.
func TestAmendLockedRecord(t *testing.T) {
	pool := pgenv.Pool(t, 2) // one for lockRow's transaction, one for the rest
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	s := newStore(t, pool, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var fences []int64
	for _, key := range []string{"stuck", "free"} {
		res, err := s.Acquire(ctx, lock.Request{Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, res.Lease, []byte("v0")); err != nil {
			t.Fatal(err)
		}
		fences = append(fences, res.Lease.Fence)
	}
	lockRow(t, pool, cfg, "stuck")
	start := time.Now()
	err := s.Amend(ctx, "stuck", fences[0], []byte("v0"), []byte("v1"))
	if took := time.Since(start); !errors.Is(err, lock.ErrUnavailable) || took > 10*time.Second {
		t.Fatalf("Amend of the locked record: %v after %v; want unavailable within the lock timeout", err, took)
	}
	// A failed statement rolls its settings back; one that succeeds must
	// not leave its lock timeout either.
	if err := s.Amend(ctx, "free", fences[1], []byte("v0"), []byte("v1")); err != nil {
		t.Fatalf("Amend: %v", err)
	}
	var setting, reset string
	if err := pool.QueryRow(ctx, "SELECT setting, reset_val FROM pg_settings WHERE name = 'lock_timeout'").Scan(&setting, &reset); err != nil {
		t.Fatal(err)
	}
	if setting != reset {
		t.Fatalf("lock_timeout on the connection after Amend: %s ms, want the session's %s ms", setting, reset)
	}
}

// TestDropSQL: DropSQL removes every object Migrate created, and nothing
// else: its schema, holding a table of the application's, is left with
// only that table (issue 42, item 6).
func TestDropSQL(t *testing.T) {
	pool := pgenv.Pool(t, 2)
	cfg := schema(t, pool, pgstore.Config{})
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{cfg.Schema, "app"}.Sanitize()+" (id int)"); err != nil {
		t.Fatal(err)
	}
	objects := func() []string {
		rows, err := pool.Query(ctx, `
			SELECT c.relkind::text || ' ' || c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
			UNION ALL
			SELECT 'function ' || p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = $1
			ORDER BY 1`, cfg.Schema)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	// What Migrate's documentation lists (with the primary keys' indexes).
	want := "S amqpidem_outbox_id_seq, function amqpidem_records_acquire, function amqpidem_records_acquire_held, " +
		"function amqpidem_records_finish, function amqpidem_records_finish_held, function amqpidem_records_finish_tx, " +
		"function amqpidem_records_held_key, i amqpidem_outbox_dead, i amqpidem_outbox_dead_order, i amqpidem_outbox_keys_pkey, i amqpidem_outbox_order, " +
		"i amqpidem_outbox_pending, i amqpidem_outbox_pkey, i amqpidem_outbox_sent, i amqpidem_records_expires, " +
		"i amqpidem_records_pkey, r amqpidem_outbox, r amqpidem_outbox_keys, r amqpidem_records, r app"
	if got := strings.Join(objects(), ", "); got != want {
		t.Fatalf("after Migrate: %s\nwant %s", got, want)
	}
	sql, err := pgstore.DropSQL(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, sql); err != nil {
		t.Fatalf("DropSQL: %v\n%s", err, sql)
	}
	if got, want := strings.Join(objects(), ", "), "r app"; got != want {
		t.Fatalf("left after DropSQL: %s; want %s", got, want)
	}
	// Twice, and on a database never migrated: IF EXISTS.
	if _, err := pool.Exec(ctx, sql); err != nil {
		t.Fatalf("DropSQL again: %v", err)
	}
}
