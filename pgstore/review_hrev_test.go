package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestBatchTxHandlerCommitBeginThenMessageErrorNotRerun: the batch
// function commits its work itself, begins a transaction again ("COMMIT",
// then "BEGIN": a library handed tx.Conn() that commits, then leaves a
// transaction of its own open), and answers some messages (or all) with a
// retryable error of their own, the batch error nil. BatchTxFunc's
// documentation: after the function's own COMMIT, "a message's retryable
// error after that is made each message's own error, Permanent": its work
// committed. ending asks whether a BEGIN followed the COMMIT (begunAgain)
// only for a batch error, a Rollback or an aborted transaction, not for
// per-message errors: the run is taken for one whose transaction is open,
// the failed messages are released and run again, and the others are run
// again without them (errRunAgain), committing their work a second time.
func TestBatchTxHandlerCommitBeginThenMessageErrorNotRerun(t *testing.T) {
	for _, all := range []bool{false, true} {
		name := map[bool]string{false: "one failed", true: "all failed"}[all]
		t.Run(name, func(t *testing.T) {
			r := newRig(t)
			r.runBatch(r.store.BatchTxHandler(commitBeginFailing(r, nil, func(id string) bool {
				return all || strings.HasSuffix(id, "000")
			})), func(c *amqpidem.ConsumerConfig) {
				c.BatchWait = 200 * time.Millisecond
				c.MaxAttempts = 3
			})
			r.publishOnce(ids("cbm", 4))
		})
	}
}

// commitBeginFailing is a batch function that writes each message's
// effect, commits the transaction itself, begins another, and answers the
// messages whose id fails says with a retryable error of their own; it
// counts its runs in runs (when not nil).
func commitBeginFailing(r *rig, runs *int, fails func(id string) bool) pgstore.BatchTxFunc {
	return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		if runs != nil {
			*runs++
		}
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		for _, q := range []string{"COMMIT", "BEGIN"} {
			if _, err := tx.Conn().Exec(ctx, q); err != nil {
				return nil, err
			}
		}
		rs := make([]amqpidem.BatchResult, len(ds))
		for i, d := range ds {
			if fails(d.MessageId) {
				rs[i].Err = errors.New("a later step of this message failed")
			}
		}
		return rs, nil
	}
}

// TestBatchTxHandlerCommitBeginThenMessageErrorDirect is the same on the
// batch handler alone, without a broker: one HandleBatchComplete of two
// messages, the first answered with a retryable error after the
// function's own COMMIT and a BEGIN. The second's work committed with
// the COMMIT; it must not be run again (complete's rerun without the
// failed one commits it a second time).
func TestBatchTxHandlerCommitBeginThenMessageErrorDirect(t *testing.T) {
	r := newRig(t)
	runs := 0
	rs, err := r.batchAttempt([]string{"d0", "d1"}, commitBeginFailing(r, &runs, func(id string) bool { return id == "d0" }))
	got := r.effects()
	if got["d1"] != 1 || runs != 1 {
		t.Errorf("d1: %d effect rows after %d runs of the function (answer %v, %v); want 1 row, 1 run: its work committed with the function's own COMMIT, and the rerun without d0 committed it again",
			got["d1"], runs, rs, err)
	}
	if len(rs) == 2 && (rs[0].Err == nil || !amqpidem.IsPermanent(rs[0].Err) || !errors.Is(rs[0].Err, pgstore.ErrTxEnded)) {
		t.Errorf("d0's error %v: want Permanent, wrapping ErrTxEnded (its work committed; a retry does it again)", rs[0].Err)
	}
}

