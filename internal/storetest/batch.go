package storetest

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// testAcquireBatch checks a lock.BatchAcquirer's AcquireBatch against
// what Acquire answers for each request: every key of a mixed batch
// decided on its own, exactly.
func testAcquireBatch(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{LeaseTTL: 5 * time.Second})
	ba, ok := s.(lock.BatchAcquirer)
	if !ok {
		t.Skipf("%T is not a lock.BatchAcquirer", s)
	}
	done := acquire(t, s, lock.Request{Key: "done"}, lock.Acquired).Lease
	noErr(t, "Complete done", s.Complete(ctx(t), done, []byte("receipt-1")))
	failed := acquire(t, s, lock.Request{Key: "failed"}, lock.Acquired).Lease
	noErr(t, "Fail failed", s.Fail(ctx(t), failed, "card declined"))
	held := acquire(t, s, lock.Request{Key: "held"}, lock.Acquired).Lease
	released := acquire(t, s, lock.Request{Key: "released"}, lock.Acquired).Lease
	noErr(t, "Release released", s.Release(ctx(t), released))
	acquire(t, s, lock.Request{Key: "fp", Fingerprint: "a"}, lock.Acquired)

	reqs := []lock.Request{
		{Key: "new-1"},
		{Key: "done"},
		{Key: "held"},
		{Key: "released"},
		{Key: "new-1"}, // the same key again: busy
		{Key: "fp", Fingerprint: "b"},
		{Key: ""},
		{Key: "failed"},
		{Key: "new-2"},
	}
	before := time.Now()
	rs, errs := ba.AcquireBatch(ctx(t), reqs)
	if got, want := len(rs), len(reqs); got != want {
		t.Fatalf("results: got %d, want %d", got, want)
	}
	if got, want := len(errs), len(reqs); got != want {
		t.Fatalf("errors: got %d, want %d", got, want)
	}
	want := []lock.Status{lock.Acquired, lock.Completed, lock.InProgress, lock.Acquired, lock.InProgress, lock.Conflict, 0, lock.Failed, lock.Acquired}
	for i, w := range want {
		if i == 6 {
			if !errors.Is(errs[i], lock.ErrInvalidKey) {
				t.Fatalf("request %d (empty key): got %v, want ErrInvalidKey", i, errs[i])
			}
			continue
		}
		if errs[i] != nil {
			t.Fatalf("request %d (%q): %v", i, reqs[i].Key, errs[i])
		}
		if got := rs[i].Status; got != w {
			t.Fatalf("request %d (%q): got %v, want %v (%+v)", i, reqs[i].Key, got, w, rs[i])
		}
	}
	if got, want := string(rs[1].Value), "receipt-1"; got != want {
		t.Fatalf("duplicate's value: got %q, want %q", got, want)
	}
	if got, want := rs[7].Error, "card declined"; got != want {
		t.Fatalf("failed's error: got %q, want %q", got, want)
	}
	if rs[2].Fence != held.Fence || rs[2].Remaining <= 0 || rs[2].Remaining > 5*time.Second {
		t.Fatalf("held: got fence %d remaining %v, want fence %d and (0, 5s]", rs[2].Fence, rs[2].Remaining, held.Fence)
	}
	if rs[4].Fence != rs[0].Fence {
		t.Fatalf("new-1 twice: busy fence %d, want the first request's %d", rs[4].Fence, rs[0].Fence)
	}
	r := rs[3].Lease
	if r.Fence <= released.Fence || r.Attempt != 2 || rs[3].Attempts != 2 {
		t.Fatalf("released: got lease %+v, want a fence above %d and attempt 2", r, released.Fence)
	}
	for _, i := range []int{0, 8} {
		l := rs[i].Lease
		if l.Key != reqs[i].Key || l.Owner == "" || l.Attempt != 1 || l.TTL != 5*time.Second ||
			l.Deadline.Before(before.Add(5*time.Second-lock.DeadlineSlack)) || l.Deadline.After(time.Now().Add(5*time.Second)) {
			t.Fatalf("request %d: got lease %+v, want %q attempt 1, 5s from the call", i, l, reqs[i].Key)
		}
	}
	if rs[0].Lease.Owner == rs[8].Lease.Owner || rs[0].Lease.Owner == r.Owner {
		t.Fatalf("owners: %q %q %q, want one per lease", rs[0].Lease.Owner, rs[8].Lease.Owner, r.Owner)
	}

	// The leases are real: the key is held, a new lease's fence rises.
	acquire(t, s, lock.Request{Key: "new-2"}, lock.InProgress)
	noErr(t, "Release new-2", s.Release(ctx(t), rs[8].Lease))
	rs2, errs2 := ba.AcquireBatch(ctx(t), []lock.Request{{Key: "new-2"}, {Key: "new-1"}})
	noErr(t, "AcquireBatch again", errors.Join(errs2...))
	if rs2[0].Status != lock.Acquired || rs2[0].Lease.Fence <= rs[8].Lease.Fence || rs2[0].Lease.Attempt != 2 {
		t.Fatalf("new-2 again: got %+v, want acquired with a fence above %d, attempt 2", rs2[0], rs[8].Lease.Fence)
	}
	if rs2[1].Status != lock.InProgress {
		t.Fatalf("new-1 again: got %v, want InProgress", rs2[1].Status)
	}

	bc, ok := s.(lock.BatchCompleter)
	if !ok {
		return
	}
	stale := rs[8].Lease // released, then taken again
	big := make([]byte, s.(interface{ MaxResultSize() int }).MaxResultSize()+1)
	cerrs := bc.CompleteBatch(ctx(t),
		[]lock.Lease{rs[0].Lease, rs2[0].Lease, stale, r, held},
		[][]byte{[]byte("r-new-1"), []byte("r-new-2"), []byte("stale"), big, []byte("r-held")})
	if got, want := len(cerrs), 5; got != want {
		t.Fatalf("CompleteBatch: got %d errors, want %d", got, want)
	}
	noErr(t, "CompleteBatch new-1", cerrs[0])
	noErr(t, "CompleteBatch new-2", cerrs[1])
	wantLost(t, "CompleteBatch stale", cerrs[2])
	if !errors.Is(cerrs[3], lock.ErrResultTooLarge) {
		t.Fatalf("CompleteBatch too large: got %v, want ErrResultTooLarge", cerrs[3])
	}
	noErr(t, "CompleteBatch held", cerrs[4])
	// A resent CompleteBatch that finds its own writes answers nil.
	noErr(t, "CompleteBatch again", errors.Join(bc.CompleteBatch(ctx(t), []lock.Lease{rs[0].Lease}, [][]byte{[]byte("r-new-1")})...))

	rs3, errs3 := ba.AcquireBatch(ctx(t), []lock.Request{{Key: "new-1"}, {Key: "new-2"}, {Key: "released"}, {Key: "held"}})
	noErr(t, "AcquireBatch after CompleteBatch", errors.Join(errs3...))
	got := fmt.Sprintf("%v %q, %v %q, %v, %v %q", rs3[0].Status, rs3[0].Value, rs3[1].Status, rs3[1].Value, rs3[2].Status, rs3[3].Status, rs3[3].Value)
	if want := fmt.Sprintf("%v %q, %v %q, %v, %v %q", lock.Completed, "r-new-1", lock.Completed, "r-new-2", lock.InProgress, lock.Completed, "r-held"); got != want {
		t.Fatalf("after CompleteBatch: got %s, want %s", got, want)
	}
}
