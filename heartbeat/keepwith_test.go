package heartbeat

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// lossRecorder is a LossHandler that records its calls.
type lossRecorder struct {
	mu     sync.Mutex
	causes []error
	at     time.Time
	done   chan struct{} // closed on the first call
}

func newLossRecorder() *lossRecorder { return &lossRecorder{done: make(chan struct{})} }

func (r *lossRecorder) LeaseLost(cause error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.causes = append(r.causes, cause)
	if len(r.causes) == 1 {
		r.at = time.Now()
		close(r.done)
	}
}

func (r *lossRecorder) calls() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.causes...)
}

// wait waits for the first call and returns its cause and when it came.
func (r *lossRecorder) wait(t *testing.T, timeout time.Duration) (error, time.Time) {
	t.Helper()
	select {
	case <-r.done:
	case <-time.After(timeout):
		t.Fatalf("LeaseLost not called within %v", timeout)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.causes[0], r.at
}

// A lease kept by KeepWith is extended beyond its TTL, and Stop forgets it.
func TestKeepWithExtendsBeyondTTL(t *testing.T) {
	t.Parallel()
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	const ttl = 300 * time.Millisecond
	lease := acquire(t, store, "kw-extend", ttl)
	r := newLossRecorder()
	kept, err := k.KeepWith(lease, r)
	if err != nil {
		t.Fatalf("KeepWith: %v", err)
	}
	time.Sleep(3 * ttl)
	if got := r.calls(); len(got) != 0 {
		t.Fatalf("LeaseLost called: %v", got)
	}
	// Still ours: Complete under the original lease succeeds.
	if err := store.Complete(context.Background(), lease, nil); err != nil {
		t.Fatalf("Complete after 3 TTLs: %v (the lease was not extended)", err)
	}
	kept.Stop()
	kept.Stop() // idempotent
	if got := k.Len(); got != 0 {
		t.Fatalf("Len after Stop: got %d, want 0", got)
	}
	time.Sleep(ttl) // the completed lease, were it still kept, would be lost now
	if got := r.calls(); len(got) != 0 {
		t.Fatalf("LeaseLost called after Stop: %v", got)
	}
	var zero Kept
	zero.Stop() // does nothing
}

// A lost lease is told to the LossHandler, once, with the cause Keep's
// context would be cancelled with, within one extension interval.
func TestKeepWithLostLease(t *testing.T) {
	t.Parallel()
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	const ttl = 1500 * time.Millisecond // extended every 500ms
	lease := acquire(t, store, "kw-lost", ttl)
	r := newLossRecorder()
	kept, err := k.KeepWith(lease, r)
	if err != nil {
		t.Fatalf("KeepWith: %v", err)
	}
	defer kept.Stop()
	if err := store.Release(context.Background(), lease); err != nil {
		t.Fatalf("Release from outside: %v", err)
	}
	released := time.Now()
	cause, at := r.wait(t, 5*time.Second)
	if !errors.Is(cause, lock.ErrLeaseLost) || !strings.Contains(cause.Error(), "kw-lost") {
		t.Fatalf("cause: got %v, want one wrapping %v naming the key", cause, lock.ErrLeaseLost)
	}
	if got, max := at.Sub(released), ttl/3+500*time.Millisecond; got > max {
		t.Fatalf("told %v after the lease was lost, want within one interval (%v, plus slack)", got, max)
	}
	eventually(t, time.Second, "lost lease unregistered", func() bool { return k.Len() == 0 })
	time.Sleep(ttl / 2)
	if got := r.calls(); len(got) != 1 {
		t.Fatalf("LeaseLost calls: got %d (%v), want 1", len(got), got)
	}
}

// A lease whose extensions are not confirmed is told as unconfirmed.
func TestKeepWithUnconfirmed(t *testing.T) {
	t.Parallel()
	store := &faultStore{Store: newMemoryStore(t)}
	k := newKeeper(t, store, Config{})
	const ttl = 300 * time.Millisecond
	lease := acquire(t, store, "kw-unconfirmed", ttl)
	store.set(func(s *faultStore) { s.fail = fmt.Errorf("%w: test", lock.ErrUnavailable) })
	r := newLossRecorder()
	kept, err := k.KeepWith(lease, r)
	if err != nil {
		t.Fatalf("KeepWith: %v", err)
	}
	defer kept.Stop()
	cause, at := r.wait(t, 5*time.Second)
	if !errors.Is(cause, ErrLeaseUnconfirmed) {
		t.Fatalf("cause: got %v, want %v", cause, ErrLeaseUnconfirmed)
	}
	if cancelAt := lease.Deadline.Add(-ttl / marginDivisor); at.Before(cancelAt) {
		t.Fatalf("told at %v, before the deadline minus the margin %v", at, cancelAt)
	}
}

// Leases kept by Keep and by KeepWith are extended together: one Extend
// call a tick for all of them.
func TestKeepWithSharesExtendCalls(t *testing.T) {
	t.Parallel()
	store := &faultStore{Store: newMemoryStore(t)}
	k := newKeeper(t, store, Config{})
	const n, ttl = 100, 600 * time.Millisecond
	var stops []func()
	for i := range n {
		lease := acquire(t, store, fmt.Sprint("kw-share-", i), ttl)
		if i%2 == 0 {
			_, stop := k.Keep(context.Background(), lease)
			stops = append(stops, stop)
			continue
		}
		kept, err := k.KeepWith(lease, newLossRecorder())
		if err != nil {
			t.Fatalf("KeepWith: %v", err)
		}
		stops = append(stops, kept.Stop)
	}
	defer func() {
		for _, stop := range stops {
			stop()
		}
	}()
	eventually(t, 5*time.Second, "two extension rounds", func() bool { return len(store.extendCalls()) >= 2 })
	for i, c := range store.extendCalls()[:2] {
		if c.n != n {
			t.Errorf("Extend call %d: %d leases, want all %d in one call", i, c.n, n)
		}
	}
}

// KeepWith refuses what Keep gives a cancelled context for, with that
// context's cause, and keeps nothing.
func TestKeepWithRefuses(t *testing.T) {
	t.Parallel()
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	good := acquire(t, store, "kw-refuse", time.Minute)
	late := good
	late.Deadline = time.Now().Add(time.Millisecond)
	noKey := good
	noKey.Key = ""
	for _, c := range []struct {
		name  string
		lease lock.Lease
		h     LossHandler
		want  error
	}{
		{"nil handler", good, nil, nil},
		{"no key", noKey, newLossRecorder(), ErrInvalidLease},
		{"late", late, newLossRecorder(), ErrLeaseUnconfirmed},
	} {
		kept, err := k.KeepWith(c.lease, c.h)
		if err == nil || (c.want != nil && !errors.Is(err, c.want)) {
			t.Errorf("%s: got %v, want an error wrapping %v", c.name, err, c.want)
		}
		if kept != (Kept{}) {
			t.Errorf("%s: got a Kept for a lease not kept", c.name)
		}
	}
	if got := k.Len(); got != 0 {
		t.Fatalf("Len: got %d, want 0", got)
	}
	if err := k.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := k.KeepWith(good, newLossRecorder()); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Shutdown: got %v, want %v", err, ErrClosed)
	}
}

