package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// interruptingAdmin answers Inspect, then cancels the run's context: an
// operator's Ctrl-C landing just after a lookup succeeded.
type interruptingAdmin struct {
	lock.Admin
	cancel context.CancelFunc
}

func (a interruptingAdmin) Inspect(ctx context.Context, key string) (lock.Record, error) {
	rec, err := a.Admin.Inspect(ctx, key)
	a.cancel()
	return rec, err
}

// failedRecord stores a failed record of key under endpoint in a new
// MemoryStore.
func failedRecord(t *testing.T, endpoint, key string) *lock.MemoryStore {
	t.Helper()
	s, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: amqpidem.StoreKey(endpoint, key)})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Fail(ctx, res.Lease, "permanent failure: card declined"); err != nil {
		t.Fatal(err)
	}
	return s
}

// A lookup that succeeded is decided on, even when the run is interrupted
// right after it: the interruption is not a store error (it printed
// "Redis at ...: %!w(<nil>)").
func TestRecordInterruptedAfterLookup(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	admin := interruptingAdmin{Admin: failedRecord(t, "orders", "k1"), cancel: cancel}
	r := &replayer{o: &options{timeout: time.Second, redisURL: "redis://127.0.0.1:6379/0"}, queue: "orders",
		k: &keyFlags{queue: "orders"}, admin: admin}
	action, _, why, err := r.record(ctx, "orders", "k1")
	if err != nil {
		t.Fatalf("record: %v, want the failed record decided on", err)
	}
	if got, want := action, "left"; got != want || !strings.Contains(why, "record failed") {
		t.Fatalf("record: got %q (%s), want %q (record failed)", got, why, want)
	}
}
