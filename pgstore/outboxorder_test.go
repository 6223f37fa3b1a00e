package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// outboxFormat1 is the outbox table as the release before format 2 made
// it, rows ordered by their transaction's id (txid).
const outboxFormat1 = `
CREATE TABLE {outbox} (
	id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
	txid       xid8        NOT NULL DEFAULT pg_current_xact_id(),
	order_key  text,
	message_id text        NOT NULL,
	message    bytea       NOT NULL,
	state      text        NOT NULL DEFAULT 'p' CHECK (state IN ('p', 's', 'd')),
	due_at     timestamptz NOT NULL DEFAULT '-infinity',
	claimed_by text,
	attempts   integer     NOT NULL DEFAULT 0,
	last_error text,
	created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
	sent_at    timestamptz
);
CREATE INDEX amqpidem_outbox_pending ON {outbox} (id) WHERE state = 'p';
CREATE INDEX amqpidem_outbox_ordered ON {outbox} (order_key, txid, id) WHERE state = 'p' AND order_key IS NOT NULL;
CREATE INDEX amqpidem_outbox_sent ON {outbox} (sent_at) WHERE state = 's';
CREATE INDEX amqpidem_outbox_dead ON {outbox} (id) WHERE state = 'd';
COMMENT ON TABLE {outbox} IS 'amqpidem pgstore outbox, format 1';
`

// TestMigrateUpgradesOutboxFormat1: Migrate upgrades a format 1 outbox in
// place: its pending rows keep the order format 1 gave them (transaction
// id, then id), the messages written after the upgrade come after them,
// and a second Migrate changes nothing.
func TestMigrateUpgradesOutboxFormat1(t *testing.T) {
	ctx := context.Background()
	pool := pgenv.Pool(t, 8)
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(t)), CleanupInterval: -1}
	sch := pgx.Identifier{cfg.Schema}.Sanitize()
	table := pgx.Identifier{cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+sch+";"+strings.ReplaceAll(outboxFormat1, "{outbox}", table)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), "DROP SCHEMA "+sch+" CASCADE"); err != nil {
			t.Errorf("drop schema: %v", err)
		}
	})
	queue := testenv.Name(t)
	ch := testenv.QueueChannel(t, queue)
	// Rows as a format 1 writer inserts them. "old-a" is written by a
	// transaction that took its id first and committed last: format 1
	// publishes it before "old-b".
	insert := func(tx pgx.Tx, body string) {
		b, err := amqpidem.MarshalPublishing("", queue, amqp.Publishing{MessageId: body, Body: []byte(body)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (order_key, message_id, message) VALUES ('k', $1, $2)", body, b); err != nil {
			t.Fatal(err)
		}
	}
	a, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = a.Rollback(ctx) }()
	if _, err := a.Exec(ctx, "SELECT pg_current_xact_id()"); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { insert(tx, "old-b"); return nil }); err != nil {
		t.Fatal(err)
	}
	insert(a, "old-a")
	if err := a.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	for range 2 {
		if err := pgstore.Migrate(ctx, pool, cfg); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
	}
	var comment string
	var hasTxid bool
	if err := pool.QueryRow(ctx, `SELECT obj_description($1::regclass, 'pg_class'),
			EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'txid' AND NOT attisdropped)`,
		table).Scan(&comment, &hasTxid); err != nil {
		t.Fatal(err)
	}
	if comment != "amqpidem pgstore outbox, format 2" || hasTxid {
		t.Fatalf("after Migrate: comment %q, txid column %v; want format 2 without txid", comment, hasTxid)
	}
	ob, err := pgstore.NewOutbox(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	r := &outboxRig{t: t, pool: pool, cfg: cfg, ob: ob, queue: queue, ch: ch}
	m := r.msg("new")
	m.OrderKey = "k"
	r.write(true, m)
	r.relay(pgstore.RelayConfig{Ordered: true, PollInterval: 50 * time.Millisecond})
	var got []string
	for _, d := range r.take(3, 10*time.Second) {
		got = append(got, string(d.Body))
	}
	if fmt.Sprint(got) != "[old-a old-b new]" {
		t.Fatalf("published %v, want [old-a old-b new]", got)
	}
}

