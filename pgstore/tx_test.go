package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// rig is one queue consumed by an amqpidem.Consumer on a pgstore Store, in
// a schema of its own holding the records and an effects table.
type rig struct {
	t      *testing.T
	pool   *pgxpool.Pool
	cfg    pgstore.Config
	store  *pgstore.Store
	queue  string
	events chan amqpidem.Event
	ch     *amqp.Channel
}

func newRig(t *testing.T) *rig {
	t.Helper()
	return newRigWith(t, pgstore.Config{})
}

// newRigWith is newRig with the Store's Config base (its Schema and
// CleanupInterval set by the rig).
func newRigWith(t *testing.T, base pgstore.Config) *rig {
	t.Helper()
	pool := pgenv.Pool(t, 16)
	base.CleanupInterval = -1
	cfg := schema(t, pool, base)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{cfg.Schema, "effects"}.Sanitize()+" (op text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	r := &rig{t: t, pool: pool, cfg: cfg, store: newStore(t, pool, cfg), queue: testenv.Name(t),
		events: make(chan amqpidem.Event, 100)}
	r.ch = testenv.QueueChannel(t, r.queue)
	return r
}

// effects returns the effect rows per operation.
func (r *rig) effects() map[string]int {
	r.t.Helper()
	rows, err := r.pool.Query(context.Background(), "SELECT op, count(*) FROM "+pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize()+" GROUP BY op")
	if err != nil {
		r.t.Fatal(err)
	}
	got := map[string]int{}
	var op string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&op, &n}, func() error { got[op] = n; return nil }); err != nil {
		r.t.Fatal(err)
	}
	return got
}

// insert is the effect: a plain INSERT, not idempotent by itself.
func (r *rig) insert(ctx context.Context, tx pgx.Tx, op string) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize()+" (op) VALUES ($1)", op)
	return err
}

// run consumes the queue with h until the test ends.
func (r *rig) run(h amqpidem.Handler, tune func(*amqpidem.ConsumerConfig)) {
	r.t.Helper()
	cfg := amqpidem.ConsumerConfig{
		URL:         testenv.AMQPURL(r.t),
		Concurrency: 8, // below the pool's 16: a TxHandler holds one each
		Config: amqpidem.Config{
			Queue:            r.queue,
			LeaseTTL:         3 * time.Second,
			UnavailableDelay: 100 * time.Millisecond,
			Backoff:          func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
			Logger:           slog.New(slog.DiscardHandler),
			Observer:         amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { r.events <- e }),
		},
	}
	if tune != nil {
		tune(&cfg)
	}
	c, err := amqpidem.NewConsumer(r.store, cfg, h)
	if err != nil {
		r.t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	r.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := c.Shutdown(ctx); err != nil {
			r.t.Errorf("Shutdown: %v", err)
		}
		if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
			r.t.Errorf("Run: %v", err)
		}
	})
}

func (r *rig) publish(ids ...string) {
	r.t.Helper()
	for _, id := range ids {
		err := r.ch.PublishWithContext(context.Background(), "", r.queue, false, false,
			amqp.Publishing{MessageId: id, DeliveryMode: amqp.Persistent, Body: []byte("pay " + id)})
		if err != nil {
			r.t.Fatal(err)
		}
	}
}

// wait returns the next n events, failing after 20 s.
func (r *rig) wait(n int) []amqpidem.Event {
	r.t.Helper()
	var got []amqpidem.Event
	timeout := time.After(20 * time.Second)
	for len(got) < n {
		select {
		case e := <-r.events:
			got = append(got, e)
		case <-timeout:
			r.t.Fatalf("got %d events, want %d: %+v", len(got), n, got)
		}
	}
	return got
}

