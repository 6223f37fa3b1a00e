package pgstore_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestBatchTxHandlerCommitThenPanicNotRerun: as
// TestBatchTxHandlerCommitThenErrorNotRerun, but the function panics
// after ending the batch's transaction itself with a COMMIT (a library
// handed tx.Conn() that commits, then a nil map, say). docs/batches.md
// says a batch error after the function's own COMMIT is made each
// message's own Permanent error, never split nor run again, and "the
// handler returns an error for the whole batch, or panics" are one row
// of its table. The panic leaves pgstore without its ending being
// decided, amqpidem recovers it as a batch error and splits the batch:
// the halves run again and commit their work a second time.
func TestBatchTxHandlerCommitThenPanicNotRerun(t *testing.T) {
	r := newRig(t)
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		panic("after its own COMMIT")
	}), func(c *amqpidem.ConsumerConfig) { c.BatchWait = 200 * time.Millisecond })
	ops := ids("p", 8)
	r.publishOnce(ops)
}

// TestTxHandlerCommitThenPanicNotRerun: the single-message form of
// TestBatchTxHandlerCommitThenPanicNotRerun. TxFunc's documentation says
// a function that committed itself and then failed is not run again
// (Permanent, wrapping ErrTxEnded); a panic is the handler's failure as
// much as a returned error, but escapes pgstore, and amqpidem retries it.
func TestTxHandlerCommitThenPanicNotRerun(t *testing.T) {
	r := newRig(t)
	r.run(r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		panic("after its own COMMIT")
	}), nil)
	ops := ids("s", 2)
	r.publishOnce(ops)
}

// TestBatchTxHandlerBatchesAtOnce: NewBatchConsumer accepts a pool with
// one connection more than "the batches that may run at once
// (Concurrency over BatchSize, rounded up)", docs/batches.md's and
// checkBatchPool's bound, since each running batch holds a connection and
// the heartbeat needs one more. But batches are not that few: deliveries
// arriving a little apart (more than BatchWait) each make a batch of
// their own, and those run at once, each holding a pooled connection, up
// to Concurrency of them. Here BatchSize 10 and Concurrency 20 make 2
// batches at most by the check (a pool of 3 accepted); deliveries 50 ms
// apart, each batch holding its transaction for 1.5 s, run many batches
// at once, and the pool the check accepted is exhausted: the heartbeat and
// the batches' own transactions queue for its connections.
func TestBatchTxHandlerBatchesAtOnce(t *testing.T) {
	r := newRig(t)
	small := pgenv.Pool(t, 3)
	st := newStore(t, small, r.cfg)
	var mu sync.Mutex
	running, most := 0, 0
	h := st.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		mu.Lock()
		running++
		most = max(most, running)
		mu.Unlock()
		defer func() {
			mu.Lock()
			running--
			mu.Unlock()
		}()
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		select {
		case <-time.After(1500 * time.Millisecond):
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
		return nil, nil
	})
	cfg := batchConfig(t, r.queue, r.events)
	cfg.BatchSize, cfg.Concurrency, cfg.Prefetch = 10, 20, 20
	cfg.LeaseTTL = 3 * time.Second
	c, err := amqpidem.NewBatchConsumer(st, cfg, h)
	if err != nil {
		t.Fatalf("NewBatchConsumer refused the pool: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_ = c.Shutdown(ctx)
		if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
			t.Errorf("Run: %v", err)
		}
	})
	ops := ids("a", 8)
	for _, op := range ops {
		r.publish(op)
		time.Sleep(50 * time.Millisecond)
	}
	evs := r.settled(ops, amqpidem.Completed, amqpidem.DeadLettered)
	mu.Lock()
	defer mu.Unlock()
	if most > 2 {
		t.Errorf("%d batches ran at once, each holding one of the pool's 3 connections; the pool check allowed for 2", most)
	}
	for _, op := range ops {
		if len(evs[op]) != 1 {
			t.Logf("%s: %s", op, outcomes(evs[op]))
		}
	}
}

