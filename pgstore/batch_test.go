package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// batchConfig is the ConsumerConfig of the batch tests on r's queue.
func batchConfig(t testing.TB, queue string, events chan amqpidem.Event) amqpidem.ConsumerConfig {
	cfg := amqpidem.ConsumerConfig{
		URL:       testenv.AMQPURL(t),
		BatchSize: 10,
		BatchWait: 20 * time.Millisecond,
		Config: amqpidem.Config{
			Queue:            queue,
			LeaseTTL:         2 * time.Second,
			UnavailableDelay: 100 * time.Millisecond,
			Backoff:          func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
			Logger:           slog.New(slog.DiscardHandler),
		},
	}
	if events != nil {
		cfg.Observer = amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { events <- e })
	}
	return cfg
}

// runBatch consumes r's queue with the batch handler h until the test ends.
func (r *rig) runBatch(h amqpidem.BatchHandler, tune func(*amqpidem.ConsumerConfig)) {
	r.t.Helper()
	cfg := batchConfig(r.t, r.queue, r.events)
	if tune != nil {
		tune(&cfg)
	}
	c, err := amqpidem.NewBatchConsumer(r.store, cfg, h)
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

// publishOnce publishes ops and, once each settled (completed or
// dead-lettered), fails the test for each whose effect is not there
// exactly once: its work committed once, never run again.
func (r *rig) publishOnce(ops []string) {
	r.t.Helper()
	r.publish(ops...)
	evs := r.settled(ops, amqpidem.DeadLettered, amqpidem.Completed)
	got := r.effects()
	for _, op := range ops {
		if got[op] != 1 {
			r.t.Errorf("%s: %d effect rows, events %s; want 1 (its work committed once, never run again)", op, got[op], outcomes(evs[op]))
		}
	}
}

// settled waits until every key of keys had an event with one of the
// outcomes, and returns all events seen, per key.
func (r *rig) settled(keys []string, outcomes ...amqpidem.Outcome) map[string][]amqpidem.Event {
	r.t.Helper()
	want := map[string]bool{}
	for _, k := range keys {
		want[k] = true
	}
	got := map[string][]amqpidem.Event{}
	timeout := time.After(60 * time.Second)
	for len(want) > 0 {
		select {
		case e := <-r.events:
			got[e.Key] = append(got[e.Key], e)
			for _, o := range outcomes {
				if e.Outcome == o {
					delete(want, e.Key)
				}
			}
		case <-timeout:
			r.t.Fatalf("%d keys not settled in 60s, e.g. %v", len(want), want)
		}
	}
	return got
}

// ids returns n message ids with prefix.
func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%03d", prefix, i)
	}
	return out
}

// xmins returns, per op, whether its effect row and its record row were
// written by the same transaction (they share their xmin), and how many
// transactions wrote the effects.
func (r *rig) xmins(ops []string) (same map[string]bool, txs int) {
	r.t.Helper()
	ctx := context.Background()
	effects := pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()
	same = map[string]bool{}
	for _, op := range ops {
		var ok bool
		err := r.pool.QueryRow(ctx, "SELECT e.xmin = t.xmin AND t.state = 'c' FROM "+effects+" e, "+table+" t WHERE e.op = $1 AND t.key = $2",
			op, []byte(amqpidem.StoreKey(r.queue, op))).Scan(&ok)
		if err != nil {
			r.t.Fatalf("%s: %v", op, err)
		}
		same[op] = ok
	}
	if err := r.pool.QueryRow(ctx, "SELECT count(DISTINCT xmin::text) FROM "+effects).Scan(&txs); err != nil {
		r.t.Fatal(err)
	}
	return same, txs
}

// TestBatchOneCommitPerBatch: a batch's effects and records commit in one
// transaction (they share their xmin), far fewer transactions than
// messages; every message runs once, duplicates (published again while
// or after the first copy runs) are settled as busy or duplicate and
// never given to the handler. Its leases are held by a session
// (AcquireLeaseBatch): no transaction but the batches' writes a record,
// one commit per batch.
func TestBatchOneCommitPerBatch(t *testing.T) {
	r := newRig(t)
	writers := r.logWriters()
	testOneCommitPerBatch(t, r)
	if extra := writers(); extra != 0 {
		t.Errorf("%d transactions wrote records without effects: want 0 (one commit per batch)", extra)
	}
}