// waitFor returns events until one for key has outcome o.
func (r *rig) waitFor(key string, o amqpidem.Outcome) []amqpidem.Event {
	r.t.Helper()
	var got []amqpidem.Event
	timeout := time.After(20 * time.Second)
	for {
		select {
		case e := <-r.events:
			got = append(got, e)
			if e.Key == key && e.Outcome == o {
				return got
			}
		case <-timeout:
			r.t.Fatalf("no %v event for %q in 20s; got %+v", o, key, got)
		}
	}
}

func outcomes(evs []amqpidem.Event) string {
	s := ""
	for _, e := range evs {
		s += fmt.Sprintf("[%s %v %q] ", e.Key, e.Outcome, e.Reason)
	}
	return s
}

// TestTxHandlerCommitsEffectWithRecord: the effect and the completed record
// are written by one transaction (the rows share their xmin), and a
// duplicate runs nothing.
func TestTxHandlerCommitsEffectWithRecord(t *testing.T) {
	r := newRig(t)
	var runs atomic.Int32
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		runs.Add(1)
		return []byte("receipt " + d.MessageId), r.insert(ctx, tx, d.MessageId)
	}), nil)
	r.publish("a", "b")
	r.wait(2)
	r.publish("a")
	evs := r.wait(1)
	if evs[0].Outcome != amqpidem.Duplicate {
		t.Fatalf("the copy of a: %s, want a duplicate", outcomes(evs))
	}
	if got := r.effects(); got["a"] != 1 || got["b"] != 1 || len(got) != 2 || runs.Load() != 2 {
		t.Fatalf("effects %v after %d runs, want one row each for a and b after 2 runs", got, runs.Load())
	}
	var same bool
	err := r.pool.QueryRow(context.Background(), fmt.Sprintf(
		`SELECT (SELECT xmin::text FROM %s WHERE op = 'a') = (SELECT xmin::text FROM %s WHERE key = $1 AND state = 'c')`,
		pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize(), pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()),
		[]byte(amqpidem.StoreKey(r.queue, "a"))).Scan(&same)
	if err != nil {
		t.Fatal(err)
	}
	if !same {
		t.Fatal("the effect row and the completed record were not written by the same transaction")
	}
}

// TestTxHandlerLeaseLostRollsBack: when another consumer takes the key
// over while the handler runs, the completion's compare-and-set fails and
// the handler's effect rolls back with it. (A lease held by a transaction
// is taken over only once the server ended that transaction:
// TestHeldLeasePausedHolderLosesIt.)
func TestTxHandlerLeaseLostRollsBack(t *testing.T) {
	r := newRigWith(t, pgstore.Config{RowLeases: true})
	var runs atomic.Int32
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if runs.Add(1) == 1 {
			// Another consumer takes the key over (the lease made to look
			// expired), then gives it back as if it crashed before doing
			// anything.
			bg := context.Background()
			key := amqpidem.StoreKey(r.queue, d.MessageId)
			if _, err := r.pool.Exec(bg, "UPDATE "+table+" SET deadline = clock_timestamp() - interval '1 ms' WHERE key = $1", []byte(key)); err != nil {
				return nil, err
			}
			res, err := r.store.Acquire(bg, lock.Request{Key: key})
			if err != nil || res.Status != lock.Acquired {
				return nil, fmt.Errorf("takeover: %+v, %v", res, err)
			}
			if err := r.store.Release(bg, res.Lease); err != nil {
				return nil, err
			}
		}
		return nil, nil
	}), nil)
	r.publish("x")
	evs := r.waitFor("x", amqpidem.Completed)
	if evs[0].Outcome != amqpidem.Abandoned || evs[0].Reason != "lease lost" {
		t.Fatalf("first execution: %s, want abandoned, lease lost", outcomes(evs))
	}
	if got := r.effects(); got["x"] != 1 || runs.Load() != 2 {
		t.Fatalf("effects %v after %d runs, want 1 row after 2 runs (the first rolled back)", got, runs.Load())
	}
}

