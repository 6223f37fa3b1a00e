package amqpidem

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// hrev13BatchSeen is a BatchObserver that closes ran once a batch has run.
type hrev13BatchSeen struct {
	once sync.Once
	ran  chan struct{}
}

func (o *hrev13BatchSeen) Observe(context.Context, Event) {}

func (o *hrev13BatchSeen) ObserveBatch(context.Context, BatchInfo) {
	o.once.Do(func() { close(o.ran) })
}

// The Keeper shut down while a batch runs tells its leases lost one after
// the other (heartbeat.ErrClosed). The first loss cancels the run; the
// members not told yet must not be run again: their leases are kept no
// more, and a rerun is work that cannot commit, done during a shutdown.
// Each loss after the first is held (lossHook) until the handler was
// called again or the batch is over, so that a rerun, if the code makes
// one, surely happens before the next member is told.
func TestHrev13KeeperShutdownNoRerun(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	hrev13ShutdownNoRerun(t, mem, mem.Inspect)
}

// TestHrev13KeeperShutdownNoRerunRedis is TestHrev13KeeperShutdownNoRerun
// on the real Redis.
func TestHrev13KeeperShutdownNoRerunRedis(t *testing.T) {
	rs, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	hrev13ShutdownNoRerun(t, rs, rs.Inspect)
}

// hrev13Store is a store that takes leases in batches.
type hrev13Store interface {
	lock.Store
	lock.BatchAcquirer
}

func hrev13ShutdownNoRerun(t *testing.T, store hrev13Store, inspect func(context.Context, string) (lock.Record, error)) {
	ids := []string{"hrev13-k0", "hrev13-k1", "hrev13-k2", "hrev13-k3"}
	started := make(chan struct{})
	var mu sync.Mutex
	calls, losses := 0, 0
	called := make(chan struct{}, 16)
	h := BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]BatchResult, error) {
		mu.Lock()
		calls++
		if calls == 1 {
			close(started)
		}
		mu.Unlock()
		called <- struct{}{}
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
		}
		return nil, ctx.Err()
	})
	obs := &hrev13BatchSeen{ran: make(chan struct{})}
	p, err := newProcessor(store, Config{Queue: "hrev13-shut", LeaseTTL: time.Second, Logger: slog.New(slog.DiscardHandler), Observer: obs}, batchOnly{h: h})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
	p.batch = &batcher{h: h, ba: store, size: len(ids), wait: time.Second}
	p.stopping = make(chan struct{})
	lossHook = func(f *flight, cause error) {
		if !errors.Is(cause, heartbeat.ErrClosed) {
			return
		}
		mu.Lock()
		losses++
		n := losses
		mu.Unlock()
		if n == 1 {
			return
		}
		select {
		case <-called: // the handler was called again (a rerun)
		case <-obs.ran: // the batch is over
		case <-time.After(3 * time.Second):
		}
	}
	t.Cleanup(func() { lossHook = nil })
	done := make(chan map[string]Event)
	go func() { done <- processAll(&p, ids) }()
	<-started
	<-called // the first call's own token
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.keeper.Shutdown(sctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	var evs map[string]Event
	select {
	case evs = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the batch did not end after the Keeper's Shutdown")
	}
	mu.Lock()
	got := calls
	mu.Unlock()
	if got != 1 {
		t.Errorf("handler calls %d, want 1: the batch ran again after the Keeper's Shutdown cancelled it", got)
	}
	for _, id := range ids {
		ev := evs[id]
		if ev.Outcome != Abandoned || ev.Reason != "lease lost" {
			t.Errorf("%s: %v %q %v, want abandoned, lease lost", id, ev.Outcome, ev.Reason, ev.Err)
		}
		rec, err := inspect(context.Background(), StoreKey(p.cfg.Endpoint, id))
		if err != nil {
			t.Fatalf("%s: Inspect: %v", id, err)
		}
		if rec.State == lock.StateCompleted {
			t.Errorf("%s: its record completed, though the Keeper shut down mid-run", id)
		}
	}
	if got := p.keeper.Len(); got != 0 {
		t.Errorf("leases still kept: %d", got)
	}
}
