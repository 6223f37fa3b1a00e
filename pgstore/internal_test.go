package pgstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
)

// TestAcquireRetriedWithSameOwner: an Acquire sent again with its own owner
// token (what Acquire does when an answer is lost) gets the same lease,
// not a second attempt, and a fresh deadline.
func TestAcquireRetriedWithSameOwner(t *testing.T) {
	s := testStore(t, pgenv.Pool(t, 4))
	ctx := context.Background()
	req, err := s.cfg.CheckRequest(lock.Request{Key: "k", TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	owner := lock.NewOwner()
	first, err := s.acquire(ctx, req, owner)
	if err != nil || first.Status != lock.Acquired {
		t.Fatalf("first: %+v, %v", first, err)
	}
	time.Sleep(50 * time.Millisecond)
	again, err := s.acquire(ctx, req, owner)
	if err != nil || again.Status != lock.Acquired {
		t.Fatalf("again: %+v, %v", again, err)
	}
	if again.Lease.Fence != first.Lease.Fence || again.Lease.Attempt != 1 {
		t.Fatalf("again: fence %d attempt %d, want the first lease (fence %d, attempt 1)", again.Lease.Fence, again.Lease.Attempt, first.Lease.Fence)
	}
	other, err := s.acquire(ctx, req, lock.NewOwner())
	if err != nil || other.Status != lock.InProgress || other.Remaining < 900*time.Millisecond {
		t.Fatalf("another owner: %+v, %v; want in progress with the renewed deadline (about 1s)", other, err)
	}
}

func TestClassify(t *testing.T) {
	cases := []struct {
		err         error
		unavailable bool
	}{
		{&pgconn.PgError{Code: "57P01"}, true}, // admin shutdown
		{&pgconn.PgError{Code: "08006"}, true}, // connection failure
		{&pgconn.PgError{Code: "53300"}, true}, // too many connections
		{&pgconn.PgError{Code: "40001"}, true}, // serialization failure
		{&pgconn.PgError{Code: "25006"}, true}, // read-only: a standby
		{&pgconn.PgError{Code: "42P01"}, true}, // not migrated
		{&pgconn.PgError{Code: "57014"}, true}, // statement timeout
		{&pgconn.PgError{Code: "25P03"}, true}, // idle-in-transaction timeout
		{&pgconn.ConnectError{Config: &pgconn.Config{}}, true},
		{&pgconn.PgError{Code: "23505"}, false},
		{&pgconn.PgError{Code: "22P02"}, false},
		{io.EOF, true},
		{fmt.Errorf("x: %w", pgconn.ErrConnClosed), true},
		{context.DeadlineExceeded, true},
		{context.Canceled, false},
		{errors.New("cannot encode"), false},
	}
	for _, tc := range cases {
		got := errors.Is(classify(tc.err), lock.ErrUnavailable)
		if got != tc.unavailable {
			t.Errorf("classify(%v): unavailable %v, want %v", tc.err, got, tc.unavailable)
		}
	}
}

// TestCleanupUsesIndex: the cleanup finds expired records through the index
// on expires_at, not by reading the whole table (a volatile clock in its
// condition would forbid the index).
func TestCleanupUsesIndex(t *testing.T) {
	pool := pgenv.Pool(t, 2)
	s := testStore(t, pool)
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	// On an empty table any plan is cheap; make the sequential scan the
	// last resort, as it is on a big table.
	if _, err := conn.Exec(ctx, "SET enable_seqscan = off"); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = conn.Exec(ctx, "RESET enable_seqscan") }()
	rows, err := conn.Query(ctx, "EXPLAIN "+s.sql.cleanup, 1000, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	text := strings.Join(lines, "\n")
	if !strings.Contains(text, "_expires") {
		t.Fatalf("the cleanup does not use the index on expires_at:\n%s", text)
	}
}

// testStore is a Store in a schema of the test's own, dropped afterwards.
func testStore(t *testing.T, pool *pgxpool.Pool) *Store {
	t.Helper()
	cfg := Config{Schema: strings.ToLower(testenv.Name(t)), CleanupInterval: -1}
	ctx := context.Background()
	if err := Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE") })
	s, err := New(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}