// TestTxHandlerErrorRollsBack: a handler error rolls its writes back, and
// the retry writes them once.
func TestTxHandlerErrorRollsBack(t *testing.T) {
	r := newRig(t)
	var runs atomic.Int32
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if runs.Add(1) < 3 {
			return nil, errors.New("the card network timed out")
		}
		return nil, nil
	}), nil)
	r.publish("e")
	evs := r.waitFor("e", amqpidem.Completed)
	if len(evs) != 3 || evs[0].Outcome != amqpidem.Retried {
		t.Fatalf("events %s, want two retries then completed", outcomes(evs))
	}
	if got := r.effects(); got["e"] != 1 {
		t.Fatalf("effects %v, want 1 row for e", got)
	}
}

// answerLost is a Completer whose commit lands but whose answer is lost:
// what a connection dropped during COMMIT, after the server committed,
// looks like.
type answerLost struct {
	amqpidem.Completer
	lost atomic.Int32
}

func (a *answerLost) HandleComplete(ctx context.Context, d *amqp.Delivery, l lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	result, err := a.Completer.HandleComplete(ctx, d, l, value)
	if err == nil && a.lost.Add(1) == 1 {
		return nil, fmt.Errorf("%w: connection reset during COMMIT", lock.ErrUnavailable)
	}
	return result, err
}

// TestTxHandlerCommitAnswerLost: a commit whose outcome the consumer does
// not know is resolved by the record on the redelivery: a duplicate, not a
// second effect.
func TestTxHandlerCommitAnswerLost(t *testing.T) {
	r := newRig(t)
	var runs atomic.Int32
	h := &answerLost{Completer: r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, r.insert(ctx, tx, d.MessageId)
	}).(amqpidem.Completer)}
	r.run(h, nil)
	r.publish("u")
	evs := r.waitFor("u", amqpidem.Duplicate)
	if evs[0].Outcome != amqpidem.Abandoned || evs[0].Reason != "store unavailable" {
		t.Fatalf("events %s, want abandoned (store unavailable), then a duplicate", outcomes(evs))
	}
	if got := r.effects(); got["u"] != 1 || runs.Load() != 1 {
		t.Fatalf("effects %v after %d runs, want 1 row after 1 run", got, runs.Load())
	}
}

// TestTxHandlerConnectionKilled: the transaction's backend terminated
// (pg_terminate_backend) in the middle of the work: nothing commits, the
// message is requeued (the lease, held by that transaction, lost with it),
// and its next delivery writes the effect once.
func TestTxHandlerConnectionKilled(t *testing.T) {
	r := newRig(t)
	var runs atomic.Int32
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if runs.Add(1) == 1 {
			pid := tx.Conn().PgConn().PID()
			if _, err := r.pool.Exec(context.Background(), "SELECT pg_terminate_backend($1)", pid); err != nil {
				return nil, err
			}
		}
		return nil, r.insert(ctx, tx, d.MessageId+"-second-statement")
	}), nil)
	r.publish("k")
	evs := r.waitFor("k", amqpidem.Completed)
	if evs[0].Outcome != amqpidem.Abandoned || evs[0].Reason != "lease lost" {
		t.Fatalf("events %s, want abandoned (lease lost), then completed", outcomes(evs))
	}
	if got := r.effects(); got["k"] != 1 || got["k-second-statement"] != 1 || runs.Load() != 2 {
		t.Fatalf("effects %v after %d runs, want one row of each statement after 2 runs", got, runs.Load())
	}
}

// TestTxHandlerUnkeyed: a message without a key, under ProcessMissingKey,
// runs in a transaction with no record.
func TestTxHandlerUnkeyed(t *testing.T) {
	r := newRig(t)
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return nil, r.insert(ctx, tx, "unkeyed")
	}), func(c *amqpidem.ConsumerConfig) { c.MissingKey = amqpidem.ProcessMissingKey })
	r.publish("", "")
	evs := r.wait(2)
	for _, e := range evs {
		if e.Outcome != amqpidem.Completed {
			t.Fatalf("events %s, want two completed", outcomes(evs))
		}
	}
	if got := r.effects(); got["unkeyed"] != 2 || rows(t, r.pool, r.cfg) != 0 {
		t.Fatalf("effects %v, %d records; want 2 rows (no idempotency without a key) and no record", got, rows(t, r.pool, r.cfg))
	}
}

