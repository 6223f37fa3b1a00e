//go:build linux

package chaos_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestRelayDumpRestore (issue 34, item 6): an ordered relay must go on
// publishing in each order key's order after the outbox moved to another
// PostgreSQL cluster by pg_dump and pg_restore, whose transaction id
// counter is far below the source's.
//
// A private source cluster burns transaction ids (dumpRestoreBurn) so that
// its counter is far above a fresh cluster's, then gets an outbox with
// messages of three order keys, one per transaction: the first
// dumpRestoreSent of each key published by an ordered relay and marked
// sent, the next dumpRestorePending left pending. The outbox's schema is
// dumped (pg_dump -Fc) and restored (pg_restore) into a second private
// cluster, fresh from initdb, whose counter is asserted to be far below the
// source's. On the restored copy dumpRestoreAfter more messages of each key
// are written, then an ordered relay is started there, and a consumer on
// the queue records every delivery, in the queue's order. Checked:
//
//   - every pending message, restored or written after the restore, is
//     published (lost), and the table ends with every row sent;
//   - in each key, the first deliveries come in the order of writing
//     (order_violations: first deliveries of a message written before
//     one of its key already delivered; a copy of a message delivered
//     before is no violation), and no message written after the restore
//     is first delivered while a restored one of its key has not been
//     (overtaken: counts those, whether the restored one comes later or
//     never);
//   - no message that was sent before the dump is published again.
//
// Both clusters are private (startPGServer): stopped by their postmaster's
// PID and removed when the test ends, passed or failed.
func TestRelayDumpRestore(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos tests are skipped under -short")
	}
	amqpURL := testenv.AMQPURL(t)
	queue := testenv.Name(t)
	ch := testenv.QueueChannel(t, queue)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	src := pgenv.StartServer(t)
	srcPool := dumpRestorePool(t, src)
	cfg := pgstore.Config{Schema: dumpRestoreSchema, CleanupInterval: -1}
	if _, err := srcPool.Exec(ctx, "CREATE SCHEMA "+dumpRestoreSchema); err != nil {
		t.Fatal(err)
	}
	if err := pgstore.Migrate(ctx, srcPool, cfg); err != nil {
		t.Fatal(err)
	}
	// Every transaction a DO block commits takes a transaction id.
	start := time.Now()
	if _, err := srcPool.Exec(ctx, fmt.Sprintf(`DO $$ BEGIN FOR i IN 1..%d LOOP PERFORM pg_current_xact_id(); COMMIT; END LOOP; END $$`,
		dumpRestoreBurn)); err != nil {
		t.Fatalf("burning transaction ids in the source: %v", err)
	}
	t.Logf("burnt %d transaction ids in the source in %v", dumpRestoreBurn, time.Since(start).Round(time.Millisecond))
	srcOB, err := pgstore.NewOutbox(srcPool, cfg)
	if err != nil {
		t.Fatal(err)
	}

	w := &dumpRestoreWriter{t: t, queue: queue}
	// Sent before the dump: written, published by an ordered relay of the
	// source, every row marked sent; their copies are purged from the
	// queue, so that any delivery of them later is a re-publish.
	w.write(ctx, srcPool, srcOB, "sent", dumpRestoreSent)
	stop := dumpRestoreRelay(t, srcOB, amqpURL, "source")
	waitRows(t, srcPool, "the source's relay to send the first messages", 30*time.Second, "state <> 's'", 0)
	if err := stop(); err != nil {
		t.Fatalf("the source's relay: %v", err)
	}
	if _, err := ch.QueuePurge(queue, false); err != nil {
		t.Fatal(err)
	}
	// Pending at the dump.
	w.write(ctx, srcPool, srcOB, "restored", dumpRestorePending)
	srcXid := currentXid(t, srcPool)

	dumpFile := filepath.Join(t.TempDir(), "outbox.dump")
	pgTool(t, src, "pg_dump", "-Fc", "-n", dumpRestoreSchema, "-f", dumpFile)
	srcPool.Close()

	dst := pgenv.StartServer(t)
	pgTool(t, dst, "pg_restore", "--exit-on-error", "-d", "postgres", dumpFile)
	dstPool := dumpRestorePool(t, dst)
	dstXid := currentXid(t, dstPool)
	t.Logf("transaction id counters: source %d at the dump, restored copy %d after the restore", srcXid, dstXid)
	// The precondition of the test: the restored rows were written by
	// transactions whose ids the new cluster has not reached, and will
	// not reach while the test runs (a few thousand at most).
	if srcXid < dstXid+dumpRestoreBurn/2 {
		t.Fatalf("the source's transaction id counter (%d) is not far above the restored copy's (%d): the test would not test a move to a cluster with a lower counter", srcXid, dstXid)
	}
	if n := countRows(t, dstPool, "state = 'p'"); n != 3*dumpRestorePending {
		t.Fatalf("the restored outbox has %d pending rows, want %d", n, 3*dumpRestorePending)
	}
	dstOB, err := pgstore.NewOutbox(dstPool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Written after the restore, before the relay starts: pending beside
	// the restored rows, later in each key's order.
	w.write(ctx, dstPool, dstOB, "after", dumpRestoreAfter)

	deliveries := consumeInOrder(t, amqpURL, queue)
	stop = dumpRestoreRelay(t, dstOB, amqpURL, "restored")
	want := 3 * (dumpRestorePending + dumpRestoreAfter)
	deadline := time.Now().Add(dumpRestoreWait)
	delivered := func() int {
		n := 0
		for id := range deliveries.firsts() {
			if m, ok := w.msgs[id]; ok && m.Phase != "sent" {
				n++
			}
		}
		return n
	}
	for time.Now().Before(deadline) && (delivered() < want || countRows(t, dstPool, "state = 'p'") > 0) {
		time.Sleep(100 * time.Millisecond)
	}
	if err := stop(); err != nil {
		t.Errorf("the restored copy's relay: %v", err)
	}
	time.Sleep(200 * time.Millisecond) // a last delivery in flight

	got := deliveries.all()
	firsts := map[string]bool{}
	last := map[string]dumpRestoreMsg{} // per key, the latest first delivery
	lost, violations, overtaken, republished := 0, 0, 0, 0
	var order []string
	for _, d := range got {
		m, ok := w.msgs[d.MessageId]
		if !ok {
			t.Errorf("delivery %q is no message of the test", d.MessageId)
			continue
		}
		order = append(order, d.MessageId)
		if m.Phase == "sent" {
			republished++
			if republished <= 5 {
				t.Errorf("%s was published again after the restore, though it was sent before the dump", d.MessageId)
			}
			continue
		}
		if firsts[d.MessageId] {
			continue // a copy
		}
		firsts[d.MessageId] = true
		if m.Phase == "after" {
			for _, r := range w.order {
				if r.Key == m.Key && r.Phase == "restored" && !firsts[r.ID] {
					overtaken++
					t.Errorf("order key %s: %s, written after the restore, first delivered before the restored %s", m.Key, m.ID, r.ID)
					break
				}
			}
		}
		if prev, ok := last[m.Key]; ok && m.Seq < prev.Seq {
			violations++
			if violations <= 10 {
				t.Errorf("order key %s: %s (%s) first delivered after %s (%s)", m.Key, d.MessageId, m.Phase, prev.ID, prev.Phase)
			}
			continue
		}
		last[m.Key] = m
	}
	for _, m := range w.order {
		if m.Phase != "sent" && !firsts[m.ID] {
			lost++
			if lost <= 10 {
				t.Errorf("%s (%s) was never published", m.ID, m.Phase)
			}
		}
	}
	pending := countRows(t, dstPool, "state = 'p'")
	dead := countRows(t, dstPool, "state = 'd'")
	t.Logf("relay-dump-restore restored_pending=%d written_after=%d deliveries=%d lost=%d order_violations=%d overtaken=%d republished_sent=%d pending_left=%d dead=%d src_xid=%d dst_xid=%d",
		3*dumpRestorePending, 3*dumpRestoreAfter, len(got), lost, violations, overtaken, republished, pending, dead, srcXid, dstXid)
	if pending != 0 || dead != 0 {
		t.Errorf("the restored outbox ends with %d rows pending and %d dead after %v, want none", pending, dead, dumpRestoreWait)
	}
	if violations > 0 || lost > 0 {
		t.Errorf("first deliveries in the queue's order: %v", order)
	}
}

