package heartbeat

import (
	"context"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// starvationEnv names the environment variable that runs
// TestKeepLatenessUnderStarvation: it sets GOMAXPROCS to 1 for the whole
// test process and spins goroutines on it, so it runs alone, on demand:
//
//	HEARTBEAT_STARVATION=1 go test -run TestKeepLatenessUnderStarvation -v ./heartbeat/
const starvationEnv = "HEARTBEAT_STARVATION"

// How late a handler learns that its lease could not be confirmed, on a
// host whose CPU is starved: GOMAXPROCS 1 and goroutines that spin (the
// runtime preempts them every 10 ms or so). The store hangs, so every
// lease is cancelled at its local deadline minus the margin; the handler,
// blocked on its context, notes when it saw that. The figure is what
// heartbeat's docs ask SafetyMargin to exceed.
func TestKeepLatenessUnderStarvation(t *testing.T) {
	if os.Getenv(starvationEnv) != "1" {
		t.Skipf("sets GOMAXPROCS 1 and spins; set %s=1 to run it", starvationEnv)
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	store := &faultStore{Store: newMemoryStore(t), block: make(chan struct{}), honorCtx: true}
	k := newKeeper(t, store, Config{SafetyMargin: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	var stop atomic.Bool
	var spinners sync.WaitGroup
	for range 4 {
		spinners.Add(1)
		go func() {
			defer spinners.Done()
			for n := 0; !stop.Load(); n++ {
			}
		}()
	}
	defer func() { stop.Store(true); spinners.Wait() }()
	const ttl, trials = 100 * time.Millisecond, 30
	var late []time.Duration
	for i := range trials {
		lease := acquire(t, store, "starved"+string(rune('a'+i)), ttl)
		ctx, cancel := k.Keep(context.Background(), lease)
		<-ctx.Done()
		seen := time.Now()
		l, _ := LeaseFromContext(ctx)
		late = append(late, seen.Sub(l.Deadline.Add(-20*time.Millisecond)))
		cancel()
	}
	slices.Sort(late)
	t.Logf("GOMAXPROCS 1, 4 spinning goroutines, %d leases of %v, margin 20ms: the handler saw its context cancelled "+
		"%v after the local deadline minus the margin at the median, %v at most (%v after the deadline itself at most)",
		trials, ttl, late[len(late)/2].Round(time.Millisecond), late[len(late)-1].Round(time.Millisecond),
		(late[len(late)-1] - 20*time.Millisecond).Round(time.Millisecond))
}