// TestTxHandlerResultTooLarge: a result over the limit rolls the effect
// back and fails the message for good.
func TestTxHandlerResultTooLarge(t *testing.T) {
	r := newRig(t)
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return make([]byte, 2000), r.insert(ctx, tx, d.MessageId)
	}), func(c *amqpidem.ConsumerConfig) { c.MaxResultSize = 1000 })
	r.publish("big")
	evs := r.wait(1)
	if evs[0].Outcome != amqpidem.DeadLettered || evs[0].Reason != "result too large" {
		t.Fatalf("events %s, want dead-lettered, result too large", outcomes(evs))
	}
	if got := r.effects(); len(got) != 0 {
		t.Fatalf("effects %v, want none (rolled back)", got)
	}
}

func TestTxHandlerNeedsItsStore(t *testing.T) {
	pool := pgenv.Pool(t, 2)
	s := newStore(t, pool, pgstore.Config{CleanupInterval: -1})
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	h := s.TxHandler(func(context.Context, pgx.Tx, *amqp.Delivery) ([]byte, error) { return nil, nil })
	_, err = amqpidem.NewConsumer(mem, amqpidem.ConsumerConfig{URL: "amqp://127.0.0.1:1/", Config: amqpidem.Config{Queue: "q"}}, h)
	if err == nil {
		t.Fatal("NewConsumer with a TxHandler of another store: nil error")
	}
}

// TestTxHandlerWrap: the transactional form under Wrap, with the caller's
// own delivery loop.
func TestTxHandlerWrap(t *testing.T) {
	r := newRig(t)
	conn, err := amqp.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	w, err := amqpidem.Wrap(conn, r.store, amqpidem.Config{Queue: r.queue, Logger: slog.New(slog.DiscardHandler)},
		r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, r.insert(ctx, tx, d.MessageId)
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Shutdown(context.Background()) })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := ch.Consume(r.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.publish("w1", "w1")
	var got []amqpidem.Outcome
	for range 2 {
		select {
		case d := <-msgs:
			got = append(got, w.Handle(context.Background(), d).Outcome)
		case <-time.After(10 * time.Second):
			t.Fatalf("no delivery; outcomes so far %v", got)
		}
	}
	if got[0] != amqpidem.Completed || got[1] != amqpidem.Duplicate {
		t.Fatalf("outcomes %v, want completed then duplicate", got)
	}
	if e := r.effects(); e["w1"] != 1 {
		t.Fatalf("effects %v, want 1 row", e)
	}
}

// TestPlainHandler: the ordinary handler form works on this store too, with
// the record completed in a statement of its own after the handler.
func TestPlainHandler(t *testing.T) {
	r := newRig(t)
	var runs atomic.Int32
	r.run(amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		runs.Add(1)
		return []byte("ok"), nil
	}), nil)
	r.publish("p", "p", "q")
	// A copy of p may come while p runs (busy, requeued): count until
	// every message settled.
	var evs []amqpidem.Event
	var completed, duplicates int
	for completed+duplicates < 3 {
		e := r.wait(1)[0]
		evs = append(evs, e)
		switch e.Outcome {
		case amqpidem.Completed:
			completed++
		case amqpidem.Duplicate:
			duplicates++
		}
	}
	if completed != 2 || duplicates != 1 || runs.Load() != 2 {
		t.Fatalf("events %s after %d runs, want 2 completed, 1 duplicate, 2 runs", outcomes(evs), runs.Load())
	}
}

