package heartbeat

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// hrev14Count is a LossHandler that counts its calls and checks the cause.
type hrev14Count struct {
	n     atomic.Int32
	cause atomic.Value
}

func (h *hrev14Count) LeaseLost(cause error) {
	h.n.Add(1)
	h.cause.Store(cause)
}

// TestHrev14ConcurrentShutdownsTellEachLeaseOnce: Shutdown without a
// sync.Once (b40771d): several Shutdown calls at once, racing KeepWith
// calls, close quit once (no panic), and every lease KeepWith took is
// told lost exactly once, with ErrClosed; every KeepWith refused returns
// ErrClosed and its handler is never called.
func TestHrev14ConcurrentShutdownsTellEachLeaseOnce(t *testing.T) {
	store := newMemoryStore(t)
	var keptN, refusedN int
	defer func() { t.Logf("leases kept then told: %d; refused: %d", keptN, refusedN) }()
	for round := 0; round < 20; round++ {
		k, err := New(store, Config{Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		const n = 40
		leases := make([]lock.Lease, n)
		for i := range leases {
			leases[i] = acquire(t, store, "hrev14-sd-"+strconv.Itoa(round)+"-"+strconv.Itoa(i), 5*time.Second)
		}
		hs := make([]*hrev14Count, n)
		kept := make([]bool, n)
		keepErrs := make([]error, n)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := 0; i < n; i++ {
			hs[i] = &hrev14Count{}
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				_, err := k.KeepWith(leases[i], hs[i])
				kept[i], keepErrs[i] = err == nil, err
			}()
		}
		shutdownErrs := make([]error, 6)
		for j := range shutdownErrs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				shutdownErrs[j] = k.Shutdown(ctx)
			}()
		}
		close(start)
		wg.Wait()
		for j, err := range shutdownErrs {
			if err != nil {
				t.Errorf("round %d: Shutdown %d: %v", round, j, err)
			}
		}
		for i := 0; i < n; i++ {
			got := hs[i].n.Load()
			if kept[i] {
				keptN++
			} else {
				refusedN++
			}
			switch {
			case kept[i] && got != 1:
				t.Errorf("round %d: lease %d kept, told %d times, want once", round, i, got)
			case kept[i]:
				if c, _ := hs[i].cause.Load().(error); !errors.Is(c, ErrClosed) {
					t.Errorf("round %d: lease %d told %v, want ErrClosed", round, i, c)
				}
			case !errors.Is(keepErrs[i], ErrClosed):
				t.Errorf("round %d: KeepWith %d: %v, want ErrClosed", round, i, keepErrs[i])
			case got != 0:
				t.Errorf("round %d: lease %d refused, told %d times", round, i, got)
			}
		}
		if k.Len() != 0 {
			t.Errorf("round %d: Len %d after Shutdown", round, k.Len())
		}
	}
}