// TestBatchOneCommitPerBatchRowLeases is TestBatchOneCommitPerBatch with
// Config.RowLeases: record-row leases, taken by AcquireBatch, each batch
// committing its leases in a transaction of their own before its work.
func TestBatchOneCommitPerBatchRowLeases(t *testing.T) {
	r := newRigWith(t, pgstore.Config{RowLeases: true})
	writers := r.logWriters()
	testOneCommitPerBatch(t, r)
	if extra := writers(); extra == 0 {
		t.Errorf("no transaction wrote records without effects: the leases were not record rows")
	}
}

// logWriters logs, by a trigger, the transaction of every row written
// to the records table and to the effects table, and returns a function
// that counts the committed transactions that wrote records and no
// effects.
func (r *rig) logWriters() func() int {
	r.t.Helper()
	ctx := context.Background()
	log := pgx.Identifier{r.cfg.Schema, "writers"}.Sanitize()
	fn := pgx.Identifier{r.cfg.Schema, "log_writer"}.Sanitize()
	for _, q := range []string{
		"CREATE TABLE " + log + " (tbl text NOT NULL, xid xid8 NOT NULL)",
		"CREATE FUNCTION " + fn + "() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN INSERT INTO " + log +
			" VALUES (TG_TABLE_NAME, pg_current_xact_id()); RETURN NULL; END $$",
		"CREATE TRIGGER log_writer AFTER INSERT OR UPDATE ON " + pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize() +
			" FOR EACH ROW EXECUTE FUNCTION " + fn + "()",
		"CREATE TRIGGER log_writer AFTER INSERT OR UPDATE ON " + pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize() +
			" FOR EACH ROW EXECUTE FUNCTION " + fn + "()",
	} {
		if _, err := r.pool.Exec(ctx, q); err != nil {
			r.t.Fatal(err)
		}
	}
	return func() int {
		r.t.Helper()
		var n, all int
		err := r.pool.QueryRow(ctx, "SELECT count(DISTINCT xid) FILTER (WHERE tbl <> 'effects' AND xid NOT IN (SELECT xid FROM "+log+
			" WHERE tbl = 'effects')), count(DISTINCT xid) FROM "+log).Scan(&n, &all)
		if err != nil {
			r.t.Fatal(err)
		}
		r.t.Logf("%d transactions wrote records or effects, %d of them records only", all, n)
		return n
	}
}

// testOneCommitPerBatch is TestBatchOneCommitPerBatch on r.
func testOneCommitPerBatch(t *testing.T, r *rig) {
	var mu sync.Mutex
	runs := map[string]int{}
	largest := 0
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		mu.Lock()
		largest = max(largest, len(ds))
		for _, d := range ds {
			runs[d.MessageId]++
		}
		mu.Unlock()
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		return nil, nil
	}), nil)
	ops := ids("m", 60)
	r.publish(ops...)
	r.publish(ops[:10]...) // duplicates
	evs := r.settled(ops, amqpidem.Completed)
	dups := 0
	for _, es := range evs {
		for _, e := range es {
			if e.Outcome == amqpidem.Duplicate {
				dups++
			}
		}
	}
	for dups < 10 { // the duplicates end acked as such (busy ones requeued first)
		select {
		case e := <-r.events:
			if e.Outcome == amqpidem.Duplicate {
				dups++
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("%d duplicates acked, want 10", dups)
		}
	}
	got := r.effects()
	mu.Lock()
	defer mu.Unlock()
	for _, op := range ops {
		if got[op] != 1 || runs[op] != 1 {
			t.Errorf("%s: %d effects after %d runs, want 1 and 1", op, got[op], runs[op])
		}
	}
	same, txs := r.xmins(ops)
	for op, ok := range same {
		if !ok {
			t.Errorf("%s: effect and completed record not written by one transaction", op)
		}
	}
	if largest < 2 || txs >= len(ops)/2 {
		t.Errorf("largest batch %d, %d transactions for %d messages: not batched", largest, txs, len(ops))
	}
	t.Logf("%d messages in %d transactions, largest batch %d", len(ops), txs, largest)
}