// TestBatchTxHandlerUnkeyedFailedNotCommitted: a message without a key,
// run with Config.MissingKey ProcessMissingKey, goes to a BatchTxHandler
// as a batch of one with no record (HandleBatch). BatchTxFunc's
// documentation: "A message answered with an error may have written in
// tx before it failed: its writes never commit." HandleBatch commits the
// transaction whatever the BatchResults say, so the writes of a message
// answered with a Permanent error commit, and it is dead-lettered with
// its effect done.
func TestBatchTxHandlerUnkeyedFailedNotCommitted(t *testing.T) {
	r := newRig(t)
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		rs := make([]amqpidem.BatchResult, len(ds))
		for i, d := range ds {
			if err := r.insert(ctx, tx, string(d.Body)); err != nil {
				return nil, err
			}
			rs[i].Err = amqpidem.Permanent(errors.New("declined after writing"))
		}
		return rs, nil
	}), func(c *amqpidem.ConsumerConfig) { c.MissingKey = amqpidem.ProcessMissingKey })
	err := r.ch.PublishWithContext(context.Background(), "", r.queue, false, false,
		amqp.Publishing{DeliveryMode: amqp.Persistent, Body: []byte("nokey")})
	if err != nil {
		t.Fatal(err)
	}
	var ev amqpidem.Event
	select {
	case ev = <-r.events:
	case <-time.After(20 * time.Second):
		t.Fatal("no event in 20 s")
	}
	if ev.Outcome != amqpidem.DeadLettered {
		t.Errorf("outcome %v %q, want dead-lettered", ev.Outcome, ev.Reason)
	}
	if n := r.effects()["nokey"]; n != 0 {
		t.Errorf("%d effect rows of a message answered with a Permanent error, want 0 (its writes never commit)", n)
	}
}

// TestBatchTxHandlerForcedShutdownPoolHeld: batches and others hold
// every connection of the pool; a forced shutdown (Shutdown's deadline
// passing) cancels the batches, pgx closes each cancelled statement's
// connection, and each batch asks whether its transaction committed
// (ending, committed) on a connection of the pool. Unless the closed
// connection goes back to the pool first, none is answered before
// commitTimeout (10 s): the other connections are held, by the other
// batches asking the same, or here by the test (NewBatchConsumer runs
// at most the batches its pool check counts, 2 here, and leaves one
// connection for the heartbeat, which anything else may hold). Shutdown,
// given 300 ms, returned after about 10 s, the messages requeued as
// "store unavailable" instead of "shutdown".
func TestBatchTxHandlerForcedShutdownPoolHeld(t *testing.T) {
	r := newRig(t)
	small := pgenv.Pool(t, 3)
	st := newStore(t, small, r.cfg)
	var mu sync.Mutex
	running := 0
	h := st.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		mu.Lock()
		running++
		mu.Unlock()
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		_, err := tx.Exec(ctx, "SELECT pg_sleep(5)")
		return nil, err
	})
	cfg := batchConfig(t, r.queue, r.events)
	cfg.BatchSize, cfg.Concurrency, cfg.Prefetch = 10, 20, 20
	cfg.LeaseTTL = 10 * time.Second
	c, err := amqpidem.NewBatchConsumer(st, cfg, h)
	if err != nil {
		t.Fatalf("NewBatchConsumer refused the pool: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	for _, op := range ids("f", 6) {
		r.publish(op)
		time.Sleep(60 * time.Millisecond)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		mu.Lock()
		n := running
		mu.Unlock()
		if n >= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d batches running, want 2", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The pool's third connection: held while the batches are cancelled.
	spare, err := small.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer spare.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_ = c.Shutdown(ctx)
	took := time.Since(start)
	if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
		t.Errorf("Run: %v", err)
	}
	if took > 5*time.Second {
		t.Errorf("Shutdown with a 300 ms deadline took %v: the cancelled batches waited for a connection the others held", took.Round(time.Millisecond))
	}
	for {
		select {
		case e := <-r.events:
			if e.Reason != "shutdown" {
				t.Logf("%s: %v %q: %v", e.Key, e.Outcome, e.Reason, e.Err)
			}
			continue
		default:
		}
		break
	}
}

