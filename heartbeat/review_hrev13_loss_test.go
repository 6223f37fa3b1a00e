package heartbeat

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"
)

// hrev13Loss is a LossHandler that runs do and counts its call.
type hrev13Loss struct {
	calls sync.WaitGroup
	do    func(cause error)
}

func (h *hrev13Loss) LeaseLost(cause error) {
	defer h.calls.Done()
	h.do(cause)
}

// A LossHandler that calls its own Kept's Stop, and keeps a new lease on
// the same Keeper (Keep and KeepWith), on the Keeper's loop that waits
// for it: no deadlock, and the new leases are kept on.
func TestHrev13LossHandlerStopsAndKeeps(t *testing.T) {
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{Logger: slog.New(slog.DiscardHandler)})
	var kept Kept
	var newCtx context.Context
	var newKept Kept
	var keepErr error
	h := &hrev13Loss{}
	h.do = func(error) {
		kept.Stop()
		newCtx, _ = k.Keep(context.Background(), acquire(t, store, "hrev13-sk-new", 300*time.Millisecond))
		newKept, keepErr = k.KeepWith(acquire(t, store, "hrev13-sk-new2", 300*time.Millisecond), &hrev13Loss{do: func(error) {}})
	}
	h.calls.Add(1)
	lease := acquire(t, store, "hrev13-sk", 300*time.Millisecond)
	var err error
	if kept, err = k.KeepWith(lease, h); err != nil {
		t.Fatal(err)
	}
	if err := store.Release(context.Background(), lease); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { h.calls.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("LeaseLost did not return 5s after the lease was released (deadlock?)")
	}
	if keepErr != nil {
		t.Fatalf("KeepWith in the LossHandler: %v", keepErr)
	}
	defer newKept.Stop()
	time.Sleep(900 * time.Millisecond) // three TTLs of the new leases
	if newCtx.Err() != nil {
		t.Errorf("the lease Keep kept in the LossHandler lost: %v", context.Cause(newCtx))
	}
	if got, want := k.Len(), 2; got != want {
		t.Errorf("leases kept: got %d, want %d", got, want)
	}
}

// A LossHandler that shuts its Keeper down, with a bounded ctx, when
// Shutdown tells it its lease is lost (ErrClosed): Shutdown runs the
// handler and waits for it, and the handler's Shutdown call must return
// by its ctx's deadline (ctx.Err()), as Shutdown's doc says, and then
// the outer one too.
func TestHrev13LossHandlerShutsDownFromShutdown(t *testing.T) {
	store := newMemoryStore(t)
	k, err := New(store, Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	var inner error
	h := &hrev13Loss{}
	h.do = func(cause error) {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		inner = k.Shutdown(ctx)
	}
	h.calls.Add(1)
	if _, err := k.KeepWith(acquire(t, store, "hrev13-sd", time.Second), h); err != nil {
		t.Fatal(err)
	}
	outer := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		outer <- k.Shutdown(ctx)
	}()
	select {
	case err := <-outer:
		if err != nil {
			t.Errorf("the outer Shutdown: %v, want nil (the handler returned, the goroutines ended)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Shutdown did not return 10s after it was called, though both calls' contexts ended: " +
			"the LossHandler's own Shutdown call deadlocks with the one that runs it")
	}
	if !errors.Is(inner, context.DeadlineExceeded) {
		t.Errorf("the LossHandler's Shutdown: %v, want %v (it waits for the Keeper, which waits for it)", inner, context.DeadlineExceeded)
	}
}