// The sizes of TestRelayDumpRestore.
const (
	dumpRestoreSchema = "relay_dump"
	// dumpRestoreBurn is how many transaction ids the source burns: a
	// fresh cluster starts below 1,000.
	dumpRestoreBurn = 50000
	// Per order key: messages sent before the dump, pending at the dump,
	// and written in the restored copy.
	dumpRestoreSent, dumpRestorePending, dumpRestoreAfter = 4, 12, 4
	// dumpRestoreWait bounds the wait for the restored copy's relay.
	dumpRestoreWait = 20 * time.Second
)

// dumpRestoreMsg is one message TestRelayDumpRestore wrote.
type dumpRestoreMsg struct {
	ID    string `json:"id"`
	Key   string `json:"key"`
	Seq   int    `json:"seq"` // its place in its key's order of writing
	Phase string `json:"phase"`
}

// dumpRestoreWriter writes the messages of TestRelayDumpRestore, one per
// transaction, the keys taking turns, and remembers them.
type dumpRestoreWriter struct {
	t     *testing.T
	queue string
	msgs  map[string]dumpRestoreMsg
	order []dumpRestoreMsg
	next  int // the next seq of every key
}

func (w *dumpRestoreWriter) write(ctx context.Context, pool *pgxpool.Pool, ob *pgstore.Outbox, phase string, perKey int) {
	w.t.Helper()
	if w.msgs == nil {
		w.msgs = map[string]dumpRestoreMsg{}
	}
	for range perKey {
		for k := range 3 {
			m := dumpRestoreMsg{ID: fmt.Sprintf("k%d-%d", k, w.next), Key: "k" + strconv.Itoa(k), Seq: w.next, Phase: phase}
			body, _ := json.Marshal(m)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := ob.Write(ctx, tx, pgstore.Message{RoutingKey: w.queue, OrderKey: m.Key,
					Publishing: amqp.Publishing{MessageId: m.ID, ContentType: "application/json", Body: body}})
				return err
			})
			if err != nil {
				w.t.Fatalf("writing %s: %v", m.ID, err)
			}
			w.msgs[m.ID] = m
			w.order = append(w.order, m)
		}
		w.next++
	}
}

