package heartbeat

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// stopOnLoss is a LossHandler that counts its calls and, as LossHandler's
// doc allows, stops its own lease from inside LeaseLost.
type stopOnLoss struct {
	n    atomic.Int32
	kept atomic.Pointer[Kept]
}

func (h *stopOnLoss) LeaseLost(error) {
	h.n.Add(1)
	if kp := h.kept.Load(); kp != nil {
		kp.Stop()
	}
}

// On the real Redis: leases lost (released from outside), Stop called
// by their holders at about the same time, LeaseLost calling Stop
// itself, and Shutdown racing with all of it. Each LossHandler is told
// at most once, nothing deadlocks, nothing stays kept.
func TestHrev10KeepWithLossStopShutdownRace(t *testing.T) {
	store := sharedRedisStore(t, "hrev10-kw:")
	// The holders' Stop and Shutdown come from before to after the
	// first extension finds the leases lost.
	for _, offset := range []time.Duration{-60, -30, -10, 0, 10, 30} {
		t.Run(fmt.Sprint(offset*time.Millisecond), func(t *testing.T) {
			keepWithRace(t, store, offset*time.Millisecond)
		})
	}
}

func keepWithRace(t *testing.T, store *lock.RedisStore, offset time.Duration) {
	k := newKeeper(t, store, Config{})
	const n = 40
	const ttl = 300 * time.Millisecond // extended every 100ms
	hs := make([]*stopOnLoss, n)
	kepts := make([]Kept, n)
	leases := make([]lock.Lease, n)
	for i := range n {
		leases[i] = acquire(t, store, fmt.Sprintf("hrev10-race-%v-%d", offset, i), ttl)
		hs[i] = &stopOnLoss{}
		kp, err := k.KeepWith(leases[i], hs[i])
		if err != nil {
			t.Fatalf("KeepWith %d: %v", i, err)
		}
		kepts[i] = kp
		hs[i].kept.Store(&kepts[i])
	}
	for i := range n {
		if err := store.Release(context.Background(), leases[i]); err != nil {
			t.Fatalf("Release %d: %v", i, err)
		}
	}
	// Let the next extension find about half of them lost, then race
	// the holders' Stop and the Keeper's Shutdown with the rest.
	time.Sleep(ttl/3 + offset)
	var wg sync.WaitGroup
	for i := range n {
		if i%2 == 0 {
			wg.Go(kepts[i].Stop)
		}
	}
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		done <- k.Shutdown(ctx)
	}()
	wg.Wait()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Shutdown: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Shutdown did not return: deadlock")
	}
	time.Sleep(ttl)
	told := 0
	for i, h := range hs {
		switch c := h.n.Load(); {
		case c > 1:
			t.Errorf("lease %d: LeaseLost called %d times, want at most 1", i, c)
		case c == 1:
			told++
		case i%2 == 1:
			t.Errorf("lease %d: never stopped by its holder, LeaseLost never called (lost, then ErrClosed)", i)
		}
	}
	if k.Len() != 0 {
		t.Errorf("Len after Shutdown: %d", k.Len())
	}
	t.Logf("told: %d of %d", told, n)
}

// leaseCtx is a caller's context that carries a KeepWith lease, as
// amqpidem's batch flights do (Kept.Value).
type leaseCtx struct {
	context.Context
	kept Kept
}

func (c leaseCtx) Value(key any) any {
	if v := c.kept.Value(key); v != nil {
		return v
	}
	return c.Context.Value(key)
}

// Kept.Value makes LeaseFromContext find a KeepWith lease, its deadline
// the latest confirmed; the zero Kept carries none.
func TestHrev10KeptValueLeaseFromContext(t *testing.T) {
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	const ttl = 300 * time.Millisecond
	lease := acquire(t, store, "hrev10-value", ttl)
	kept, err := k.KeepWith(lease, newLossRecorder())
	if err != nil {
		t.Fatal(err)
	}
	defer kept.Stop()
	ctx := leaseCtx{Context: context.Background(), kept: kept}
	l, ok := LeaseFromContext(ctx)
	if !ok || l.Key != lease.Key || l.Fence != lease.Fence {
		t.Fatalf("LeaseFromContext: %+v %v, want %+v", l, ok, lease)
	}
	time.Sleep(ttl) // extended at least once
	if l, _ := LeaseFromContext(ctx); !l.Deadline.After(lease.Deadline) {
		t.Errorf("deadline %v, not past the acquired %v after extensions", l.Deadline, lease.Deadline)
	}
	if _, ok := LeaseFromContext(leaseCtx{Context: context.Background()}); ok {
		t.Error("the zero Kept carries a lease")
	}
	if v := kept.Value("other"); v != nil {
		t.Errorf("Value(other key) = %v", v)
	}
}