// TestBatchPoisonBisected: a message that makes its whole batch fail (an
// error, or a panic) is split out of it: its neighbours complete once,
// on their first attempt, and it alone goes through its attempts and is
// dead-lettered.
func TestBatchPoisonBisected(t *testing.T) {
	r := newRig(t)
	var mu sync.Mutex
	runs := map[string]int{}
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		mu.Lock()
		for _, d := range ds {
			runs[d.MessageId]++
		}
		mu.Unlock()
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		for _, d := range ds {
			switch d.MessageId {
			case "p005":
				return nil, errors.New("the batch broke")
			case "p013":
				panic("poison")
			}
		}
		return nil, nil
	}), func(c *amqpidem.ConsumerConfig) { c.MaxAttempts = 3 })
	ops := ids("p", 30)
	r.publish(ops...)
	evs := r.settled(ops, amqpidem.Completed, amqpidem.DeadLettered)
	got := r.effects()
	for _, op := range ops {
		last := evs[op][len(evs[op])-1]
		switch op {
		case "p005", "p013":
			if last.Outcome != amqpidem.DeadLettered || last.Attempt != 3 || got[op] != 0 {
				t.Errorf("%s: %v at attempt %d, %d effects; want dead-lettered at attempt 3, no effect", op, last.Outcome, last.Attempt, got[op])
			}
		default:
			if last.Outcome != amqpidem.Completed || last.Attempt != 1 || got[op] != 1 {
				t.Errorf("%s: %v at attempt %d, %d effects; want completed at attempt 1, 1 effect", op, last.Outcome, last.Attempt, got[op])
			}
		}
	}
	mu.Lock()
	t.Logf("runs of p005 %d, p013 %d, p000 %d", runs["p005"], runs["p013"], runs["p000"])
	mu.Unlock()
}

// TestBatchItemFailures: the handler answers per message: the ones it
// fails are retried (or dead-lettered, Permanent) on their own, the rest
// of the batch commits once.
func TestBatchItemFailures(t *testing.T) {
	r := newRig(t)
	var tries atomic.Int32
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		rs := make([]amqpidem.BatchResult, len(ds))
		for i, d := range ds {
			switch {
			case d.MessageId == "i003" && tries.Add(1) == 1:
				rs[i].Err = errors.New("try again")
				continue
			case d.MessageId == "i007":
				rs[i].Err = amqpidem.Permanent(errors.New("declined"))
				continue
			}
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
			rs[i].Result = []byte("ok " + d.MessageId)
		}
		return rs, nil
	}), nil)
	ops := ids("i", 12)
	r.publish(ops...)
	evs := r.settled(ops, amqpidem.Completed, amqpidem.DeadLettered)
	got := r.effects()
	for _, op := range ops {
		var outs []amqpidem.Outcome
		for _, e := range evs[op] {
			outs = append(outs, e.Outcome)
		}
		want := fmt.Sprint([]amqpidem.Outcome{amqpidem.Completed})
		switch op {
		case "i003":
			want = fmt.Sprint([]amqpidem.Outcome{amqpidem.Retried, amqpidem.Completed})
		case "i007":
			want = fmt.Sprint([]amqpidem.Outcome{amqpidem.DeadLettered})
		}
		wantEffects := 1
		if op == "i007" {
			wantEffects = 0
		}
		if fmt.Sprint(outs) != want || got[op] != wantEffects {
			t.Errorf("%s: %v, %d effects; want %s, %d", op, outs, got[op], want, wantEffects)
		}
	}
}