// TestTxHandlerTimeoutInQuery: a handler timeout that strikes during a
// query (pgx closes the connection) is a handler timeout, retried with
// backoff, not a store outage.
func TestTxHandlerTimeoutInQuery(t *testing.T) {
	r := newRig(t)
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		_, err := tx.Exec(ctx, "SELECT pg_sleep(2)")
		return nil, err
	}), func(c *amqpidem.ConsumerConfig) {
		c.HandlerTimeout = 200 * time.Millisecond
		c.MaxAttempts = 2
	})
	r.publish("slow")
	evs := r.waitFor("slow", amqpidem.DeadLettered)
	if evs[0].Outcome != amqpidem.Retried || evs[0].Reason != "handler timeout" || !errors.Is(evs[0].Err, amqpidem.ErrHandlerTimeout) {
		t.Fatalf("events %s (first error %v), want retried (handler timeout), then dead-lettered", outcomes(evs), evs[0].Err)
	}
}

// TestTxHandlerSearchPath: a handler that changes its transaction's
// search_path, to a schema with a table of the same name even, does not
// move the record's completion: the functions keep the search_path of the
// migration, and the statements of a held lease name the table in full.
func TestTxHandlerSearchPath(t *testing.T) {
	pool := pgenv.Pool(t, 8)
	ctx := context.Background()
	base := strings.ToLower(testenv.Name(t))
	records, decoy := base+"_records", base+"_tenant"
	for _, s := range []string{records, decoy} {
		if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s}.Sanitize()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{s}.Sanitize()+" CASCADE") })
	}
	// The records live in the first schema of the pool's search_path;
	// Config.Schema is empty, as in most programs.
	pcfg := pool.Config().Copy()
	pcfg.ConnConfig.RuntimeParams["search_path"] = records
	local, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(local.Close)
	cfg := pgstore.Config{CleanupInterval: -1}
	if err := pgstore.Migrate(ctx, local, cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{decoy, pgstore.DefaultTable}.Sanitize()+" (LIKE "+pgx.Identifier{records, pgstore.DefaultTable}.Sanitize()+")"); err != nil {
		t.Fatal(err)
	}
	s := newStore(t, local, cfg)
	h := s.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		_, err := tx.Exec(ctx, "SET LOCAL search_path = "+pgx.Identifier{decoy}.Sanitize()+", "+pgx.Identifier{records}.Sanitize())
		return nil, err
	})
	// A record-row lease (Acquire), and one held by the transaction
	// (AcquireLease), whose record is written by a statement of its own.
	for key, acquire := range map[string]func(lock.Request) (lock.Result, error){
		"row": func(req lock.Request) (lock.Result, error) { return s.Acquire(ctx, req) },
		"held": func(req lock.Request) (lock.Result, error) {
			return h.(amqpidem.LeaseTaker).AcquireLease(ctx, req, &amqp.Delivery{})
		},
	} {
		res, err := acquire(lock.Request{Key: key})
		if err != nil || res.Status != lock.Acquired {
			t.Fatalf("%s: %+v, %v", key, res, err)
		}
		_, err = h.(amqpidem.Completer).HandleComplete(ctx, &amqp.Delivery{}, res.Lease, func(r []byte) ([]byte, error) { return []byte("done"), nil })
		if err != nil {
			t.Fatalf("%s: HandleComplete: %v", key, err)
		}
		again, err := s.Acquire(ctx, lock.Request{Key: key})
		if err != nil || again.Status != lock.Completed {
			t.Fatalf("%s: after the completion: %+v, %v; want completed", key, again, err)
		}
	}
}

