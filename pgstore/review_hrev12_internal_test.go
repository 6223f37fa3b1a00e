package pgstore

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// TestHrev12SlowRowsBounded: the relay's count of rows whose publishes
// timed out (timedOut) doubles a row's wait after each timeout in a row,
// up to MaxBackoff; holds at most maxSlowRows rows (the next ones wait
// RetryBackoff, as if new each time); is ended by any other error; and
// forgets a row not claimed again within ClaimTTL after it was due.
func TestHrev12SlowRowsBounded(t *testing.T) {
	r := &Relay{cfg: RelayConfig{RetryBackoff: time.Second, MaxBackoff: 8 * time.Second, ClaimTTL: 30 * time.Second},
		slow: map[int64]slowRow{}}
	timeout := fmt.Errorf("publish: %w", context.DeadlineExceeded)
	now := time.Now()
	for i, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 8 * time.Second} {
		wait, known := r.timedOut(1, timeout, now)
		if wait != want || known != (i > 0) {
			t.Errorf("timeout %d: wait %v, known %v; want %v, known %v", i+1, wait, known, want, i > 0)
		}
	}
	if wait, known := r.timedOut(1, errors.New("connection lost"), now); wait != time.Second || known {
		t.Errorf("another error: wait %v, known %v; want RetryBackoff, not known", wait, known)
	}
	if _, ok := r.slow[1]; ok {
		t.Error("another error did not end the row's run of timeouts")
	}
	for id := int64(1); id <= maxSlowRows+100; id++ {
		r.timedOut(id, timeout, now)
	}
	if len(r.slow) != maxSlowRows {
		t.Errorf("%d slow rows held, want at most %d", len(r.slow), maxSlowRows)
	}
	if wait, known := r.timedOut(maxSlowRows+100, timeout, now); wait != time.Second || known {
		t.Errorf("a row past the bound: wait %v, known %v; want RetryBackoff, not known", wait, known)
	}
	r.forgetSlow(now.Add(r.cfg.ClaimTTL))
	if len(r.slow) != maxSlowRows {
		t.Errorf("%d slow rows held just within ClaimTTL after due, want %d", len(r.slow), maxSlowRows)
	}
	r.forgetSlow(now.Add(2*time.Second + r.cfg.ClaimTTL))
	if len(r.slow) != 0 {
		t.Errorf("%d slow rows held past ClaimTTL after due, want 0", len(r.slow))
	}
}
