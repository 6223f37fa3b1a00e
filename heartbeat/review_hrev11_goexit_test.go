package heartbeat

import (
	"context"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// goexitLoss is a LossHandler that ends its goroutine with
// runtime.Goexit, as t.Fatal or t.FailNow called in it do (a test's
// LossHandler written as test code is written), after counting its call.
type goexitLoss struct{ calls sync.WaitGroup }

func (g *goexitLoss) LeaseLost(error) {
	defer g.calls.Done()
	runtime.Goexit()
}

// TestHrev11KeepWithLossHandlerGoexit: lose (4b4500b) recovers a
// LossHandler's panic, but recover does not stop runtime.Goexit: a
// LossHandler that calls t.Fatal (or FailNow, or Goexit) on the Keeper's
// goroutine ends that goroutine, the Keeper's loop, with nothing logged.
// The Keeper's other leases are then neither extended nor reported lost:
// their handlers run on past their leases' deadlines, while another
// consumer may take the keys (duplicates). The other lease must stay
// kept (its deadline ahead), or its context be cancelled.
func TestHrev11KeepWithLossHandlerGoexit(t *testing.T) {
	store := newMemoryStore(t)
	var logs lockedBuffer
	k, err := New(store, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = k.Shutdown(ctx)
	})
	other, stopOther := k.Keep(context.Background(), acquire(t, store, "goexit-other", 500*time.Millisecond))
	defer stopOther()

	h := &goexitLoss{}
	loseKeptWith(t, k, store, "goexit-lost", h, &h.calls)
	time.Sleep(1500 * time.Millisecond) // three of the other lease's TTLs
	l, _ := LeaseFromContext(other)
	if other.Err() == nil && time.Until(l.Deadline) <= 0 {
		t.Errorf("the other lease's deadline passed %v ago and its context is not cancelled: the Keeper's goroutine "+
			"ended with the LossHandler's Goexit, keeping nothing, telling no one (log: %q)", -time.Until(l.Deadline), logs.String())
	}
	if !strings.Contains(logs.String(), "LossHandler called runtime.Goexit") {
		t.Errorf("nothing logged of the LossHandler's Goexit: %q", logs.String())
	}
}