// TestBatchLeaseLost: another consumer takes over the key of one message
// of a running batch. Waiting: the heartbeat finds the lease lost and
// cancels the batch's context. Not waiting: the commit finds it. Either
// way nothing of that run commits, the message is requeued as "lease
// lost", and the rest of the batch runs again and commits once.
func TestBatchLeaseLost(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			// A takeover of a record-row lease (a lease held by a
			// session is lost only with its session: TestBatchKill9).
			r := newRigWith(t, pgstore.Config{RowLeases: true})
			table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()
			var first atomic.Bool
			cancelled := make(chan struct{}, 1)
			victim := make(chan string, 1)
			r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				if len(ds) < 2 || !first.CompareAndSwap(false, true) {
					return nil, nil
				}
				bg := context.Background()
				key := amqpidem.StoreKey(r.queue, ds[1].MessageId)
				victim <- ds[1].MessageId
				if _, err := r.pool.Exec(bg, "UPDATE "+table+" SET deadline = clock_timestamp() - interval '1 ms' WHERE key = $1", []byte(key)); err != nil {
					return nil, err
				}
				res, err := r.store.Acquire(bg, lock.Request{Key: key, TTL: time.Second})
				if err != nil || res.Status != lock.Acquired {
					return nil, fmt.Errorf("takeover: %+v, %v", res, err)
				}
				if err := r.store.Release(bg, res.Lease); err != nil {
					return nil, err
				}
				if !wait {
					return nil, nil // the commit finds the lease lost
				}
				select {
				case <-ctx.Done():
					cancelled <- struct{}{}
					return nil, ctx.Err()
				case <-time.After(10 * time.Second):
					return nil, errors.New("the batch's context was not cancelled")
				}
			}), func(c *amqpidem.ConsumerConfig) { c.BatchWait = 200 * time.Millisecond })
			ops := ids("l", 10)
			r.publish(ops...)
			evs := r.settled(ops, amqpidem.Completed)
			v := <-victim
			if wait && len(cancelled) == 0 {
				t.Error("the batch's context was not cancelled")
			}
			got := r.effects()
			for _, op := range ops {
				if got[op] != 1 {
					t.Errorf("%s: %d effects, want 1", op, got[op])
				}
			}
			if first := evs[v][0]; first.Outcome != amqpidem.Abandoned || first.Reason != "lease lost" {
				t.Errorf("victim %s: first %v %q, want abandoned, lease lost", v, first.Outcome, first.Reason)
			}
		})
	}
}

// Environment of TestBatchKillChild, set by TestBatchKill9.
const (
	envChildSchema = "AMQPIDEM_BATCH_CHILD_SCHEMA"
	envChildQueue  = "AMQPIDEM_BATCH_CHILD_QUEUE"
	envChildPause  = "AMQPIDEM_BATCH_CHILD_PAUSE"
	envChildRandom = "AMQPIDEM_BATCH_CHILD_RANDOM"
)

// batchEffects is the batch function of the kill test: each message's
// effect is a plain INSERT. hang, when set, is called after the effects of
// a batch were written and before the commit.
func batchEffects(effects string, hang func(ops []string)) pgstore.BatchTxFunc {
	return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		ops := make([]string, len(ds))
		for i, d := range ds {
			ops[i] = d.MessageId
			if _, err := tx.Exec(ctx, "INSERT INTO "+effects+" (op) VALUES ($1)", d.MessageId); err != nil {
				return nil, err
			}
		}
		if hang != nil {
			hang(ops)
		}
		return nil, nil
	}
}

