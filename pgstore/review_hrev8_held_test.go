package pgstore

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
)

// Review h-rev8: the shared guard of a lease batch (heldGuard) on every
// way a batch ends. Lease batches run through HandleBatchComplete and
// commit, fail as a batch, panic, or run under a cancelled context; the
// members not committed are put back (under a guard of their own put)
// and ended as amqpidem ends them (Release, Fail, Cancel). After each:
// every guard a member was ever under counted each member out once
// (left 0) and was stopped (not fired: the TTL is an hour); nothing is
// left in Store.held; the pool has every connection back and the keys
// are free.
func TestReviewHrev8HeldBatchGuardsEveryPath(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	s := testStore(t, pool)
	ctx := context.Background()
	var mode string
	bh := s.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		switch mode {
		case "error":
			return nil, errors.New("h-rev8: the batch failed")
		case "panic":
			panic("h-rev8: the handler panics")
		case "one fails":
			rs := make([]amqpidem.BatchResult, len(ds))
			rs[0].Err = errors.New("h-rev8: the first message failed")
			return rs, nil
		}
		return nil, nil
	}).(amqpidem.BatchLeaseTaker)
	guards := map[*heldGuard]int{} // every guard seen, with its member count
	watch := func(ls []lock.Lease) {
		for _, l := range ls {
			if h, ok := s.held.Load(l.Owner); ok && h.batch != nil {
				if g := h.shared.Load(); g != nil {
					guards[g]++
				}
			}
		}
	}
	const rounds = 5
	modes := []string{"commit", "error", "panic", "cancelled", "one fails"}
	var keys []string
	for r := range rounds {
		for _, m := range modes {
			mode = m
			ks := []string{fmt.Sprintf("g8-%d-%s-a", r, m), fmt.Sprintf("g8-%d-%s-b", r, m), fmt.Sprintf("g8-%d-%s-c", r, m)}
			keys = append(keys, ks...)
			ls := heldBatchOfTTL(t, s, time.Hour, ks...)
			watch(ls)
			items := make([]amqpidem.BatchItem, len(ls))
			for i, l := range ls {
				items[i] = amqpidem.BatchItem{Delivery: &amqp.Delivery{MessageId: l.Key}, Lease: l}
			}
			rctx := ctx
			if m == "cancelled" {
				c, cancel := context.WithCancel(ctx)
				cancel()
				rctx = c
			}
			rs, err := bh.HandleBatchComplete(rctx, items, func(_ int, r []byte) ([]byte, error) { return r, nil })
			// The members not committed wait again, under a new guard.
			watch(ls)
			for i, l := range ls {
				failed := err != nil || rs == nil || rs[i].Err != nil
				_, waits := s.held.Load(l.Owner)
				if failed != waits {
					t.Fatalf("%s: %s failed %v (%v, %v), waits in Store.held %v", m, l.Key, failed, err, rs, waits)
				}
				if !waits {
					continue
				}
				// Ended as amqpidem ends a lease whose batch failed.
				var eerr error
				switch i % 3 {
				case 0:
					eerr = s.Release(ctx, l)
				case 1:
					eerr = s.Fail(ctx, l, "h-rev8")
				case 2:
					eerr = s.Cancel(ctx, l)
				}
				if eerr != nil {
					t.Fatalf("%s: end of %s: %v", m, l.Key, eerr)
				}
			}
		}
	}
	for g, n := range guards {
		if left := g.left.Load(); left != 0 || g.t.Stop() {
			t.Errorf("a guard of %d members: %d not counted out, or still armed", n, left)
		}
	}
	s.held.mu.Lock()
	left := len(s.held.m)
	s.held.mu.Unlock()
	if left != 0 {
		t.Errorf("%d entries left in Store.held after %d lease batches all ended", left, rounds*len(modes))
	}
	deadline := time.Now().Add(2 * time.Second)
	for pool.Stat().AcquiredConns() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connections still taken from the pool", n)
	}
	for _, k := range keys {
		r, err := s.Acquire(ctx, lock.Request{Key: k, TTL: time.Second})
		if err != nil || r.Status == lock.InProgress {
			t.Errorf("Acquire %s after its lease ended: %v %v, want it free", k, r.Status, err)
		}
	}
	t.Logf("%d guards seen", len(guards))
}

