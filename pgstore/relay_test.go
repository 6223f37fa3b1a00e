package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
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
	"github.com/amqpidem/amqpidem/pgstore"
)

// outboxRig is an outbox table in a schema of its own and a queue its
// messages are routed to (the default exchange, routing key the queue).
type outboxRig struct {
	t     *testing.T
	pool  *pgxpool.Pool
	cfg   pgstore.Config
	ob    *pgstore.Outbox
	queue string
	ch    *amqp.Channel
}

func newOutboxRig(t *testing.T) *outboxRig {
	t.Helper()
	pool := pgenv.Pool(t, 16)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	ob, err := pgstore.NewOutbox(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := &outboxRig{t: t, pool: pool, cfg: cfg, ob: ob, queue: testenv.Name(t)}
	r.ch = testenv.QueueChannel(t, r.queue)
	return r
}

// write writes msgs in one transaction, committed or rolled back, and
// returns their MessageIds.
func (r *outboxRig) write(commit bool, msgs ...pgstore.Message) []string {
	r.t.Helper()
	ctx := context.Background()
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		r.t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var ids []string
	for _, m := range msgs {
		id, err := r.ob.Write(ctx, tx, m)
		if err != nil {
			r.t.Fatalf("Write: %v", err)
		}
		ids = append(ids, id)
	}
	if commit {
		if err := tx.Commit(ctx); err != nil {
			r.t.Fatal(err)
		}
	}
	return ids
}

// msg is a message to the rig's queue with body body.
// lockTable locks the rig's outbox table in mode (e.g. "SHARE", "ACCESS
// EXCLUSIVE") from a transaction of its own, as a migration or an
// operator's LOCK TABLE does, until the release it returns (or the test's
// end) rolls that transaction back.
func (r *outboxRig) lockTable(mode string) (release func()) {
	r.t.Helper()
	ctx := context.Background()
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		r.t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(ctx) }) }
	r.t.Cleanup(release)
	if _, err := tx.Exec(ctx, "LOCK TABLE "+pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()+" IN "+mode+" MODE"); err != nil {
		r.t.Fatal(err)
	}
	return release
}

func (r *outboxRig) msg(body string) pgstore.Message {
	return pgstore.Message{RoutingKey: r.queue, Publishing: amqp.Publishing{Body: []byte(body)}}
}

// relay starts a Relay on the rig's outbox, shut down in t.Cleanup (and
// checked to have returned nil).
func (r *outboxRig) relay(cfg pgstore.RelayConfig) *pgstore.Relay {
	r.t.Helper()
	cfg.URL = testenv.AMQPURL(r.t)
	rl, err := pgstore.NewRelay(r.ob, cfg)
	if err != nil {
		r.t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rl.Run(context.Background()) }()
	r.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := rl.Shutdown(ctx); err != nil {
			r.t.Errorf("Shutdown: %v", err)
		}
		if err := <-done; err != nil {
			r.t.Errorf("Run: %v", err)
		}
	})
	return rl
}