// TestBatchTxHandlerCommitThenConnLostNotRerun: the function commits the
// batch's transaction itself (a COMMIT statement), then its connection is
// lost (closed here), and the server cannot say whether the transaction
// committed (the status question fails). docs/batches.md: a function that
// ended the transaction itself and committed is never split nor run again,
// "the same when the server cannot say whether that COMMIT committed". On
// a closed connection the answer is lock.ErrUnavailable instead, not
// Permanent: each message is released and requeued as "store
// unavailable", and its redelivery takes a new lease and does its work a
// second time (the record was not completed with the work, so it cannot
// tell).
func TestBatchTxHandlerCommitThenConnLostNotRerun(t *testing.T) {
	r := newRig(t)
	var lost sync.Map // each op's connection is closed on its first run only
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		first := false
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
			if _, seen := lost.LoadOrStore(d.MessageId, true); !seen {
				first = true
			}
		}
		if _, err := tx.Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		if first {
			pgstore.SetXactStatusSQL(t, "SELECT length($1::text) / 0 = 1")
			_ = tx.Conn().Close(context.Background())
		} else {
			pgstore.SetXactStatusSQL(t, "SELECT pg_xact_status($1::xid8) IS NOT DISTINCT FROM 'committed'")
		}
		return nil, nil
	}), func(c *amqpidem.ConsumerConfig) { c.BatchWait = 200 * time.Millisecond })
	ops := ids("l", 4)
	r.publishOnce(ops)
}

// TestBatchTxHandlerLibraryRollbackThenCommitNotRerun: a library handed
// tx.Conn() (docs/batches.md names this case) runs one transaction of its
// own per message: BEGIN, its writes, then COMMIT, or ROLLBACK for a
// message it declines. When the first message it handles is declined,
// its ROLLBACK rolls the batch's transaction back; every later message's
// transaction then commits on its own. BatchTxHandler asks only whether
// the batch's transaction committed: it did not, so it decides the
// function's work "was undone" (a Permanent batch error), and amqpidem
// splits the batch and runs its halves again, committing the other
// messages' work a second time. Once the function ended the batch's
// transaction, later statements autocommit: no rerun is safe, whatever
// became of that transaction.
func TestBatchTxHandlerLibraryRollbackThenCommitNotRerun(t *testing.T) {
	r := newRig(t)
	effects := pgx.Identifier{r.cfg.Schema, "effects"}.Sanitize()
	r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		rs := make([]amqpidem.BatchResult, len(ds))
		// The declined message first, as a batch's order may have it.
		order := make([]int, 0, len(ds))
		for i, d := range ds {
			if d.MessageId == "k-declined" {
				order = append([]int{i}, order...)
			} else {
				order = append(order, i)
			}
		}
		conn := tx.Conn()
		for _, i := range order {
			d := ds[i]
			if d.MessageId == "k-declined" {
				if err := pgx.BeginFunc(ctx, conn, func(ltx pgx.Tx) error { return errors.New("declined") }); err != nil {
					rs[i].Err = amqpidem.Permanent(err)
				}
				continue
			}
			if err := pgx.BeginFunc(ctx, conn, func(ltx pgx.Tx) error {
				_, err := ltx.Exec(ctx, "INSERT INTO "+effects+" (op) VALUES ($1)", d.MessageId)
				return err
			}); err != nil {
				return nil, err
			}
		}
		return rs, nil
	}), func(c *amqpidem.ConsumerConfig) { c.BatchWait = 300 * time.Millisecond })
	ops := []string{"k-declined", "k-1", "k-2", "k-3"}
	r.publish(ops...)
	evs := r.settled(ops, amqpidem.DeadLettered, amqpidem.Completed)
	got := r.effects()
	for _, op := range ops[1:] {
		if got[op] != 1 {
			t.Errorf("%s: %d effect rows, events %s; want 1", op, got[op], outcomes(evs[op]))
		}
	}
}