// Owner tokens of held leases are unique, of the documented form, and
// name their backend: a batch's tokens are slices of one string.
func TestReviewHrev8HeldOwnersUnique(t *testing.T) {
	seen := map[string]bool{}
	for _, n := range []int{1, 2, 7, 100, 1000} {
		for _, pid := range []uint32{0, 1, 0xdeadbeef, 1<<32 - 1} {
			for _, o := range heldOwners(pid, n) {
				if len(o) != 32 || o[0] != heldMark || seen[o] {
					t.Fatalf("owner %q: want 32 bytes, starting with %q, never seen before", o, heldMark)
				}
				seen[o] = true
				if got, ok := heldPID(o); !ok || got != pid {
					t.Fatalf("heldPID(%q) = %d %v, want %d", o, got, ok, pid)
				}
				for _, c := range o[1:] {
					if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
						t.Fatalf("owner %q: not hex after the mark", o)
					}
				}
			}
		}
	}
}

// Fences of one key strictly rise across held lease batches, single held
// leases and record-row leases, whichever way each ended; the new leases
// of one lease batch share its one clock.
func TestReviewHrev8HeldFencesRise(t *testing.T) {
	s := testStore(t, pgenv.Pool(t, 4))
	ctx := context.Background()
	th := s.TxHandler(func(context.Context, pgx.Tx, *amqp.Delivery) ([]byte, error) { return nil, nil }).(amqpidem.LeaseTaker)
	bh := s.BatchTxHandler(func(context.Context, pgx.Tx, []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		return nil, nil
	}).(amqpidem.BatchLeaseTaker)
	const key = "f8"
	req := lock.Request{Key: key, TTL: time.Minute, Retention: time.Hour}
	batch := func() lock.Lease {
		t.Helper()
		rs, errs := bh.AcquireLeaseBatch(ctx, []lock.Request{req, {Key: key + "-other", TTL: time.Minute, Retention: time.Hour}},
			[]*amqp.Delivery{{}, {}})
		if errs[0] != nil || rs[0].Status != lock.Acquired {
			t.Fatalf("AcquireLeaseBatch: %+v %v", rs[0], errs[0])
		}
		if errs[1] == nil && rs[1].Status == lock.Acquired {
			if isHeld(rs[0].Lease) && isHeld(rs[1].Lease) && rs[0].Lease.Fence != rs[1].Lease.Fence && rs[0].Attempts == 1 && rs[1].Attempts == 1 {
				t.Errorf("two new leases of one lease batch: fences %d and %d, want its one clock", rs[0].Lease.Fence, rs[1].Lease.Fence)
			}
			if err := s.Cancel(ctx, rs[1].Lease); err != nil {
				t.Fatal(err)
			}
		}
		return rs[0].Lease
	}
	single := func() lock.Lease {
		t.Helper()
		r, err := th.AcquireLease(ctx, req, &amqp.Delivery{})
		if err != nil || r.Status != lock.Acquired {
			t.Fatalf("AcquireLease: %+v %v", r, err)
		}
		return r.Lease
	}
	row := func() lock.Lease {
		t.Helper()
		r, err := s.Acquire(ctx, req)
		if err != nil || r.Status != lock.Acquired {
			t.Fatalf("Acquire: %+v %v", r, err)
		}
		return r.Lease
	}
	cancel := func(l lock.Lease) error { return s.Cancel(ctx, l) }
	release := func(l lock.Lease) error { return s.Release(ctx, l) }
	steps := []struct {
		name string
		take func() lock.Lease
		end  func(lock.Lease) error
	}{
		{"batch, cancelled", batch, cancel},
		{"single, cancelled", single, cancel},
		{"batch, cancelled", batch, cancel},
		{"row, cancelled", row, cancel},
		{"batch, cancelled", batch, cancel},
		{"single, released", single, release},
		{"batch (a record-row lease now), released", batch, release},
		{"single (a record-row lease now), released", single, release},
		{"row, released", row, release},
		{"batch, released", batch, release},
	}
	var last int64
	for _, st := range steps {
		l := st.take()
		if l.Fence <= last {
			t.Fatalf("%s: fence %d, not above the last lease's %d", st.name, l.Fence, last)
		}
		last = l.Fence
		if err := st.end(l); err != nil {
			t.Fatalf("%s: end: %v", st.name, err)
		}
	}
}
