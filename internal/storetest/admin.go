package storetest

import (
	"errors"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

func admin(t *testing.T, s lock.Store) lock.Admin {
	t.Helper()
	a, ok := s.(lock.Admin)
	if !ok {
		t.Fatalf("%T does not implement lock.Admin", s)
	}
	return a
}

func inspect(t *testing.T, a lock.Admin, key string) lock.Record {
	t.Helper()
	r, err := a.Inspect(ctx(t), key)
	if err != nil {
		t.Fatalf("Inspect(%q): %v", key, err)
	}
	if r.Key != key || r.Location == "" {
		t.Fatalf("Inspect(%q): key %q location %q, want the key and a location", key, r.Key, r.Location)
	}
	return r
}

func testInspect(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{LeaseTTL: 5 * time.Second, Retention: time.Hour})
	a := admin(t, s)
	if _, err := a.Inspect(ctx(t), "never-seen"); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Inspect of an unknown key: got %v, want ErrNotFound", err)
	}
	if _, err := a.Inspect(ctx(t), ""); !errors.Is(err, lock.ErrInvalidKey) {
		t.Fatalf("Inspect(\"\"): got %v, want ErrInvalidKey", err)
	}

	before := time.Now().Add(-time.Second) // the store's clock may be a little behind
	res := acquire(t, s, lock.Request{Key: "pay-1", Fingerprint: "fp-1"}, lock.Acquired)
	r := inspect(t, a, "pay-1")
	if r.State != lock.StateInProgress || !r.Live() || r.Owner != res.Lease.Owner || r.Fence != res.Lease.Fence ||
		r.Attempts != 1 || r.Fingerprint != "fp-1" {
		t.Fatalf("in progress: got %+v, want the lease's owner, fence, attempt 1, fingerprint fp-1", r)
	}
	if r.LeaseLeft <= 3*time.Second || r.LeaseLeft > 5*time.Second {
		t.Fatalf("in progress: lease left %v, want (3s, 5s]", r.LeaseLeft)
	}
	if r.ExpiresIn <= time.Hour || r.ExpiresIn > time.Hour+5*time.Second {
		t.Fatalf("in progress: expires in %v, want TTL + retention", r.ExpiresIn)
	}
	if r.Created.Before(before) || r.Created.After(time.Now().Add(time.Second)) || !r.Ended.IsZero() {
		t.Fatalf("in progress: created %v ended %v, want created now and no end", r.Created, r.Ended)
	}
	noErr(t, "Complete", s.Complete(ctx(t), res.Lease, []byte("receipt")))
	r = inspect(t, a, "pay-1")
	if r.State != lock.StateCompleted || r.Live() || string(r.Value) != "receipt" || r.LeaseLeft != 0 || r.Ended.Before(r.Created) {
		t.Fatalf("completed: got %+v, want the result and an end", r)
	}
	if r.ExpiresIn <= time.Hour-5*time.Second || r.ExpiresIn > time.Hour {
		t.Fatalf("completed: expires in %v, want the retention", r.ExpiresIn)
	}

	res = acquire(t, s, lock.Request{Key: "pay-2"}, lock.Acquired)
	noErr(t, "Fail", s.Fail(ctx(t), res.Lease, "card declined"))
	if r := inspect(t, a, "pay-2"); r.State != lock.StateFailed || r.Error != "card declined" || len(r.Value) != 0 {
		t.Fatalf("failed: got %+v, want the error text", r)
	}
	res = acquire(t, s, lock.Request{Key: "pay-3"}, lock.Acquired)
	noErr(t, "Release", s.Release(ctx(t), res.Lease))
	if r := inspect(t, a, "pay-3"); r.State != lock.StateReleased || r.Attempts != 1 || r.Live() {
		t.Fatalf("released: got %+v", r)
	}

	// An expired lease not yet taken over is in progress, not live.
	s2 := store(t, lock.Config{LeaseTTL: 20 * time.Millisecond, Retention: time.Hour})
	acquire(t, s2, lock.Request{Key: "pay-4"}, lock.Acquired)
	time.Sleep(60 * time.Millisecond)
	if r := inspect(t, admin(t, s2), "pay-4"); r.State != lock.StateInProgress || r.Live() || r.LeaseLeft != 0 {
		t.Fatalf("expired lease: got %+v, want in progress, not live", r)
	}
}

func testForget(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{Retention: time.Hour})
	a := admin(t, s)
	res := acquire(t, s, lock.Request{Key: "inv-1"}, lock.Acquired)
	noErr(t, "Fail", s.Fail(ctx(t), res.Lease, "out of stock"))
	seen := inspect(t, a, "inv-1")

	if err := a.Forget(ctx(t), "inv-1", lock.StateFailed, seen.Fence-1); !errors.Is(err, lock.ErrChanged) {
		t.Fatalf("Forget with another fence: got %v, want ErrChanged", err)
	}
	if err := a.Forget(ctx(t), "inv-1", lock.StateCompleted, seen.Fence); !errors.Is(err, lock.ErrChanged) {
		t.Fatalf("Forget with another state: got %v, want ErrChanged", err)
	}
	if err := a.Forget(ctx(t), "inv-1", lock.State("done"), seen.Fence); err == nil {
		t.Fatal("Forget with a state that is not one: no error")
	}
	acquire(t, s, lock.Request{Key: "inv-1"}, lock.Failed) // nothing was deleted
	noErr(t, "Forget", a.Forget(ctx(t), "inv-1", lock.StateFailed, seen.Fence))
	if _, err := a.Inspect(ctx(t), "inv-1"); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Inspect after Forget: got %v, want ErrNotFound", err)
	}
	if err := a.Forget(ctx(t), "inv-1", lock.StateFailed, seen.Fence); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Forget again: got %v, want ErrNotFound", err)
	}
	// The work runs again as a first execution, with a higher fence.
	again := acquire(t, s, lock.Request{Key: "inv-1"}, lock.Acquired)
	if again.Lease.Attempt != 1 || again.Lease.Fence <= seen.Fence {
		t.Fatalf("after Forget: lease %+v, want attempt 1 and a fence above %d", again.Lease, seen.Fence)
	}
	// A live lease can be forgotten by its fence too (the caller decides).
	live := inspect(t, a, "inv-1")
	noErr(t, "Forget of a live lease", a.Forget(ctx(t), "inv-1", lock.StateInProgress, live.Fence))
	wantLost(t, "Complete after Forget", s.Complete(ctx(t), again.Lease, nil))
}
