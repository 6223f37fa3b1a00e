package heartbeat

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// hrev2Key is a context key of the parent's.
type hrev2Key struct{}

// TestKeepContextSemantics: the context Keep returns (the entry itself)
// behaves as the context.WithValue around a cancel context it replaced:
// the parent's values and deadline show through, context.Cause gives the
// cause to it and its children, WithCancel, WithTimeout and AfterFunc
// children start no goroutine of their own (the context package finds
// the cancel context inside), a nested Keep's lease hides the outer one,
// WithoutCancel keeps the lease, and String names the key.
func TestKeepContextSemantics(t *testing.T) {
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	parent, pcancel := context.WithDeadline(context.WithValue(context.Background(), hrev2Key{}, "pv"), time.Now().Add(time.Hour))
	defer pcancel()
	lease := acquire(t, store, "ctx-semantics", time.Second)
	ctx, stop := k.Keep(parent, lease)
	defer stop()
	if ctx.Value(hrev2Key{}) != "pv" {
		t.Errorf("the parent's value: %v", ctx.Value(hrev2Key{}))
	}
	if d, ok := ctx.Deadline(); !ok || !d.Equal(func() time.Time { d, _ := parent.Deadline(); return d }()) {
		t.Errorf("Deadline %v %v, want the parent's", d, ok)
	}
	if s := ctx.(interface{ String() string }).String(); !strings.Contains(s, `"ctx-semantics"`) {
		t.Errorf("String %q does not name the key", s)
	}
	if l, ok := LeaseFromContext(context.WithoutCancel(ctx)); !ok || l.Key != lease.Key || l.Fence != lease.Fence {
		t.Errorf("LeaseFromContext(WithoutCancel): %+v %v", l, ok)
	}

	before := runtime.NumGoroutine()
	const n = 200
	var fired sync.WaitGroup
	fired.Add(n)
	children := make([]context.Context, 0, 2*n)
	for range n {
		c, cancel := context.WithCancel(ctx)
		defer cancel()
		d, dcancel := context.WithTimeout(c, time.Hour)
		defer dcancel()
		children = append(children, c, d)
		context.AfterFunc(d, fired.Done)
	}
	if after := runtime.NumGoroutine(); after-before > 10 {
		t.Errorf("%d children and AfterFuncs started %d goroutines: the context package did not find the cancel context inside the entry", 3*n, after-before)
	}
	if l, ok := LeaseFromContext(children[len(children)-1]); !ok || l.Key != lease.Key {
		t.Errorf("LeaseFromContext(child): %+v %v", l, ok)
	}

	inner, istop := k.Keep(children[0], acquire(t, store, "inner", time.Second))
	if l, _ := LeaseFromContext(inner); l.Key != "inner" {
		t.Errorf("nested Keep: lease %q, want inner", l.Key)
	}
	istop()
	if ctx.Err() != nil {
		t.Fatalf("stopping the inner lease cancelled the outer: %v", context.Cause(ctx))
	}

	// Lost: the cause reaches every child and every AfterFunc runs.
	cause := errors.New("hrev2 cause")
	ctx.(*entry).cancel(cause)
	done := make(chan struct{})
	go func() { fired.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("AfterFuncs of the children did not run after the entry was cancelled")
	}
	for i, c := range append(children, ctx, inner) {
		if err := context.Cause(c); i < len(children)+1 && !errors.Is(err, cause) {
			t.Fatalf("context %d: cause %v, want %v", i, err, cause)
		}
	}
	if err := context.Cause(inner); !errors.Is(err, context.Canceled) {
		t.Errorf("the stopped inner lease: cause %v", err)
	}
}

// TestKeepContextRace: LeaseFromContext, Value, String, Err and children
// made from many goroutines while the keeper extends the lease and stop
// cancels it (go test -race).
func TestKeepContextRace(t *testing.T) {
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	// The TTL leaves room for a keeper starved by four spinning goroutines
	// under -race on a 2-core CI machine (60ms lost the lease there: margin
	// 12ms); the run still spans several extensions (one per TTL/3).
	ctx, stop := k.Keep(context.Background(), acquire(t, store, "race", 600*time.Millisecond))
	var wg sync.WaitGroup
	deadline := time.Now().Add(1200 * time.Millisecond)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				_, _ = LeaseFromContext(ctx)
				_ = ctx.(interface{ String() string }).String()
				c, cancel := context.WithCancel(ctx)
				_ = context.Cause(c)
				cancel()
				runtime.Gosched()
			}
		}()
	}
	time.Sleep(1000 * time.Millisecond)
	if ctx.Err() != nil {
		t.Errorf("lease not kept: %v", context.Cause(ctx))
	}
	stop()
	wg.Wait()
}