// TestTxHandlerOutbox: a message staged in the transaction is stored with
// the effect and the record, by the same commit; an execution that rolls
// back publishes nothing it staged; the committed one's message is
// published once, confirmed, and the record says so.
func TestTxHandlerOutbox(t *testing.T) {
	r := newRig(t)
	next := r.queue + ".next"
	if _, err := r.ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = r.ch.QueueDelete(next, false, false, false) })
	var runs atomic.Int32
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		n := runs.Add(1)
		if err := amqpidem.Stage(ctx, "", next, amqp.Publishing{Body: []byte(fmt.Sprintf("run %d", n))}); err != nil {
			return nil, err
		}
		if n == 1 {
			return nil, errors.New("rolled back after staging")
		}
		return nil, nil
	}), nil)
	r.publish("o")
	evs := r.waitFor("o", amqpidem.Completed)
	if last := evs[len(evs)-1]; last.Outbox != (amqpidem.OutboxCounts{Staged: 1, Published: 1}) {
		t.Fatalf("events %s, outbox %+v", outcomes(evs), last.Outbox)
	}
	m, ok, err := r.ch.Get(next, true)
	if err != nil || !ok || string(m.Body) != "run 2" {
		t.Fatalf("staged message: %q %v %v; want the committed run's", m.Body, ok, err)
	}
	if _, ok, _ := r.ch.Get(next, true); ok {
		t.Fatal("a second staged message was published")
	}
	if got := r.effects(); got["o"] != 1 {
		t.Fatalf("effects %v, want 1 row for o", got)
	}
	res, err := r.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(r.queue, "o")})
	if err != nil || res.Status != lock.Completed {
		t.Fatal(res.Status, err)
	}
	msgs, err := amqpidem.StoredOutbox(res.Value)
	if err != nil || len(msgs) != 1 || msgs[0].State != amqpidem.OutboxPublished || msgs[0].Msg.MessageId != m.MessageId {
		t.Fatalf("record's outbox: %+v %v", msgs, err)
	}
}

// TestTxHandlerNotMigratedForFinishTx: on a database migrated by a release
// without <table>_finish_tx, TxHandler's completion commits nothing and
// says to migrate (unavailable: the message waits), Check says so too, and
// after Migrate the same lease completes with its effect once.
func TestTxHandlerNotMigratedForFinishTx(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	drop := "DROP FUNCTION " + pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable + "_finish_tx"}.Sanitize()
	if _, err := r.pool.Exec(ctx, drop); err != nil {
		t.Fatal(err)
	}
	if err := r.store.Check(ctx); err == nil || !strings.Contains(err.Error(), "run pgstore.Migrate") {
		t.Fatalf("Check: got %v, want an error saying to run pgstore.Migrate", err)
	}
	h := r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return nil, r.insert(ctx, tx, d.MessageId)
	}).(amqpidem.Completer)
	res, err := r.store.Acquire(ctx, lock.Request{Key: "m"})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %+v, %v", res, err)
	}
	same := func(b []byte) ([]byte, error) { return b, nil }
	d := &amqp.Delivery{MessageId: "m"}
	_, err = h.HandleComplete(ctx, d, res.Lease, same)
	if !errors.Is(err, lock.ErrUnavailable) || !strings.Contains(err.Error(), "pgstore.Migrate") {
		t.Fatalf("HandleComplete without finish_tx: got %v, want lock.ErrUnavailable saying to migrate", err)
	}
	if got := r.effects(); got["m"] != 0 {
		t.Fatalf("effects %v after a completion that could not run, want none", got)
	}
	if err := pgstore.Migrate(ctx, r.pool, r.cfg); err != nil {
		t.Fatal(err)
	}
	if _, err := h.HandleComplete(ctx, d, res.Lease, same); err != nil {
		t.Fatalf("HandleComplete after Migrate: %v", err)
	}
	if got := r.effects(); got["m"] != 1 {
		t.Fatalf("effects %v, want 1 row for m", got)
	}
	again, err := r.store.Acquire(ctx, lock.Request{Key: "m"})
	if err != nil || again.Status != lock.Completed {
		t.Fatalf("Acquire after the completion: %+v, %v, want completed", again, err)
	}
}
