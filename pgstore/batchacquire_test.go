package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestAcquireBatchHeldKey: a key whose lease a transaction holds (no
// record row yet) is answered in progress by AcquireBatch, at once, among
// new keys that get their leases, and no row is written for it. The new
// keys go through one INSERT, which must skip a key whose advisory lock is
// taken, as the acquire function does.
func TestAcquireBatchHeldKey(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	const key = "held-in-batch"
	var rs []lock.Result
	var errs []error
	var took time.Duration
	var during *record
	h := r.taker(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		reqs := []lock.Request{{Key: "batch-new-1"}, {Key: key}, {Key: "batch-new-2"}}
		t0 := time.Now()
		rs, errs = r.store.AcquireBatch(ctx, reqs)
		took = time.Since(t0)
		during = r.record(key)
		return []byte("done"), nil
	})
	res, err := h.AcquireLease(ctx, lock.Request{Key: key, TTL: 5 * time.Second}, &amqp.Delivery{})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("AcquireLease: %+v, %v", res, err)
	}
	if _, err := h.HandleComplete(ctx, &amqp.Delivery{MessageId: "x"}, res.Lease, same); err != nil {
		t.Fatalf("HandleComplete: %v", err)
	}
	for i, want := range []lock.Status{lock.Acquired, lock.InProgress, lock.Acquired} {
		if errs[i] != nil || rs[i].Status != want {
			t.Fatalf("request %d: %+v, %v; want %v", i, rs[i], errs[i], want)
		}
	}
	if during != nil {
		t.Fatalf("AcquireBatch wrote a record row for the held key: %+v", during)
	}
	if took > time.Second {
		t.Fatalf("AcquireBatch took %v: it waited for the held key instead of answering busy", took)
	}
	if rec := r.record(key); rec == nil || rec.state != "c" || rec.owner != res.Lease.Owner {
		t.Fatalf("held key's record after its lease ended: %+v, want completed by %s", rec, res.Lease.Owner)
	}
	for _, k := range []string{"batch-new-1", "batch-new-2"} {
		if rec := r.record(k); rec == nil || rec.state != "p" || rec.attempts != 1 {
			t.Fatalf("%s: record %+v, want a lease in progress, attempt 1", k, rec)
		}
	}
	r.idle()
}

// TestAcquireBatchRowBeingWritten: a key whose record row another
// transaction is inserting (not committed) makes AcquireBatch wait at
// most the functions' lock_timeout (2 s), then fail with
// lock.ErrUnavailable, as the acquire function does; not wait for that
// transaction to end.
func TestAcquireBatchRowBeingWritten(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	const key = "being-written"
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{r.cfg.Schema, pgstore.DefaultTable}.Sanitize()+`
			(ns, key, state, owner, fence, deadline, attempts, fingerprint, value, created_at, ended_at, expires_at)
		VALUES ($1, $2, 'p', 'writer', 1, now() + interval '1 hour', 1, '', NULL, now(), NULL, now() + interval '1 hour')`,
		lock.DefaultPrefix, []byte(key)); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	t0 := time.Now()
	_, errs := r.store.AcquireBatch(cctx, []lock.Request{{Key: "being-written-new"}, {Key: key}})
	took := time.Since(t0)
	for i, err := range errs {
		if !errors.Is(err, lock.ErrUnavailable) || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("request %d after %v: %v; want lock.ErrUnavailable from the lock timeout", i, took, err)
		}
	}
}
