package heartbeat

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// panicLoss is a LossHandler that panics, after counting its call.
type panicLoss struct{ calls sync.WaitGroup }

func (p *panicLoss) LeaseLost(error) {
	defer p.calls.Done()
	panic("loss handler bug")
}

// TestKeepWithLossHandlerPanics: a LossHandler that panics is the
// caller's bug, reported in the log with its stack; it takes neither the
// process (the Keeper's goroutine) nor Shutdown's caller down, and the
// Keeper goes on keeping its other leases.
func TestKeepWithLossHandlerPanics(t *testing.T) {
	store := newMemoryStore(t)
	var logs lockedBuffer
	k, err := New(store, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	other, stopOther := k.Keep(context.Background(), acquire(t, store, "panic-other", time.Second))
	defer stopOther()

	// Lost on the Keeper's goroutine: the record is taken by another owner.
	h := &panicLoss{}
	loseKeptWith(t, k, store, "panic-lost", h, &h.calls)
	time.Sleep(50 * time.Millisecond) // the Keeper's goroutine goes on (or the process is gone)
	if other.Err() != nil {
		t.Fatalf("the other lease was not kept: %v", context.Cause(other))
	}

	// Told on Shutdown's goroutine.
	h2 := &panicLoss{}
	h2.calls.Add(1)
	if _, err := k.KeepWith(acquire(t, store, "panic-shutdown", time.Minute), h2); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := k.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if got := logs.String(); strings.Count(got, "loss handler bug") != 2 || !strings.Contains(got, "keepwith_panic_test.go") {
		t.Errorf("log: want both panics with their stacks, got:\n%s", got)
	}
}

// loseKeptWith keeps a new lease of key (TTL 300 ms) with h, then releases
// it so that the Keeper finds it lost, and waits up to 5 s for h's call,
// which h counts in calls.
func loseKeptWith(t *testing.T, k *Keeper, store lock.Store, key string, h LossHandler, calls *sync.WaitGroup) {
	t.Helper()
	calls.Add(1)
	lease := acquire(t, store, key, 300*time.Millisecond)
	if _, err := k.KeepWith(lease, h); err != nil {
		t.Fatal(err)
	}
	if err := store.Release(context.Background(), lease); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { calls.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("LeaseLost not called 5s after the lease was released")
	}
}