// TestBatchKillChild is the consumer TestBatchKill9 runs in a child
// process and kills: its third batch writes its effects, notes its ops in
// the table marks (outside the transaction), and hangs before its commit.
func TestBatchKillChild(t *testing.T) {
	schemaName, queue := os.Getenv(envChildSchema), os.Getenv(envChildQueue)
	if schemaName == "" {
		t.Skip("run by TestBatchKill9")
	}
	pool := pgenv.Pool(t, 16)
	store, err := pgstore.New(pool, pgstore.Config{Schema: schemaName, CleanupInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schemaName, "effects"}.Sanitize()
	if os.Getenv(envChildRandom) != "" {
		// TestBatchKillRandom's: killed whenever, poison messages mixed in.
		cfg := batchConfig(t, queue, nil)
		cfg.MaxAttempts = 3
		slow := func(ops []string) {
			time.Sleep(30 * time.Millisecond) // so that kills land in batches too
			poisoned(ops)
		}
		c, err := amqpidem.NewBatchConsumer(store, cfg, store.BatchTxHandler(batchEffects(effects, slow)))
		if err != nil {
			t.Fatal(err)
		}
		_ = c.Run(context.Background())
		return
	}
	var n atomic.Int32
	h := store.BatchTxHandler(batchEffects(effects, func(ops []string) {
		if n.Add(1) != 3 {
			return
		}
		_, err := pool.Exec(context.Background(), "INSERT INTO "+pgx.Identifier{schemaName, "marks"}.Sanitize()+" SELECT unnest($1::text[])", ops)
		if err != nil {
			t.Error(err)
		}
		if os.Getenv(envChildPause) != "" {
			// Paused (SIGSTOP) here by TestBatchSigstop, past its leases'
			// TTL, then resumed: its commit must find the leases lost.
			time.Sleep(3 * time.Second)
			return
		}
		time.Sleep(time.Minute) // killed here, between the effects and the commit
	}))
	cfg := batchConfig(t, queue, nil)
	cfg.Prefetch, cfg.Concurrency = 20, 20
	c, err := amqpidem.NewBatchConsumer(store, cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println("child consuming")
	_ = c.Run(context.Background())
}

// TestBatchKill9: a consumer process killed (SIGKILL) in the middle of a
// batch, after its effects were written and before their commit, loses
// nothing and duplicates nothing: that batch's effects never committed,
// and a new consumer runs every message once (the redelivered ones whose
// batch committed before the kill as duplicates).
func TestBatchKill9(t *testing.T) {
	r, ops, proc, hung := startHungChild(t, false)
	proc.Kill()
	got := r.effects()
	for _, op := range hung {
		if got[op] != 0 {
			t.Errorf("%s: effect of the killed batch committed", op)
		}
	}
	before := 0
	for _, n := range got {
		before += n
	}
	t.Logf("killed in a batch of %d, with %d effects committed before", len(hung), before)
	r.runBatch(r.store.BatchTxHandler(batchEffects(pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize(), nil)),
		func(c *amqpidem.ConsumerConfig) { c.Observer = nil }) // this test reads the tables, not the events
	r.drained(ops)
}

// TestBatchSigstop: a consumer process paused (SIGSTOP) in the middle of
// a batch, after its effects were written and before their commit, for
// longer than its leases' TTL, while another consumer runs the same
// messages (copies published again) and commits them; resumed, its
// commit finds its leases lost and commits nothing: every message's
// effect once.
func TestBatchSigstop(t *testing.T) {
	r, ops, proc, hung := startHungChild(t, true)
	if err := proc.Pause(); err != nil {
		t.Skipf("cannot pause the child here: %v", err)
	}
	r.runBatch(r.store.BatchTxHandler(batchEffects(pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize(), nil)),
		func(c *amqpidem.ConsumerConfig) { c.Observer = nil })
	r.publish(hung...) // copies, for this consumer to take over once the paused one's leases expired
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := r.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table+" WHERE state = 'c' AND key = ANY($1)",
			storeKeys(r.queue, hung)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == len(hung) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of the paused batch's %d messages completed by the other consumer after 30s", n, len(hung))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := proc.Resume(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(4 * time.Second) // the paused batch wakes, tries its commit, settles
	if !proc.Running() {
		t.Fatalf("the child exited:\n%s", proc.Output())
	}
	r.drained(ops)
}

// storeKeys returns the record keys of ops on queue.
func storeKeys(queue string, ops []string) [][]byte {
	keys := make([][]byte, len(ops))
	for i, op := range ops {
		keys[i] = []byte(amqpidem.StoreKey(queue, op))
	}
	return keys
}

// startHungChild publishes 200 messages and starts TestBatchKillChild in
// a child process (pausing rather than hanging, with pause), and returns
// once its third batch has written its effects and hangs before its
// commit, with the ops of that batch.
func startHungChild(t *testing.T, pause bool) (r *rig, ops []string, proc *testenv.Process, hung []string) {
	r = newRig(t)
	marks := pgx.Identifier{r.cfg.Schema, "marks"}.Sanitize()
	ctx := context.Background()
	if _, err := r.pool.Exec(ctx, "CREATE TABLE "+marks+" (op text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	ops = ids("k", 200)
	r.publish(ops...)
	cmd := exec.Command(os.Args[0], "-test.run=^TestBatchKillChild$", "-test.v")
	cmd.Env = append(os.Environ(), envChildSchema+"="+r.cfg.Schema, envChildQueue+"="+r.queue)
	if pause {
		cmd.Env = append(cmd.Env, envChildPause+"=1")
	}
	proc, err := testenv.StartProcess(cmd, filepath.Join(t.TempDir(), "child.log"), "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = proc.Resume()
		proc.Kill()
	})
	deadline := time.Now().Add(60 * time.Second)
	for len(hung) == 0 {
		if time.Now().After(deadline) || !proc.Running() {
			t.Fatalf("the child never hung in its third batch:\n%s", proc.Output())
		}
		rows, err := r.pool.Query(ctx, "SELECT op FROM "+marks)
		if err != nil {
			t.Fatal(err)
		}
		if hung, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return r, ops, proc, hung
}

// drained waits until every op's record is completed and the queue has
// no message ready, then checks that every op's effect is there once.
func (r *rig) drained(ops []string) {
	t := r.t
	t.Helper()
	ctx := context.Background()
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var completed int
		if err := r.pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE state = 'c'").Scan(&completed); err != nil {
			t.Fatal(err)
		}
		q, err := r.ch.QueueDeclarePassive(r.queue, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if completed == len(ops) && q.Messages == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d records completed, %d messages ready, after 60s", completed, len(ops), q.Messages)
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // duplicates on their way settle
	got := r.effects()
	for _, op := range ops {
		if got[op] != 1 {
			t.Errorf("%s: %d effects, want 1", op, got[op])
		}
	}
}

// poisoned panics when ops hold a poison message (an op starting with
// "poison"): the batch's effects, written, roll back, and the batch is
// split.
func poisoned(ops []string) {
	for _, op := range ops {
		if strings.HasPrefix(op, "poison") {
			panic("poison " + op)
		}
	}
}

// TestBatchKillRandom: consumer processes killed (SIGKILL) at random
// moments, three in a row (in a batch, between a commit and its acks,
// while gathering), with poison messages mixed in, then a last consumer:
// every good message's effect is there once, every poison message's
// never, its record failed and its dead letter published (at least once:
// a kill between a dead letter and its ack publishes it again).
func TestBatchKillRandom(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	good := ids("g", 300)
	poison := ids("poison", 6)
	var ops []string
	for i, op := range good {
		ops = append(ops, op)
		if i%50 == 25 {
			ops = append(ops, poison[i/50])
		}
	}
	r.publish(ops...)
	for i := range 3 {
		cmd := exec.Command(os.Args[0], "-test.run=^TestBatchKillChild$", "-test.v")
		cmd.Env = append(os.Environ(), envChildSchema+"="+r.cfg.Schema, envChildQueue+"="+r.queue, envChildRandom+"=1")
		proc, err := testenv.StartProcess(cmd, filepath.Join(t.TempDir(), fmt.Sprintf("child%d.log", i)), "")
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(200+rand.IntN(400)) * time.Millisecond)
		proc.Kill()
		got := r.effects()
		t.Logf("kill %d: %d of %d good effects committed", i+1, len(got), len(good))
	}
	effects := pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize()
	r.runBatch(r.store.BatchTxHandler(batchEffects(effects, poisoned)), func(c *amqpidem.ConsumerConfig) {
		c.Observer, c.MaxAttempts = nil, 3
	})
	table := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()
	deadline := time.Now().Add(60 * time.Second)
	for {
		var completed, failed int
		if err := r.pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE state = 'c'), count(*) FILTER (WHERE state = 'f') FROM "+table).Scan(&completed, &failed); err != nil {
			t.Fatal(err)
		}
		q, err := r.ch.QueueDeclarePassive(r.queue, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if completed == len(good) && failed == len(poison) && q.Messages == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d completed (want %d), %d failed (want %d), %d ready after 60s", completed, len(good), failed, len(poison), q.Messages)
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
	got := r.effects()
	for _, op := range good {
		if got[op] != 1 {
			t.Errorf("%s: %d effects, want 1", op, got[op])
		}
	}
	for _, op := range poison {
		if got[op] != 0 {
			t.Errorf("%s: %d effects, want 0", op, got[op])
		}
	}
	dlq, err := r.ch.QueueDeclarePassive(r.queue+".dlq", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if dlq.Messages < len(poison) {
		t.Errorf("%d dead letters, want at least %d", dlq.Messages, len(poison))
	}
	t.Logf("%d dead letters for %d poison messages", dlq.Messages, len(poison))
	_, _ = r.ch.QueueDelete(r.queue+".dlq", false, false, false)
}

// TestBatchFailedMessageWritesRolledBack: a handler written the way users
// write them, each message's row inserted before the call that fails it,
// without a savepoint. The failed messages' rows must never commit: a
// retried message's effect would be there twice, a dead-lettered one's
// once though its record says it failed. The batch runs again without
// them, and only that run commits.
func TestBatchFailedMessageWritesRolledBack(t *testing.T) {
	r := newRig(t)
	var tries atomic.Int32
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		rs := make([]amqpidem.BatchResult, len(ds))
		for i, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
			switch {
			case d.MessageId == "w002" && tries.Add(1) == 1:
				rs[i].Err = errors.New("payment API timed out")
			case d.MessageId == "w005":
				rs[i].Err = amqpidem.Permanent(errors.New("declined"))
			default:
				rs[i].Result = []byte("ok " + d.MessageId)
			}
		}
		return rs, nil
	}), nil)
	ops := ids("w", 10)
	r.publish(ops...)
	r.settled(ops, amqpidem.Completed, amqpidem.DeadLettered)
	got := r.effects()
	for _, op := range ops {
		want := 1
		if op == "w005" {
			want = 0
		}
		if got[op] != want {
			t.Errorf("%s: %d effects, want %d", op, got[op], want)
		}
	}
}

