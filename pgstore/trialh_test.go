package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// commitHolder, once armed, holds back the server's answer to the next
// COMMIT on a testenv.Proxy to PostgreSQL, as a network partition does:
// the transaction committed, and the client hears nothing until it gives
// up and closes the connection.
type commitHolder struct {
	mu    sync.Mutex
	armed bool
	held  chan struct{} // closed when an answer is held
}

func (p *commitHolder) arm() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.armed = true
	p.held = make(chan struct{})
}

func (p *commitHolder) down(server, client net.Conn) {
	buf := make([]byte, 64<<10)
	holding := false
	for {
		n, err := server.Read(buf)
		if n > 0 && !holding {
			p.mu.Lock()
			if p.armed && bytes.Contains(buf[:n], commitComplete) {
				p.armed = false
				holding = true
				close(p.held)
			}
			p.mu.Unlock()
			if !holding {
				if _, werr := client.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// TestTxHandlerCommitAnswerLateNotBlamedOnHandler: a TxHandler's function
// that only runs an INSERT and returns nil, whose commit (the work and the
// completed record, on a held lease) lands on the server but whose answer
// never comes back (found by h-trial with a SIGSTOPped TCP proxy in front of
// PostgreSQL), is done: the work and its record committed together.
// HandleComplete must say so (nil), or at worst that the outcome was
// unknown; it must not answer pgstore.ErrTxEnded ("the handler ended the
// transaction itself (a COMMIT or ROLLBACK statement ...) ... its record
// could not be completed"), which sends an operator hunting for a COMMIT
// the handler never ran, about a record that is completed. What happened
// on the current code: the answer's wait used up commitTimeout (10 s) of
// the one context that the record's write on its own (finishHeld) then
// ran with, so that write failed with "context deadline exceeded", and
// recordAfterCommit wrapped it in ErrTxEnded, Permanent.
func TestTxHandlerCommitAnswerLateNotBlamedOnHandler(t *testing.T) {
	if testing.Short() {
		t.Skip("waits the commit timeout (10 s)")
	}
	for _, redelivered := range []bool{false, true} {
		// A first delivery's lease is held by the handler's transaction;
		// a redelivery's is a lease row.
		t.Run(map[bool]string{false: "held", true: "row"}[redelivered], func(t *testing.T) {
			direct, store, cfg, effects, hold := lateCommitStore(t)
			ctx := context.Background()
			h := store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (msg_id) VALUES ($1)", d.MessageId)
				return nil, err
			}).(amqpidem.LeaseTaker)
			key := "late-commit"
			res, err := h.AcquireLease(ctx, lock.Request{Key: key, TTL: 30 * time.Second}, &amqp.Delivery{Redelivered: redelivered})
			if err != nil || res.Status != lock.Acquired {
				t.Fatalf("AcquireLease: %+v, %v", res, err)
			}
			hold.arm()
			_, err = h.HandleComplete(ctx, &amqp.Delivery{MessageId: key}, res.Lease, same)
			select {
			case <-hold.held:
			default:
				t.Fatalf("HandleComplete answered %v without its COMMIT's answer being held", err)
			}
			var rows, completed int
			if err := direct.QueryRow(ctx, "SELECT count(*) FROM "+effects).Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if err := direct.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{cfg.Schema, "amqpidem_records"}.Sanitize()+" WHERE state = 'c'").Scan(&completed); err != nil {
				t.Fatal(err)
			}
			if rows != 1 || completed != 1 {
				t.Fatalf("after the held COMMIT: %d effect rows, %d completed records; want 1 and 1 (the commit landed)", rows, completed)
			}
			if errors.Is(err, pgstore.ErrTxEnded) {
				t.Fatalf("HandleComplete blames the handler for a commit whose answer was late: %v\n"+
					"want nil (the work and its record committed, as the server says), or an outcome-unknown error; "+
					"the handler ran no COMMIT and the record is completed", err)
			}
			if err != nil {
				t.Fatalf("HandleComplete: %v; want nil: the work and its record committed together", err)
			}
		})
	}
}

// TestRelayUnreachableDatabaseNotCalledPoolBusy: when the relay's database
// does not answer (a network partition: connections are accepted and never
// answered, as through h-trial's SIGSTOPped TCP proxy), the relay's log
// must say that the database did not answer, not that the pool had no
// connection free: h-trial saw "claim: no connection of the pool free
// within 5s (1 of its MaxConns 12 in use, by the relay or others)", which
// sends an operator to raise pool_max_conns or hunt for a leak while the
// pool had 11 connections to spare and the fault was the network.
func TestRelayUnreachableDatabaseNotCalledPoolBusy(t *testing.T) {
	r := newOutboxRig(t)
	pgstore.SetPoolWait(t, 300*time.Millisecond)
	u, err := url.Parse(pgenv.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	blackHole := func(from, _ net.Conn) { _, _ = io.Copy(io.Discard, from) }
	proxy := testenv.StartProxy(t, u.Host, blackHole, nil)
	pcfg, err := pgxpool.ParseConfig(proxy.URL(t, u.String()))
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	var log testenv.SyncBuffer
	startRelay(t, ob, pgstore.RelayConfig{PollInterval: 50 * time.Millisecond, RetryBackoff: 50 * time.Millisecond,
		Logger: logTo(&log)}, nil)
	waitLog(t, &log, "relay: claim", 10*time.Second)
	var claim string
	for _, l := range strings.Split(log.String(), "\n") {
		if strings.Contains(l, "relay: claim") {
			claim = l
			break
		}
	}
	if strings.Contains(claim, "no connection of the pool free") {
		t.Fatalf("with the database not answering and no connection of the pool in use, the relay logs:\n%s\n"+
			"want a line that says the database did not answer (connecting timed out), not that the pool was busy", claim)
	}
}

// blackHolePool returns a pool of at most maxConns connections to
// PostgreSQL through a proxy that accepts connections and never answers
// (a hung server, or a partition behind a middlebox that keeps the TCP
// connection). The proxy's cleanup closes its connections, which unblocks
// what still waits on them.
func blackHolePool(t *testing.T, maxConns int32) *pgxpool.Pool {
	t.Helper()
	blackHole := func(from, _ net.Conn) { _, _ = io.Copy(io.Discard, from) }
	return proxiedPool(t, maxConns, blackHole, nil)
}

// proxiedPool is a pool of maxConns connections to PostgreSQL through a
// proxy that copies each direction with up and down (nil: as is; see
// testenv.StartProxy), closed by the test's cleanup.
func proxiedPool(t *testing.T, maxConns int32, up, down func(from, to net.Conn)) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(pgenv.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	proxy := testenv.StartProxy(t, u.Host, up, down)
	pcfg, err := pgxpool.ParseConfig(proxy.URL(t, u.String()))
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// lateCommitStore is a Store whose pool goes through a proxy that can hold
// a COMMIT's answer (hold.arm), on a schema of its own with an effects
// table (msg_id), and a direct pool to look at them.
func lateCommitStore(t *testing.T) (direct *pgxpool.Pool, store *pgstore.Store, cfg pgstore.Config, effects string, hold *commitHolder) {
	t.Helper()
	direct = pgenv.Pool(t, 4)
	hold = &commitHolder{}
	proxied := proxiedPool(t, 4, nil, hold.down)
	cfg = schema(t, direct, pgstore.Config{CleanupInterval: -1})
	effects = pgx.Identifier{cfg.Schema, "effects"}.Sanitize()
	if _, err := direct.Exec(context.Background(), "CREATE TABLE "+effects+" (msg_id text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return direct, newStore(t, proxied, cfg), cfg, effects, hold
}

// TestStoreCallsBoundedWhenDatabaseHangs: the README's pattern,
// store.Check(context.Background()) before NewConsumer, and the Consumer's
// lease calls (Acquire, with the context the Consumer gives it, which has
// no deadline), return lock.ErrUnavailable within a bound when PostgreSQL
// accepts connections and never answers, as lock.RedisStore's do (go-redis
// times out reads after 3 s). h-trial saw, with a SIGSTOPped proxy in
// front of PostgreSQL: store.Check(ctx) never returned (no log line, the
// program stuck before NewConsumer), and a running consumer's deliveries
// stayed in Acquire for 35 s, with no log line, until Shutdown cancelled
// them: the consumer stalls silently, which at 3 a.m. looks like an idle
// queue. (The Consumer's own check at Run bounds itself to 5 s.) So are
// Cleanup and Count (h-rev3): the Store's own cleanup loop calls Cleanup
// with a context with no deadline, and held a pooled connection, and
// stopped cleaning up, for good, with no log line; Count's
// statement_timeout is the server's, which a hung server never applies.
func TestStoreCallsBoundedWhenDatabaseHangs(t *testing.T) {
	direct := pgenv.Pool(t, 4)
	cfg := schema(t, direct, pgstore.Config{CleanupInterval: -1})
	const bound = 15 * time.Second
	for _, call := range []struct {
		name string
		do   func(*pgstore.Store) error
	}{
		{"Check", func(s *pgstore.Store) error { return s.Check(context.Background()) }},
		{"Acquire", func(s *pgstore.Store) error {
			_, err := s.Acquire(context.Background(), lock.Request{Key: "hang", TTL: 5 * time.Second})
			return err
		}},
		{"Cleanup", func(s *pgstore.Store) error { _, err := s.Cleanup(context.Background()); return err }},
		{"Count", func(s *pgstore.Store) error {
			_, err := s.Count(context.Background(), lock.CountRequest{})
			return err
		}},
	} {
		t.Run(call.name, func(t *testing.T) {
			store := newStore(t, blackHolePool(t, 4), cfg)
			done := make(chan error, 1)
			go func() { done <- call.do(store) }()
			select {
			case err := <-done:
				if !errors.Is(err, lock.ErrUnavailable) {
					t.Fatalf("%s on a database that does not answer: %v; want lock.ErrUnavailable", call.name, err)
				}
			case <-time.After(bound):
				t.Fatalf("%s(context.Background()) on a database that accepts connections and never answers "+
					"has not returned after %v: a consumer (or the README's start-up check) hangs silently; "+
					"want lock.ErrUnavailable within a bound, as the Redis store gives", call.name, bound)
			}
		})
	}
}

// TestHeldSessionTerminatedNotCalledIdleTimeout: when an administrator (or
// a failover script) ends the session of a TxHandler's held lease with
// pg_terminate_backend, the error (logged for every message in flight)
// must not explain it as the server's idle-in-transaction timeout. h-trial
// saw, after `SELECT pg_terminate_backend(pid) ... WHERE application_name
// = 'trialh_pay'`: "the session holding the lease ended (the server ends
// one idle in its transaction longer than the lease's TTL): FATAL:
// terminating connection due to administrator command (SQLSTATE 57P01)",
// which sends an operator to the handler's idle time and the lease TTL
// when the cause is in the same line: 57P01. Give the explanation only
// for 25P03 (idle-in-transaction timeout), or say "for instance".
func TestHeldSessionTerminatedNotCalledIdleTimeout(t *testing.T) {
	direct := pgenv.Pool(t, 4)
	cfg := schema(t, direct, pgstore.Config{CleanupInterval: -1})
	store := newStore(t, direct, cfg)
	ctx := context.Background()
	h := store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		var pid int
		if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			return nil, err
		}
		if _, err := direct.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
			return nil, err
		}
		_, err := tx.Exec(ctx, "SELECT 1")
		return nil, err
	}).(amqpidem.LeaseTaker)
	res, err := h.AcquireLease(ctx, lock.Request{Key: "terminated", TTL: 30 * time.Second}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	_, err = h.HandleComplete(ctx, &amqp.Delivery{MessageId: "terminated"}, res.Lease, same)
	if err == nil {
		t.Fatal("HandleComplete after its session was terminated: nil error")
	}
	msg := err.Error()
	if strings.Contains(msg, "57P01") && strings.Contains(msg, "idle in its transaction longer than") {
		t.Fatalf("a session ended by pg_terminate_backend (57P01) is explained as the idle-in-transaction timeout:\n%v", err)
	}
}

// TestBatchTxHandlerCommitAnswerLateNotBlamedOnHandler is
// TestTxHandlerCommitAnswerLateNotBlamedOnHandler for a batch: the batch's
// commit (its work and its records) lands, its answer never comes back;
// every message is done, and none is answered pgstore.ErrTxEnded.
func TestBatchTxHandlerCommitAnswerLateNotBlamedOnHandler(t *testing.T) {
	if testing.Short() {
		t.Skip("waits the commit timeout (10 s)")
	}
	direct, store, cfg, effects, hold := lateCommitStore(t)
	ctx := context.Background()
	h := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if _, err := tx.Exec(ctx, "INSERT INTO "+effects+" (msg_id) VALUES ($1)", d.MessageId); err != nil {
				return nil, err
			}
		}
		return nil, nil
	}).(amqpidem.BatchCompleter)
	var items []amqpidem.BatchItem
	for _, key := range []string{"late-batch-1", "late-batch-2"} {
		res, err := store.Acquire(ctx, lock.Request{Key: key, TTL: 30 * time.Second})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("Acquire: %+v, %v", res, err)
		}
		items = append(items, amqpidem.BatchItem{Delivery: &amqp.Delivery{MessageId: key}, Lease: res.Lease})
	}
	hold.arm()
	rs, err := h.HandleBatchComplete(ctx, items, func(_ int, b []byte) ([]byte, error) { return b, nil })
	select {
	case <-hold.held:
	default:
		t.Fatalf("HandleBatchComplete answered %v, %v without its COMMIT's answer being held", rs, err)
	}
	var rows, completed int
	if err := direct.QueryRow(ctx, "SELECT count(*) FROM "+effects).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if err := direct.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{cfg.Schema, "amqpidem_records"}.Sanitize()+" WHERE state = 'c'").Scan(&completed); err != nil {
		t.Fatal(err)
	}
	if rows != 2 || completed != 2 {
		t.Fatalf("after the held COMMIT: %d effect rows, %d completed records; want 2 and 2 (the commit landed)", rows, completed)
	}
	if err != nil {
		t.Fatalf("HandleBatchComplete: %v; want nil: the batch's work and records committed together", err)
	}
	for i, r := range rs {
		if errors.Is(r.Err, pgstore.ErrTxEnded) {
			t.Fatalf("message %d blamed on the handler for a commit whose answer was late: %v", i, r.Err)
		}
		if r.Err != nil {
			t.Fatalf("message %d: %v; want nil: its work and record committed", i, r.Err)
		}
	}
}
