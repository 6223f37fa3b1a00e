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
			r.runBatch(r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				for _, d := range ds {
					if err := r.insert(ctx, tx, d.MessageId); err != nil {
						return nil, err
					}
				}
				if _, err := tx.Conn().Exec(ctx, "COMMIT"); err != nil {
					return nil, err
				}
				if _, err := tx.Conn().Exec(ctx, "BEGIN"); err != nil {
					return nil, err
				}
				rs := make([]amqpidem.BatchResult, len(ds))
				for i, d := range ds {
					if all || strings.HasSuffix(d.MessageId, "000") {
						rs[i].Err = errors.New("a later step of this message failed")
					}
				}
				return rs, nil
			}), func(c *amqpidem.ConsumerConfig) {
				c.BatchWait = 200 * time.Millisecond
				c.MaxAttempts = 3
			})
			r.publishOnce(ids("cbm", 4))
		})
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
	rs, err := r.batchAttempt([]string{"d0", "d1"}, func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		runs++
		for _, d := range ds {
			if err := r.insert(ctx, tx, d.MessageId); err != nil {
				return nil, err
			}
		}
		if _, err := tx.Conn().Exec(ctx, "COMMIT"); err != nil {
			return nil, err
		}
		if _, err := tx.Conn().Exec(ctx, "BEGIN"); err != nil {
			return nil, err
		}
		rs := make([]amqpidem.BatchResult, len(ds))
		for i, d := range ds {
			if d.MessageId == "d0" {
				rs[i].Err = errors.New("a later step of this message failed")
			}
		}
		return rs, nil
	})
	got := r.effects()
	if got["d1"] != 1 || runs != 1 {
		t.Errorf("d1: %d effect rows after %d runs of the function (answer %v, %v); want 1 row, 1 run: its work committed with the function's own COMMIT, and the rerun without d0 committed it again",
			got["d1"], runs, rs, err)
	}
	if len(rs) == 2 && (rs[0].Err == nil || !amqpidem.IsPermanent(rs[0].Err) || !errors.Is(rs[0].Err, pgstore.ErrTxEnded)) {
		t.Errorf("d0's error %v: want Permanent, wrapping ErrTxEnded (its work committed; a retry does it again)", rs[0].Err)
	}
}