// TestBatchPgxIdiom: a batch function written as pgx users write one,
// defer tx.Rollback(ctx) and return tx.Commit(ctx), still commits its
// effects with the batch's records in one transaction, each once, and a
// message failed in it leaves no write behind.
func TestBatchPgxIdiom(t *testing.T) {
	r := newRig(t)
	var declined atomic.Int32
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		defer tx.Rollback(ctx) //nolint:errcheck // harmless after Commit, as with pgx
		rs := make([]amqpidem.BatchResult, len(ds))
		for i, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
			if d.MessageId == "p003" {
				declined.Add(1)
				rs[i].Err = amqpidem.Permanent(errors.New("declined"))
			}
		}
		return rs, tx.Commit(ctx)
	}), nil)
	ops := ids("p", 20)
	r.publish(ops...)
	r.settled(ops, amqpidem.Completed, amqpidem.DeadLettered)
	got := r.effects()
	for _, op := range ops {
		want := 1
		if op == "p003" {
			want = 0
		}
		if got[op] != want {
			t.Errorf("%s: %d effects, want %d", op, got[op], want)
		}
	}
	same, _ := r.xmins(slices.DeleteFunc(slices.Clone(ops), func(op string) bool { return op == "p003" }))
	for op, ok := range same {
		if !ok {
			t.Errorf("%s: effect and completed record not written by one transaction", op)
		}
	}
	if declined.Load() == 0 {
		t.Fatal("p003 never ran")
	}
}