// TestOutboxCleanupKeys: Cleanup deletes the counter of an order key once
// no pending row of it is left, keeps those in use (a pending row, or a
// writer's open transaction), and a key whose counter was deleted starts
// again and is published.
func TestOutboxCleanupKeys(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	keys := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable + "_keys"}.Sanitize()
	counters := func() string {
		t.Helper()
		var s string
		if err := r.pool.QueryRow(ctx, "SELECT coalesce(string_agg(order_key || '=' || seq, ' ' ORDER BY order_key), '') FROM "+keys).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	ordered := func(key, body string) pgstore.Message {
		m := r.msg(body)
		m.OrderKey = key
		return m
	}
	r.write(true, ordered("gone", "g1"), ordered("gone", "g2"), ordered("pending", "p1"))
	if got := counters(); got != "gone=2 pending=1" {
		t.Fatalf("counters %q", got)
	}
	// "gone"'s rows are sent and past retention; "pending"'s is not sent.
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	if _, err := r.pool.Exec(ctx, "UPDATE "+table+" SET state = 's', sent_at = now() - interval '1 day' WHERE order_key = 'gone'"); err != nil {
		t.Fatal(err)
	}
	// "held" is written by a transaction still open: its counter is in
	// use though no committed row shows it.
	held, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = held.Rollback(ctx) }()
	if _, err := r.ob.Write(ctx, held, ordered("held", "h1")); err != nil {
		t.Fatal(err)
	}
	// "idle" has a counter and no rows, and a writer's open transaction
	// has just taken its next number.
	if _, err := r.pool.Exec(ctx, "INSERT INTO "+keys+" VALUES ('idle', 5)"); err != nil {
		t.Fatal(err)
	}
	idle, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = idle.Rollback(ctx) }()
	if _, err := r.ob.Write(ctx, idle, ordered("idle", "i6")); err != nil {
		t.Fatal(err)
	}
	if n, err := r.ob.Cleanup(ctx, time.Hour, 0); err != nil || n != 2 {
		t.Fatalf("Cleanup = %d, %v; want 2 rows", n, err)
	}
	if got := counters(); got != "idle=5 pending=1" {
		t.Fatalf("counters after Cleanup %q, want idle=5 pending=1 (held's is not visible yet)", got)
	}
	for _, tx := range []pgx.Tx{held, idle} {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := counters(); got != "held=1 idle=6 pending=1" {
		t.Fatalf("counters %q, want held=1 idle=6 pending=1: Cleanup deleted a counter in use", got)
	}
	r.write(true, ordered("gone", "g3"))
	if got := counters(); got != "gone=1 held=1 idle=6 pending=1" {
		t.Fatalf("counters %q", got)
	}
	r.relay(pgstore.RelayConfig{Ordered: true, PollInterval: 50 * time.Millisecond})
	if got := r.take(4, 10*time.Second); len(got) != 4 {
		t.Fatalf("%d messages, want 4", len(got))
	}
}