// TestTxHandlerCommitSessionEndsPoolHeld: the session of a TxHandler's
// transaction ends during its COMMIT (the server terminated it: a
// failover, a restart; here a deferred trigger of the handler's table
// terminates its own backend at commit time), while every other
// connection of the pool is held (by other handlers, here by the test).
// The record's write and commit failed, so the run asks whether its
// transaction committed (workCommitted), on another connection of the
// pool since its own closed. The row-lease path gives the closed
// connection back first (releaseClosed); the held-lease path keeps it
// (the handlerTx of a held lease has no pooled connection: heldTx has
// it), so the question waits for a connection the pool will not have
// until commitTimeout (10 s), and then says nothing: the message is
// requeued unanswered rather than answered at once.
func TestTxHandlerCommitSessionEndsPoolHeld(t *testing.T) {
	for _, rows := range []bool{false, true} {
		name := map[bool]string{false: "held", true: "row"}[rows]
		t.Run(name, func(t *testing.T) {
			r := newRig(t)
			ctx := context.Background()
			kill := r.atCommit("kill", "PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5);")
			small := pgenv.Pool(t, 2)
			cfg := r.cfg
			cfg.RowLeases = rows
			st := newStore(t, small, cfg)
			h := st.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				_, err := tx.Exec(ctx, "INSERT INTO "+kill+" VALUES ($1)", d.MessageId)
				return nil, err
			}).(amqpidem.LeaseTaker)
			res, err := h.AcquireLease(ctx, lock.Request{Key: "k", TTL: 30 * time.Second}, &amqp.Delivery{})
			if err != nil || res.Status != lock.Acquired {
				t.Fatalf("AcquireLease: %+v %v", res, err)
			}
			// The pool's other connection: another handler's.
			spare, err := small.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer spare.Release()
			start := time.Now()
			_, err = h.HandleComplete(ctx, &amqp.Delivery{MessageId: "k"}, res.Lease, same)
			took := time.Since(start)
			if err == nil {
				t.Fatalf("HandleComplete: nil, want the commit's error (its session was terminated)")
			}
			if got := r.effects()["k"]; got != 0 {
				t.Errorf("%d effect rows, want 0 (the session ended before its commit)", got)
			}
			if took > 5*time.Second {
				t.Errorf("HandleComplete took %v (%v): asking whether the transaction committed waited for a pool connection while its own closed one still held its place",
					took.Round(time.Millisecond), err)
			}
		})
	}
}

// TestTxHandlerRollbackBeginThenNilNotAcked: the function's work is
// rolled back by a ROLLBACK it (or a library handed tx.Conn()) sends,
// then a BEGIN opens another transaction, and the function returns nil.
// TxFunc's documentation: fn ended the transaction itself; "if that
// committed and fn returned nil, the record is completed on its own
// ...; otherwise the error wraps ErrTxEnded, Permanent". ending asks
// whether the transaction is still xid (begunAgain) only after a failed
// run: a run that returned nil in a transaction ('T') is taken for xid,
// the record is completed in the second, empty transaction and
// committed, and the message is acked as done, its work never committed.
func TestTxHandlerRollbackBeginThenNilNotAcked(t *testing.T) {
	for _, redelivered := range []bool{false, true} {
		name := map[bool]string{false: "held", true: "row"}[redelivered]
		t.Run(name, func(t *testing.T) {
			r := newRig(t)
			err := r.attempt("rb", redelivered, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				if _, err := tx.Conn().Exec(ctx, "ROLLBACK"); err != nil {
					return nil, err
				}
				_, err := tx.Conn().Exec(ctx, "BEGIN")
				return nil, err
			})
			rec := r.record("rb")
			if !errors.Is(err, pgstore.ErrTxEnded) || !amqpidem.IsPermanent(err) || r.effects()["rb"] != 0 || (rec != nil && rec.state == "c") {
				t.Errorf("HandleComplete: %v; record %+v; %d effect rows: the work was rolled back, yet the message was completed (acked as done). Want an error wrapping ErrTxEnded, Permanent, and no completed record",
					err, rec, r.effects()["rb"])
			}
		})
	}
}