// take reads deliveries from the queue until n arrived, failing after
// timeout, then checks for 300 ms that no more come.
func (r *outboxRig) take(n int, timeout time.Duration) []amqp.Delivery {
	r.t.Helper()
	var out []amqp.Delivery
	deadline := time.Now().Add(timeout)
	for {
		d, ok, err := r.ch.Get(r.queue, true)
		if err != nil {
			r.t.Fatal(err)
		}
		if ok {
			out = append(out, d)
			continue
		}
		if len(out) >= n {
			time.Sleep(300 * time.Millisecond)
			if d, ok, _ := r.ch.Get(r.queue, true); ok {
				out = append(out, d)
				continue
			}
			return out
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("%d of %d messages arrived in %v", len(out), n, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// drain reads what the queue holds now and counts it by MessageId.
func (r *outboxRig) drain() map[string]int {
	r.t.Helper()
	got := map[string]int{}
	for {
		d, ok, err := r.ch.Get(r.queue, true)
		if err != nil {
			r.t.Fatal(err)
		}
		if !ok {
			return got
		}
		got[d.MessageId]++
	}
}

// count returns the outbox's rows in state ('p', 's', 'd').
func (r *outboxRig) count(state string) int {
	r.t.Helper()
	var n int
	err := r.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+
		pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()+" WHERE state = $1", state).Scan(&n)
	if err != nil {
		r.t.Fatal(err)
	}
	return n
}

// waitCount waits until count(state) is n.
func (r *outboxRig) waitCount(state string, n int, timeout time.Duration) {
	r.t.Helper()
	deadline := time.Now().Add(timeout)
	for r.count(state) != n {
		if time.Now().After(deadline) {
			r.t.Fatalf("rows in state %q: %d, want %d after %v", state, r.count(state), n, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRelayPublishesCommittedOnly: the messages of committed transactions
// arrive once each, with their MessageIds (the caller's, or the one Write
// generated) and headers; those of rolled-back ones never do.
func TestRelayPublishesCommittedOnly(t *testing.T) {
	r := newOutboxRig(t)
	var want []string
	for i := range 20 {
		commit := i%4 != 3
		m1, m2 := r.msg(fmt.Sprintf("tx%d-a", i)), r.msg(fmt.Sprintf("tx%d-b", i))
		m1.Publishing.MessageId = fmt.Sprintf("own-%d", i)
		m1.Publishing.Headers = amqp.Table{"tenant": "acme"}
		ids := r.write(commit, m1, m2)
		if ids[0] != m1.Publishing.MessageId || len(ids[1]) != 32 {
			t.Fatalf("Write returned ids %q, want the caller's and 32 hex digits", ids)
		}
		if commit {
			want = append(want, ids...)
		}
	}
	r.relay(pgstore.RelayConfig{})
	got := r.take(len(want), 20*time.Second)
	seen := map[string]int{}
	for _, d := range got {
		seen[d.MessageId]++
		if strings.HasPrefix(d.MessageId, "own-") && d.Headers["tenant"] != "acme" {
			t.Errorf("%s: headers %v lost the caller's", d.MessageId, d.Headers)
		}
		if _, ok := d.Headers[amqpidem.HeaderTimestampMillis]; !ok || d.DeliveryMode != amqp.Persistent || d.Timestamp.IsZero() {
			t.Errorf("%s: headers %v, delivery mode %d, timestamp %v: want a publish time, persistent", d.MessageId, d.Headers, d.DeliveryMode, d.Timestamp)
		}
		if strings.Contains(string(d.Body), "tx3-") || strings.Contains(string(d.Body), "tx7-") {
			t.Errorf("a rolled-back message was published: %s", d.Body)
		}
	}
	for _, id := range want {
		if seen[id] != 1 {
			t.Errorf("message %s arrived %d times, want once", id, seen[id])
		}
	}
	if len(got) != len(want) {
		t.Errorf("%d messages arrived, want %d", len(got), len(want))
	}
	r.waitCount("s", len(want), 5*time.Second)
	if n := r.count("p"); n != 0 {
		t.Errorf("%d rows still pending", n)
	}
}

// TestRelayWakesOnCommit: a relay that is idle publishes a row soon after
// its transaction commits (the notification), well before its poll.
func TestRelayWakesOnCommit(t *testing.T) {
	r := newOutboxRig(t)
	r.relay(pgstore.RelayConfig{PollInterval: time.Hour})
	time.Sleep(300 * time.Millisecond) // listening
	r.write(true, r.msg("woken"))
	if got := r.take(1, 10*time.Second); string(got[0].Body) != "woken" {
		t.Fatalf("got %q", got[0].Body)
	}
}

// TestRelayRefusedGoesDeadAndRedrives: a message no queue takes is tried
// MaxAttempts times with backoff, then kept dead with the broker's reason;
// Redrive makes it pending again, and once a queue takes it, it is sent.
func TestRelayRefusedGoesDeadAndRedrives(t *testing.T) {
	r := newOutboxRig(t)
	lost := r.queue + "-later"
	m := pgstore.Message{RoutingKey: lost, Publishing: amqp.Publishing{MessageId: "refused-1", Body: []byte("x")}}
	r.write(true, m, r.msg("fine"))
	rl := r.relay(pgstore.RelayConfig{MaxAttempts: 3, RetryBackoff: 50 * time.Millisecond, PollInterval: 50 * time.Millisecond})
	r.waitCount("d", 1, 20*time.Second)
	r.waitCount("s", 1, 5*time.Second)
	rows, err := r.ob.List(context.Background(), "dead", 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1 || rows[0].MessageID != "refused-1" || rows[0].Attempts != 3 || rows[0].RoutingKey != lost ||
		!strings.Contains(rows[0].LastError, "unroutable") || rows[0].Err != nil {
		t.Fatalf("dead rows %+v: want refused-1 after 3 attempts, unroutable", rows)
	}
	if pub, ref, dead := rl.Counts(); pub != 1 || ref != 3 || dead != 1 {
		t.Errorf("Counts() = %d, %d, %d, want 1 published, 3 refused, 1 dead", pub, ref, dead)
	}
	if n, oldest, err := rl.Backlog(context.Background()); err != nil || n != 0 || oldest != 0 {
		t.Errorf("Backlog() = %d, %v, %v, want nothing pending", n, oldest, err)
	}
	// Dead rows stay dead: nothing retries them by itself.
	time.Sleep(300 * time.Millisecond)
	if n := r.count("d"); n != 1 {
		t.Fatalf("%d dead rows, want 1", n)
	}
	if _, err := r.ch.QueueDeclare(lost, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { testenv.DeleteQueues(t, testenv.AMQPURL(t), lost) })
	if n, err := r.ob.Redrive(context.Background()); err != nil || n != 1 {
		t.Fatalf("Redrive() = %d, %v, want 1", n, err)
	}
	r.waitCount("s", 2, 10*time.Second)
	d, ok, err := r.ch.Get(lost, true)
	if err != nil || !ok || d.MessageId != "refused-1" {
		t.Fatalf("re-driven message: %v %v %v", d.MessageId, ok, err)
	}
}

// TestRelayOrdered: with Ordered, the messages of each order key arrive in
// the order their transactions committed. A transaction writing a key's
// message waits in Write while an earlier one that wrote the key is open,
// and is ordered after it; a message without an order key is not held.
func TestRelayOrdered(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	ordered := func(key, body string) pgstore.Message {
		m := r.msg(body)
		m.OrderKey = key
		return m
	}
	// An older transaction writes k0's first message and stays open while
	// a younger one tries to write the second.
	older, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = older.Rollback(ctx) }()
	if _, err := r.ob.Write(ctx, older, ordered("k0", "k0-0")); err != nil {
		t.Fatal(err)
	}
	younger := make(chan struct{})
	go func() {
		defer close(younger)
		r.write(true, ordered("k0", "k0-1"))
	}()
	r.write(true, r.msg("unordered"))
	r.relay(pgstore.RelayConfig{Ordered: true, PollInterval: 50 * time.Millisecond})
	if got := r.take(1, 10*time.Second); string(got[0].Body) != "unordered" {
		t.Fatalf("while the older transaction is open, got %q, want only the unordered message", got[0].Body)
	}
	select {
	case <-younger:
		t.Fatal("the younger transaction wrote k0's message while the older one that wrote k0 was open")
	default:
	}
	if err := older.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	<-younger
	// Three keys, each written by 10 transactions from 3 writers at once.
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10 {
				for _, k := range []string{"k1", "k2", "k3"} {
					r.write(true, ordered(k, fmt.Sprintf("%s-w%d-%02d", k, w, i)))
				}
			}
		}()
	}
	wg.Wait()
	got := r.take(2+90, 30*time.Second)
	if len(got) != 92 {
		t.Fatalf("%d messages, want 92", len(got))
	}
	// Per key and writer, the numbers must increase; k0-0 comes before k0-1.
	last := map[string]int{}
	for _, d := range got {
		body := string(d.Body)
		if strings.HasPrefix(body, "k0-") {
			last["k0"]++
			if want := fmt.Sprintf("k0-%d", last["k0"]-1); body != want {
				t.Errorf("k0's message %d is %q, want %q", last["k0"], body, want)
			}
			continue
		}
		var k string
		var w, i int
		if _, err := fmt.Sscanf(strings.ReplaceAll(body, "-", " "), "%s w%d %d", &k, &w, &i); err != nil {
			t.Fatalf("body %q: %v", body, err)
		}
		id := fmt.Sprintf("%s-w%d", k, w)
		if prev, ok := last[id]; ok && i <= prev {
			t.Errorf("%s: %d arrived after %d", id, i, prev)
		}
		last[id] = i
	}
}

// TestRelayOrderedCommitOrder: dependent transactions on one key are
// published in the order they committed, not the order they began to
// write. T1 writes first (an unrelated row), then waits for an account
// row that T2 updates; T2 writes its message and commits; T1 then reads
// T2's balance, writes its own and commits. The balance the consumers see
// last must be the database's.
func TestRelayOrderedCommitOrder(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	accounts := pgx.Identifier{r.cfg.Schema, "accounts"}.Sanitize()
	if _, err := r.pool.Exec(ctx, "CREATE TABLE "+accounts+" (id int PRIMARY KEY, balance int NOT NULL, note text)"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.pool.Exec(ctx, "INSERT INTO "+accounts+" VALUES (1, 100, ''), (2, 0, '')"); err != nil {
		t.Fatal(err)
	}
	announce := func(tx pgx.Tx, balance int) {
		m := r.msg(fmt.Sprint(balance))
		m.OrderKey = "account-1"
		if _, err := r.ob.Write(ctx, tx, m); err != nil {
			t.Errorf("Write: %v", err)
		}
	}
	t1, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = t1.Rollback(ctx) }()
	// T1's first write: it has the older transaction id from here on.
	if _, err := t1.Exec(ctx, "UPDATE "+accounts+" SET note = 't1' WHERE id = 2"); err != nil {
		t.Fatal(err)
	}
	t2, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = t2.Rollback(ctx) }()
	var b2 int
	if err := t2.QueryRow(ctx, "UPDATE "+accounts+" SET balance = balance - 50 WHERE id = 1 RETURNING balance").Scan(&b2); err != nil {
		t.Fatal(err)
	}
	t1done := make(chan int, 1)
	go func() {
		var b1 int
		// Waits for T2's row lock, then reads T2's 50.
		if err := t1.QueryRow(ctx, "UPDATE "+accounts+" SET balance = balance - 20 WHERE id = 1 RETURNING balance").Scan(&b1); err != nil {
			t.Error(err)
		}
		announce(t1, b1)
		if err := t1.Commit(ctx); err != nil {
			t.Error(err)
		}
		t1done <- b1
	}()
	announce(t2, b2)
	if err := t2.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if b1 := <-t1done; b2 != 50 || b1 != 30 {
		t.Fatalf("balances %d then %d, want 50 then 30", b2, b1)
	}
	r.relay(pgstore.RelayConfig{Ordered: true, PollInterval: 50 * time.Millisecond})
	got := r.take(2, 10*time.Second)
	if len(got) != 2 || string(got[0].Body) != "50" || string(got[1].Body) != "30" {
		var bodies []string
		for _, d := range got {
			bodies = append(bodies, string(d.Body))
		}
		t.Fatalf("published %q, want [50 30]: the order the transactions committed in", bodies)
	}
}

// TestRelayOrderedBacklog: an order key's backlog goes out in order
// without waiting for a poll between its messages (PollInterval is an
// hour here: nothing but the relay's own rounds can move it), also when
// the broker refuses one in the middle: the messages behind it wait for
// it, and go once it is dead (the relay looks again when the refused row
// is due, not at a poll).
func TestRelayOrderedBacklog(t *testing.T) {
	r := newOutboxRig(t)
	const n = 300
	var msgs []pgstore.Message
	for i := range n {
		m := r.msg(fmt.Sprint(i))
		m.OrderKey = "k"
		if i == n/2 {
			m.RoutingKey = r.queue + "-nowhere" // refused: no queue takes it
		}
		msgs = append(msgs, m)
	}
	for i := 0; i < n; i += 50 {
		r.write(true, msgs[i:i+50]...)
	}
	// Marks take a few ms more than here, as on a remote server: the
	// relay must look again when the refused row is due by the
	// database, whose refusal is written after the marks.
	startRelay(t, r.ob, pgstore.RelayConfig{Ordered: true, PollInterval: time.Hour, Batch: 64,
		MaxAttempts: 2, RetryBackoff: 100 * time.Millisecond}, func(rl *pgstore.Relay) {
		pgstore.SetBeforeMark(rl, func() { time.Sleep(5 * time.Millisecond) })
	})
	got := r.take(n-1, 60*time.Second)
	if len(got) != n-1 {
		t.Fatalf("%d messages, want %d", len(got), n-1)
	}
	want := 0
	for _, d := range got {
		if want == n/2 {
			want++ // dead
		}
		if string(d.Body) != fmt.Sprint(want) {
			t.Fatalf("got %q, want %d", d.Body, want)
		}
		want++
	}
	if d := r.count("d"); d != 1 {
		t.Fatalf("%d dead rows, want 1", d)
	}
}

// TestRelaysShareTheTable: two relays on one table publish every message,
// none twice (claims do not overlap), and a row claimed by a relay that
// then vanished is published once its claim ends.
func TestRelaysShareTheTable(t *testing.T) {
	r := newOutboxRig(t)
	var want []string
	for i := range 50 {
		want = append(want, r.write(true, r.msg(fmt.Sprintf("m%d-a", i)), r.msg(fmt.Sprintf("m%d-b", i)))...)
	}
	// A relay that claimed a row for 1 s and died.
	ghost := r.write(true, r.msg("ghost"))
	if _, err := r.pool.Exec(context.Background(), "UPDATE "+pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()+
		" SET claimed_by = 'ghost', due_at = clock_timestamp() + interval '1 second' WHERE message_id = $1", ghost[0]); err != nil {
		t.Fatal(err)
	}
	want = append(want, ghost...)
	r.relay(pgstore.RelayConfig{Batch: 7, Name: "one", PollInterval: 50 * time.Millisecond})
	r.relay(pgstore.RelayConfig{Batch: 7, Name: "two", PollInterval: 50 * time.Millisecond})
	r.once(t, want)
}

// once checks that the messages ids each arrived once, reading them from
// the rig's queue (30 s at most).
func (r *outboxRig) once(t *testing.T, ids []string) {
	t.Helper()
	got := r.take(len(ids), 30*time.Second)
	seen := map[string]int{}
	for _, d := range got {
		seen[d.MessageId]++
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Errorf("message %s arrived %d times, want once", id, seen[id])
		}
	}
	if len(got) != len(ids) {
		t.Errorf("%d deliveries, want %d", len(got), len(ids))
	}
}

// TestRelayRetention: with a negative Retention a sent row is deleted at
// once; Cleanup deletes sent rows older than the retention, in batches.
func TestRelayRetention(t *testing.T) {
	r := newOutboxRig(t)
	r.write(true, r.msg("a"), r.msg("b"), r.msg("c"))
	rl, err := pgstore.NewRelay(r.ob, pgstore.RelayConfig{URL: testenv.AMQPURL(t), Retention: -1})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rl.Run(context.Background()) }()
	r.take(3, 10*time.Second)
	r.waitCount("p", 0, 5*time.Second)
	if n := r.count("s"); n != 0 {
		t.Errorf("%d sent rows kept, want none with a negative Retention", n)
	}
	if err := rl.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := rl.Shutdown(context.Background()); err != nil {
		t.Fatalf("second Shutdown: %v", err)
	}

	r.write(true, r.msg("d"), r.msg("e"), r.msg("f"))
	r.relay(pgstore.RelayConfig{})
	r.take(3, 10*time.Second)
	r.waitCount("s", 3, 5*time.Second)
	if n, err := r.ob.Cleanup(context.Background(), time.Hour, 2); err != nil || n != 0 {
		t.Fatalf("Cleanup(1h) = %d, %v, want nothing old enough", n, err)
	}
	time.Sleep(20 * time.Millisecond)
	if n, err := r.ob.Cleanup(context.Background(), time.Millisecond, 2); err != nil || n != 3 {
		t.Fatalf("Cleanup(1ms, batches of 2) = %d, %v, want 3", n, err)
	}
}

// TestOutboxWriteRefusesBadMessages: a message the broker would refuse is
// refused by Write, before the transaction is touched; a bad Config and a
// List of an unknown state are errors naming what is wrong.
func TestOutboxWriteRefusesBadMessages(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	bad := r.msg("x")
	bad.Publishing.Headers = amqp.Table{"f": 1.5i}
	if _, err := r.ob.Write(ctx, tx, bad); err == nil || !strings.Contains(err.Error(), "f") {
		t.Fatalf("Write of a complex header = %v, want an error naming the header", err)
	}
	// The transaction is still usable.
	if _, err := r.ob.Write(ctx, tx, r.msg("ok")); err != nil {
		t.Fatalf("Write after a refused one: %v", err)
	}
	if _, err := r.ob.List(ctx, "stuck", 0, 1); err == nil {
		t.Error("List of an unknown state: no error")
	}
	if _, err := pgstore.NewRelay(r.ob, pgstore.RelayConfig{}); err == nil || !strings.Contains(err.Error(), "URL") {
		t.Errorf("NewRelay without URL = %v, want an error naming URL", err)
	}
	if _, err := pgstore.NewRelay(r.ob, pgstore.RelayConfig{URL: "amqp://x", ClaimTTL: time.Second, PublishTimeout: 2 * time.Second}); err == nil {
		t.Error("NewRelay with ClaimTTL below PublishTimeout: no error")
	}
	if _, err := pgstore.NewOutbox(r.pool, pgstore.Config{OutboxTable: "amqpidem_records"}); err == nil {
		t.Error("NewOutbox with the records table as the outbox: no error")
	}
}

// TestOutboxInject: Config.Inject sees Write's ctx and writes headers into
// the stored message, not into the caller's table.
func TestOutboxInject(t *testing.T) {
	r := newOutboxRig(t)
	type key struct{}
	cfg := r.cfg
	cfg.Inject = func(ctx context.Context, h amqp.Table) {
		if v, ok := ctx.Value(key{}).(string); ok {
			h["traceparent"] = v
		}
	}
	ob, err := pgstore.NewOutbox(r.pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.WithValue(context.Background(), key{}, "00-trace-span-01")
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	m := r.msg("traced")
	m.Publishing.Headers = amqp.Table{"a": "b"}
	if _, err := ob.Write(ctx, tx, m); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if len(m.Publishing.Headers) != 1 {
		t.Errorf("the caller's headers were changed: %v", m.Publishing.Headers)
	}
	r.relay(pgstore.RelayConfig{})
	d := r.take(1, 10*time.Second)[0]
	if d.Headers["traceparent"] != "00-trace-span-01" || d.Headers["a"] != "b" {
		t.Errorf("headers %v: want the injected traceparent and the caller's", d.Headers)
	}
}

// TestRelayBrokerDown: while the broker cannot be reached, rows stay
// pending (nothing is dead), and the relay backs off.
func TestRelayBrokerDown(t *testing.T) {
	r := newOutboxRig(t)
	r.write(true, r.msg("waits"))
	rl, err := pgstore.NewRelay(r.ob, pgstore.RelayConfig{
		Dial:         func() (*amqp.Connection, error) { return nil, errors.New("broker down") },
		RetryBackoff: 20 * time.Millisecond, MaxAttempts: 1,
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rl.Run(context.Background()) }()
	time.Sleep(500 * time.Millisecond)
	if err := rl.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if p, d := r.count("p"), r.count("d"); p != 1 || d != 0 {
		t.Errorf("after a broker outage: %d pending, %d dead, want 1 and 0", p, d)
	}
	if _, ref, dead := rl.Counts(); ref != 0 || dead != 0 {
		t.Errorf("a lost connection counted as %d refusals, %d dead", ref, dead)
	}
}

// TestRelayCleansUpUnderLoad: the relay deletes sent rows past Retention
// while full batches keep it busy, not only once the table is drained.
func TestRelayCleansUpUnderLoad(t *testing.T) {
	r := newOutboxRig(t)
	const n = 300
	msgs := make([]pgstore.Message, n)
	for i := range msgs {
		msgs[i] = r.msg(fmt.Sprint(i))
	}
	r.write(true, msgs...)
	r.relay(pgstore.RelayConfig{Batch: 1, Concurrency: 1, Retention: time.Millisecond, CleanupInterval: 10 * time.Millisecond})
	deadline := time.Now().Add(20 * time.Second)
	for {
		pending, sent := r.count("p"), r.count("s")
		if pending == 0 {
			t.Fatalf("every row was sent before any sent row was deleted (%d sent rows kept)", sent)
		}
		if pending+sent < n {
			return // deleted while rows were still pending
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 20 s: %d pending, %d sent, none deleted", pending, sent)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// relayTracer records what a Relay tells its RelayConfig.Tracer.
type relayTracer struct {
	mu    sync.Mutex
	pubs  []amqpidem.Publish
	ended []error
}

func (*relayTracer) Start(ctx context.Context, _ string, _ *amqp.Delivery) context.Context {
	return ctx
}
func (*relayTracer) Inject(context.Context, amqp.Table)  {}
func (*relayTracer) End(context.Context, amqpidem.Event) {}
func (t *relayTracer) StartPublish(_ context.Context, p amqpidem.Publish) func(error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p.Headers = maps.Clone(p.Headers)
	t.pubs = append(t.pubs, p)
	return func(err error) {
		t.mu.Lock()
		defer t.mu.Unlock()
		t.ended = append(t.ended, err)
	}
}

// TestRelayTracer: the relay tells RelayConfig.Tracer of each publish, as
// a relay publish with the row's headers (the trace context Write
// injected), and ends it with the publish's outcome: a producer span per
// relayed row (issue 37, item 11).
func TestRelayTracer(t *testing.T) {
	r := newOutboxRig(t)
	cfg := r.cfg
	cfg.Inject = func(_ context.Context, h amqp.Table) { h["traceparent"] = "00-trace-span-01" }
	ob, err := pgstore.NewOutbox(r.pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.ob = ob
	m := r.msg("traced")
	m.Publishing.MessageId = "relay-traced-1"
	r.write(true, m)
	tr := &relayTracer{}
	r.relay(pgstore.RelayConfig{Tracer: tr})
	r.take(1, 10*time.Second)
	deadline := time.Now().Add(5 * time.Second)
	for {
		tr.mu.Lock()
		pubs, ended := slices.Clone(tr.pubs), slices.Clone(tr.ended)
		tr.mu.Unlock()
		if len(ended) == 1 {
			p := pubs[0]
			if len(pubs) != 1 || p.Kind != amqpidem.PublishRelay || p.RoutingKey != r.queue || p.MessageID != "relay-traced-1" ||
				p.Headers["traceparent"] != "00-trace-span-01" || ended[0] != nil {
				t.Fatalf("told %+v, ended %v; want one relay publish with the row's trace context, ended without error", pubs, ended)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("told %+v, ended %v; want one publish, ended", pubs, ended)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