// dumpRestorePool is a pool on srv's database postgres, with the outbox's
// schema first on the search path, closed when the test ends.
func dumpRestorePool(t *testing.T, srv *pgenv.Server) *pgxpool.Pool {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig(srv.DSN)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 8
	pcfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pcfg.ConnConfig.RuntimeParams["search_path"] = dumpRestoreSchema
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// dumpRestoreRelay runs an ordered relay on ob until the returned stop,
// which shuts it down and returns what Run and Shutdown returned. A test
// that fails first stops it in its cleanup.
func dumpRestoreRelay(t *testing.T, ob *pgstore.Outbox, url, name string) (stop func() error) {
	t.Helper()
	r, err := pgstore.NewRelay(ob, pgstore.RelayConfig{URL: url, Name: testenv.Name(t) + "-" + name, Ordered: true,
		PollInterval: 100 * time.Millisecond, RetryBackoff: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	var once sync.Once
	var serr error
	stop = func() error {
		once.Do(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			serr = errors.Join(r.Shutdown(ctx), <-done)
		})
		return serr
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// currentXid returns the next transaction id of pool's cluster: the one a
// new transaction takes (pg_current_xact_id() in a transaction of its own).
func currentXid(t *testing.T, pool *pgxpool.Pool) uint64 {
	t.Helper()
	var x uint64
	if err := pool.QueryRow(context.Background(), "SELECT pg_current_xact_id()::text::bigint").Scan(&x); err != nil {
		t.Fatal(err)
	}
	return x
}

// countRows counts the outbox rows of pool's schema where cond holds.
func countRows(t *testing.T, pool *pgxpool.Pool, cond string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgstore.DefaultOutboxTable+" WHERE "+cond).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitRows waits up to timeout until the outbox rows where cond holds are
// want.
func waitRows(t *testing.T, pool *pgxpool.Pool, what string, timeout time.Duration, cond string, want int) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		n := countRows(t, pool, cond)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s: %d rows where %s, want %d", timeout, what, n, cond, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// pgTool runs one of PostgreSQL's client programs (pg_dump, pg_restore),
// from srv's installation, on srv's database postgres.
func pgTool(t *testing.T, srv *pgenv.Server, tool string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	args = append([]string{"-h", "127.0.0.1", "-p", strconv.Itoa(srv.Port), "-U", "postgres"}, args...)
	if tool == "pg_dump" {
		args = append(args, "postgres")
	}
	out, err := exec.CommandContext(ctx, pgToolPath(t, srv, tool), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", tool, args, err, out)
	}
}

// pgToolPath finds a client program of srv's PostgreSQL version: beside
// its postgres (links followed: /usr/local/bin may hold links to initdb
// and postgres only), else on PATH.
func pgToolPath(t *testing.T, srv *pgenv.Server, tool string) string {
	t.Helper()
	dirs := []string{srv.Bin}
	if p, err := filepath.EvalSymlinks(filepath.Join(srv.Bin, "postgres")); err == nil {
		dirs = append(dirs, filepath.Dir(p))
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, tool)); err == nil {
			return filepath.Join(d, tool)
		}
	}
	p, err := exec.LookPath(tool)
	if err != nil {
		t.Fatalf("no %s in %v or on PATH: %v", tool, dirs, err)
	}
	return p
}

// inOrder records the deliveries of a queue in the order they came.
type inOrder struct {
	mu sync.Mutex
	ds []amqp.Delivery
}

func (o *inOrder) all() []amqp.Delivery {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]amqp.Delivery(nil), o.ds...)
}

// firsts returns the distinct MessageIds delivered.
func (o *inOrder) firsts() map[string]bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	m := map[string]bool{}
	for _, d := range o.ds {
		m[d.MessageId] = true
	}
	return m
}

// consumeInOrder consumes queue (auto-ack, one consumer on one channel:
// the queue's order) until the test ends, recording every delivery.
func consumeInOrder(t *testing.T, url, queue string) *inOrder {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	ds, err := ch.Consume(queue, "", true, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	o := &inOrder{}
	go func() {
		for d := range ds {
			o.mu.Lock()
			o.ds = append(o.ds, d)
			o.mu.Unlock()
		}
	}()
	return o
}