// Shutdown tells every KeepWith lease ErrClosed, once.
func TestKeepWithShutdown(t *testing.T) {
	t.Parallel()
	store := newMemoryStore(t)
	k, err := New(store, Config{})
	if err != nil {
		t.Fatal(err)
	}
	r := newLossRecorder()
	if _, err := k.KeepWith(acquire(t, store, "kw-shutdown", time.Minute), r); err != nil {
		t.Fatalf("KeepWith: %v", err)
	}
	if err := k.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := r.calls(); len(got) != 1 || !errors.Is(got[0], ErrClosed) {
		t.Fatalf("LeaseLost calls: got %v, want one, %v", got, ErrClosed)
	}
}

// Keeping a lease with KeepWith costs one allocation (its entry, besides
// the Keeper's map, which grows once): no context, no cancel function, no
// stop function.
func TestKeepWithAllocs(t *testing.T) {
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	const size = 100
	leases := make([]lock.Lease, size)
	for i := range leases {
		leases[i] = lock.Lease{Key: fmt.Sprint("kw-allocs-", i), Owner: "o", Fence: 1, Attempt: 1,
			TTL: time.Hour, Retention: time.Hour, Deadline: time.Now().Add(time.Hour)}
	}
	r := newLossRecorder()
	kept := make([]Kept, size)
	keep := func() {
		for i := range kept {
			var err error
			if kept[i], err = k.KeepWith(leases[i], r); err != nil {
				t.Fatal(err)
			}
		}
		for i := range kept {
			kept[i].Stop()
		}
	}
	keep() // the map grows to size once
	if got := testing.AllocsPerRun(20, keep) / size; got > 1 {
		t.Fatalf("allocations per lease: got %.2f, want at most 1", got)
	}
}