// TestTxHandlerRollbackBeginThenNilNoLease is
// TestTxHandlerRollbackBeginThenNilNotAcked for a message run without a
// lease (amqpidem.ProcessMissingKey: Handle), which has no record: its
// commit, of the second, empty transaction, answered nil, and the message
// was acked as done.
func TestTxHandlerRollbackBeginThenNilNoLease(t *testing.T) {
	r := newRig(t)
	h := r.store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if _, err := tx.Conn().Exec(ctx, "ROLLBACK"); err != nil {
			return nil, err
		}
		_, err := tx.Conn().Exec(ctx, "BEGIN")
		return nil, err
	})
	_, err := h.Handle(context.Background(), &amqp.Delivery{MessageId: "nl"})
	if !errors.Is(err, pgstore.ErrTxEnded) || !amqpidem.IsPermanent(err) || r.effects()["nl"] != 0 {
		t.Errorf("Handle: %v; %d effect rows: want an error wrapping ErrTxEnded, Permanent (its work was undone)", err, r.effects()["nl"])
	}
}

// TestBatchTxHandlerRollbackBeginThenNilNotAcked is
// TestTxHandlerRollbackBeginThenNilNotAcked for a batch.
func TestBatchTxHandlerRollbackBeginThenNilNotAcked(t *testing.T) {
	r := newRig(t)
	rs, err := r.batchAttempt([]string{"rb0", "rb1"}, func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		if _, err := tx.Conn().Exec(ctx, "ROLLBACK"); err != nil {
			return nil, err
		}
		_, err := tx.Conn().Exec(ctx, "BEGIN")
		return nil, err
	})
	for i, k := range []string{"rb0", "rb1"} {
		rec := r.record(k)
		var merr error
		if err != nil {
			merr = err
		} else if len(rs) == 2 {
			merr = rs[i].Err
		}
		if !errors.Is(merr, pgstore.ErrTxEnded) || !amqpidem.IsPermanent(merr) || (rec != nil && rec.state == "c") || r.effects()[k] != 0 {
			t.Errorf("%s: error %v, record %+v, %d effect rows: its work was rolled back, yet it was completed (acked as done)", k, merr, rec, r.effects()[k])
		}
	}
}

// TestTxHandlerAnswerLostRecordNotConfirmedError: a plain handler (it
// never ends its transaction itself); the COMMIT of its work with its
// record lands, its answer is lost, and the server says the transaction
// committed (workCommitted). The record, completed in that transaction,
// is then completed again on its own, which fails here (the finish
// function renamed meanwhile: a failover, an outage). The error says the
// handler "ended the transaction itself (a COMMIT or ROLLBACK statement,
// or a library given tx.Conn())": ErrTxEnded, which this handler never
// did; a user reading it searches their code for a COMMIT that is not
// there. (The record is completed, so the message is not lost; the error
// is what is wrong.)
func TestTxHandlerAnswerLostRecordNotConfirmedError(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	fn := pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable + "_finish"}.Sanitize()
	once := false
	pgstore.SetLoseAnswer(t, func() bool {
		if once {
			return false
		}
		once = true
		if _, err := r.pool.Exec(ctx, "ALTER FUNCTION "+fn+" RENAME TO "+pgx.Identifier{pgstore.DefaultTable + "_finish_gone"}.Sanitize()); err != nil {
			t.Errorf("rename: %v", err)
		}
		return true
	})
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		return nil, r.insert(ctx, tx, d.MessageId)
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: "al", TTL: 5 * time.Second}, &amqp.Delivery{Redelivered: true})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v %v", res, err)
	}
	_, err = h.HandleComplete(ctx, &amqp.Delivery{MessageId: "al", Redelivered: true}, res.Lease, same)
	rec := r.record("al")
	t.Logf("HandleComplete: %v; record %+v; %d effect rows", err, rec, r.effects()["al"])
	if errors.Is(err, pgstore.ErrTxEnded) {
		t.Errorf("HandleComplete's error wraps ErrTxEnded (%q), but the handler never ended its transaction: its COMMIT's answer was lost, and the record, committed with the work, could not be confirmed", pgstore.ErrTxEnded)
	}
}

