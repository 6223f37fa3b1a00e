package amqpidem

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// pooledStore is a store with a bounded pool of conns connections.
type pooledStore struct {
	lock.Store
	conns int
}

func (s pooledStore) MaxConns() int { return s.conns }

// poolCompleter is a Completer of store, as pgstore's TxHandler is.
type poolCompleter struct {
	HandlerFunc
	store lock.Store
}

func (c poolCompleter) CompleterStore() lock.Store { return c.store }

func (c poolCompleter) HandleComplete(context.Context, *amqp.Delivery, lock.Lease, func([]byte) ([]byte, error)) ([]byte, error) {
	return nil, nil
}

// TestConsumerPoolAndPrefetchChecks: a Completer on a pool with no
// connection beyond Concurrency is refused (its heartbeat could not renew
// leases: see pgstore's TestTxHandlerPoolAboveConcurrency); a plain
// handler on such a pool, and a Concurrency above Prefetch, are warned
// about at start (issue 42, item 3: nothing said so before).
func TestConsumerPoolAndPrefetchChecks(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	plain := HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil })
	tests := []struct {
		name        string
		conns       int
		prefetch    int
		concurrency int
		completer   bool
		refused     bool
		warns       []string
	}{
		{name: "completer, pool above concurrency", conns: 9, concurrency: 8, completer: true},
		{name: "completer, pool at concurrency", conns: 8, concurrency: 8, completer: true, refused: true},
		{name: "completer, default concurrency", conns: 4, completer: true, refused: true},
		{name: "plain, pool at concurrency", conns: 4, concurrency: 8, warns: []string{"pool is not larger than Concurrency", "max_conns=4 concurrency=8"}},
		{name: "plain, pool above concurrency", conns: 9, concurrency: 8},
		{name: "concurrency above prefetch", conns: 100, prefetch: 4, concurrency: 8, warns: []string{"Concurrency is above Prefetch", "prefetch=4 concurrency=8"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var logs bytes.Buffer
			store := pooledStore{mem, tt.conns}
			var h Handler = plain
			if tt.completer {
				h = poolCompleter{plain, store}
			}
			c, err := NewConsumer(store, ConsumerConfig{URL: "amqp://localhost", Prefetch: tt.prefetch, Concurrency: tt.concurrency,
				Config: Config{Queue: "q", Logger: slog.New(slog.NewTextHandler(&logs, nil))}}, h)
			if got := errors.Is(err, ErrPoolTooSmall); got != tt.refused {
				t.Fatalf("refused: got %v (%v), want %v", got, err, tt.refused)
			}
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Shutdown(context.Background()) })
			c.warnSizes(context.Background())
			got := logs.String()
			for _, w := range tt.warns {
				if !strings.Contains(got, w) {
					t.Errorf("log lacks %q:\n%s", w, got)
				}
			}
			if len(tt.warns) == 0 && strings.Contains(got, "level=WARN") {
				t.Errorf("warned:\n%s", got)
			}
		})
	}
}

// poolBatchCompleter is a BatchCompleter (pgstore's BatchTxHandler) on a
// pooled store.
type poolBatchCompleter struct{ store lock.Store }

func (poolBatchCompleter) HandleBatch(context.Context, []*amqp.Delivery) ([]BatchResult, error) {
	return nil, nil
}
func (c poolBatchCompleter) CompleterStore() lock.Store { return c.store }
func (poolBatchCompleter) HandleBatchComplete(context.Context, []BatchItem, func(int, []byte) ([]byte, error)) ([]BatchResult, error) {
	return nil, nil
}

// A batch consumer holds a connection per running batch, not per
// delivery: NewBatchConsumer refuses a transactional batch handler whose
// pool has no connection beyond the batches that may run at once (their
// leases would go unrenewed), and warns about the pool only then, not
// because Concurrency (twice BatchSize by default) is above it.
func TestBatchConsumerPoolCheck(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	plain := BatchHandlerFunc(func(context.Context, []*amqp.Delivery) ([]BatchResult, error) { return nil, nil })
	for _, tt := range []struct {
		name      string
		conns     int
		completer bool
		refused   bool
		warns     bool
	}{
		{name: "completer, a connection beyond the 2 batches", conns: 3, completer: true},
		{name: "completer, a connection per batch only", conns: 2, completer: true, refused: true},
		{name: "plain, pool above the batches", conns: 3},
		{name: "plain, pool at the batches", conns: 2, warns: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var logs bytes.Buffer
			store := pooledStore{mem, tt.conns}
			var h BatchHandler = plain
			if tt.completer {
				h = poolBatchCompleter{store}
			}
			// Prefetch and Concurrency by default: 400 and 200, 2 batches of 100.
			c, err := NewBatchConsumer(store, ConsumerConfig{URL: "amqp://localhost",
				Config: Config{Queue: "q", Logger: slog.New(slog.NewTextHandler(&logs, nil))}}, h)
			if got := errors.Is(err, ErrPoolTooSmall); got != tt.refused {
				t.Fatalf("refused: got %v (%v), want %v", got, err, tt.refused)
			}
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = c.Shutdown(context.Background()) })
			c.warnSizes(context.Background())
			if got := strings.Contains(logs.String(), "pool is not larger"); got != tt.warns {
				t.Errorf("warned: %v, want %v:\n%s", got, tt.warns, logs.String())
			}
		})
	}
}

// A batch consumer's defaults: the broker may send four batches' worth
// of deliveries while two batches run (Prefetch four times BatchSize,
// Concurrency twice), so that the next batch is in hand when one ends; a
// Prefetch given without Concurrency is also the Concurrency, as for
// NewConsumer.
func TestBatchConsumerDefaults(t *testing.T) {
	mem := mustMemory(t)
	plain := BatchHandlerFunc(func(context.Context, []*amqp.Delivery) ([]BatchResult, error) { return nil, nil })
	for _, tt := range []struct {
		name                         string
		batch, prefetch, concurrency int
		wantPrefetch, wantConc       int
		wantBatches                  int
	}{
		{name: "defaults", wantPrefetch: 400, wantConc: 200, wantBatches: 2},
		{name: "BatchSize 10", batch: 10, wantPrefetch: 40, wantConc: 20, wantBatches: 2},
		{name: "Prefetch given", prefetch: 150, wantPrefetch: 150, wantConc: 150, wantBatches: 2},
		{name: "Concurrency given", concurrency: 100, wantPrefetch: 400, wantConc: 100, wantBatches: 1},
		{name: "large BatchSize", batch: 20000, wantPrefetch: 65535, wantConc: 40000, wantBatches: 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := NewBatchConsumer(mem, ConsumerConfig{URL: "amqp://localhost", Prefetch: tt.prefetch, Concurrency: tt.concurrency,
				BatchSize: tt.batch, Config: Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)}}, plain)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = c.Shutdown(context.Background()) })
			if c.cfg.Prefetch != tt.wantPrefetch || c.cfg.Concurrency != tt.wantConc || cap(c.proc.batch.slots) != tt.wantBatches {
				t.Errorf("Prefetch %d, Concurrency %d, batches at once %d; want %d, %d, %d",
					c.cfg.Prefetch, c.cfg.Concurrency, cap(c.proc.batch.slots), tt.wantPrefetch, tt.wantConc, tt.wantBatches)
			}
		})
	}
}