// TestWriteOrderedOppositeOrders: two transactions writing messages of
// two order keys in opposite orders deadlock on the keys' counters, as
// docs/relay.md says: the server aborts one (SQLSTATE 40P01), the other
// goes through; retried, both commit.
func TestWriteOrderedOppositeOrders(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	ordered := func(key string) pgstore.Message {
		m := r.msg(key)
		m.OrderKey = key
		return m
	}
	t1, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = t1.Rollback(ctx) }()
	t2, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = t2.Rollback(ctx) }()
	for _, w := range []struct {
		tx  pgx.Tx
		key string
	}{{t1, "a"}, {t2, "b"}} {
		if _, err := r.ob.Write(ctx, w.tx, ordered(w.key)); err != nil {
			t.Fatal(err)
		}
	}
	errs := make(chan error, 2)
	go func() { _, err := r.ob.Write(ctx, t1, ordered("b")); errs <- err }()
	go func() { _, err := r.ob.Write(ctx, t2, ordered("a")); errs <- err }()
	var deadlocks, ok int
	for range 2 {
		err := <-errs
		var pe *pgconn.PgError
		switch {
		case err == nil:
			ok++
		case errors.As(err, &pe) && pe.Code == "40P01":
			deadlocks++
		default:
			t.Fatalf("Write: %v, want nil or a deadlock (40P01)", err)
		}
	}
	if deadlocks != 1 || ok != 1 {
		t.Fatalf("%d deadlocks, %d Writes through; want one of each", deadlocks, ok)
	}
	for _, tx := range []pgx.Tx{t1, t2} {
		_ = tx.Rollback(ctx)
	}
	r.write(true, ordered("a"), ordered("b"))
	r.relay(pgstore.RelayConfig{Ordered: true, PollInterval: 50 * time.Millisecond})
	if got := r.take(2, 10*time.Second); len(got) != 2 {
		t.Fatalf("%d messages, want 2", len(got))
	}
}

// TestRelayOrderedChainStopsAtAClaim: a chain ends before a row another
// relay still holds. The rows 2 and 3 of a key are claimed by a relay
// ("ghost", for an hour) when the key's dead row 1 is re-driven ahead of
// them: a relay takes row 1 and publishes it, but not 2 and 3, until the
// ghost's claim ends.
func TestRelayOrderedChainStopsAtAClaim(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()
	var msgs []pgstore.Message
	for i := 1; i <= 3; i++ {
		m := r.msg(fmt.Sprint(i))
		m.OrderKey = "k"
		msgs = append(msgs, m)
	}
	r.write(true, msgs...)
	if _, err := r.pool.Exec(ctx, "UPDATE "+table+" SET state = 'd' WHERE seq = 1"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.pool.Exec(ctx, "UPDATE "+table+" SET claimed_by = 'ghost', due_at = clock_timestamp() + interval '1 hour' WHERE seq > 1"); err != nil {
		t.Fatal(err)
	}
	if n, err := r.ob.Redrive(ctx); err != nil || n != 1 {
		t.Fatalf("Redrive = %d, %v", n, err)
	}
	r.relay(pgstore.RelayConfig{Ordered: true, PollInterval: 50 * time.Millisecond})
	if got := r.take(1, 10*time.Second); len(got) != 1 || string(got[0].Body) != "1" {
		t.Fatalf("published %d messages, first %q; want only 1: the ghost's claim holds 2 and 3", len(got), got[0].Body)
	}
	if _, err := r.pool.Exec(ctx, "UPDATE "+table+" SET due_at = clock_timestamp() WHERE claimed_by = 'ghost'"); err != nil {
		t.Fatal(err)
	}
	got := r.take(2, 10*time.Second)
	if len(got) != 2 || string(got[0].Body) != "2" || string(got[1].Body) != "3" {
		t.Fatalf("after the ghost's claim: %d messages, want 2 then 3", len(got))
	}
}

// TestWriteOrderedWithoutCounter: a key whose counter is gone while it has
// pending rows (an outbox moved without its counters table) numbers its
// next message after them, not from 1 ahead of them.
func TestWriteOrderedWithoutCounter(t *testing.T) {
	r := newOutboxRig(t)
	ctx := context.Background()
	ordered := func(body string) pgstore.Message {
		m := r.msg(body)
		m.OrderKey = "k"
		return m
	}
	r.write(true, ordered("1"), ordered("2"))
	keys := pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable + "_keys"}.Sanitize()
	if _, err := r.pool.Exec(ctx, "TRUNCATE "+keys); err != nil {
		t.Fatal(err)
	}
	r.write(true, ordered("3"))
	r.relay(pgstore.RelayConfig{Ordered: true, PollInterval: 50 * time.Millisecond})
	var got []string
	for _, d := range r.take(3, 10*time.Second) {
		got = append(got, string(d.Body))
	}
	if fmt.Sprint(got) != "[1 2 3]" {
		t.Fatalf("published %v, want [1 2 3]", got)
	}
}