// TestTxHandlerHeldCommitBeginKeyCoveredToCommit: a held lease whose
// function commits its work itself, then BEGINs again and returns nil:
// the record is written in that second transaction (commitHeld), whose
// INSERT releases the key's session-level lock before its COMMIT. In the
// first transaction the transaction-level lock covers that moment; the
// second has none. Until the COMMIT lands (slow here: a deferred trigger
// sleeps 1 s; a synchronous replica or a slow fsync in production), the
// key is free and its record not visible: a duplicate delivery's
// AcquireLease is granted a lease, and the same function, committing its
// own work, does it a second time.
func TestTxHandlerHeldCommitBeginKeyCoveredToCommit(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	slow := r.atCommit("slow", "PERFORM pg_sleep(1);")
	returned := make(chan struct{})
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		if err := r.insert(ctx, tx, d.MessageId); err != nil {
			return nil, err
		}
		if _, err := tx.Conn().Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		if _, err := tx.Conn().Exec(ctx, "BEGIN"); err != nil {
			return nil, err
		}
		_, err := tx.Conn().Exec(ctx, "INSERT INTO "+slow+" VALUES ($1)", d.MessageId)
		close(returned)
		return nil, err
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: "k", TTL: 10 * time.Second}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v %v", res, err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "k"}, res.Lease, same)
		done <- err
	}()
	<-returned
	time.Sleep(300 * time.Millisecond) // commitHeld's INSERT ran; its COMMIT sleeps
	other := r.taker(func(context.Context, pgx.Tx, *amqp.Delivery) ([]byte, error) { return nil, nil })
	res2, err2 := other.AcquireLease(ctx, lock.Request{Key: "k", TTL: 10 * time.Second}, &amqp.Delivery{})
	if err2 == nil && res2.Status == lock.Acquired {
		// End it as amqpidem would (a cancel), for the test to finish cleanly.
		_ = r.store.Cancel(ctx, res2.Lease)
		t.Errorf("a duplicate's AcquireLease while the first lease's outcome was committing: %v, want InProgress (or the first's outcome): the key was free before that COMMIT, and the duplicate would do the work again", res2.Status)
	}
	if err := <-done; err != nil {
		t.Errorf("HandleComplete: %v", err)
	}
}

// TestTxHandlerCommitBeginSessionEndsThenError: the function commits its
// work itself, begins again, and fails; its session is ended by the
// server meanwhile (here its own idle_in_transaction_session_timeout), so
// that the connection is found closed only by begunAgain's question.
// ending took the closed state from before that question: the run was
// taken for a failed one in its own open transaction, its error
// retryable, and the committed work was run again. It must fail
// Permanent, its work committed once.
func TestTxHandlerCommitBeginSessionEndsThenError(t *testing.T) {
	for _, redelivered := range []bool{false, true} {
		name := map[bool]string{false: "held", true: "row"}[redelivered]
		t.Run(name, func(t *testing.T) {
			r := newRig(t)
			err := r.attempt("cs", redelivered, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
				for _, q := range []string{"COMMIT", "BEGIN", "SET idle_in_transaction_session_timeout = 50"} {
					if _, err := tx.Conn().Exec(ctx, q); err != nil {
						return nil, err
					}
				}
				time.Sleep(300 * time.Millisecond) // the server ends the session
				return nil, errors.New("the payment API refused")
			})
			if !amqpidem.IsPermanent(err) || r.effects()["cs"] != 1 {
				t.Errorf("HandleComplete: %v; %d effect rows: its work committed, so the error must be Permanent (not run again)", err, r.effects()["cs"])
			}
		})
	}
}

// atCommit makes a table name (op text) of r's schema whose inserted rows
// run body (PL/pgSQL statements) when their transaction commits (a
// deferred constraint trigger), and returns its full name.
func (r *rig) atCommit(name, body string) string {
	r.t.Helper()
	table := pgx.Identifier{r.cfg.Schema, name}.Sanitize()
	fn := pgx.Identifier{r.cfg.Schema, name + "_at_commit"}.Sanitize()
	for _, q := range []string{
		"CREATE TABLE " + table + " (op text)",
		"CREATE FUNCTION " + fn + "() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN " + body + " RETURN NULL; END $$",
		"CREATE CONSTRAINT TRIGGER " + name + "_at_commit AFTER INSERT ON " + table + " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " + fn + "()",
	} {
		if _, err := r.pool.Exec(context.Background(), q); err != nil {
			r.t.Fatal(err)
		}
	}
	return table
}
