package heartbeat

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// BenchmarkKeep measures what keeping one lease of a batch costs: Keep and
// stop of 100 leases under one batch's context, as amqpidem's batch
// consumer keeps each message's lease, with a TTL long enough that no
// extension runs. One op is one lease.
func BenchmarkKeep(b *testing.B) {
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		b.Fatal(err)
	}
	k, err := New(store, Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer k.Shutdown(context.Background())
	const size = 100
	leases := make([]lock.Lease, size)
	for i := range leases {
		leases[i] = lock.Lease{Key: "k" + strconv.Itoa(i), Owner: "o", Fence: 1, Attempt: 1, TTL: time.Hour, Retention: time.Hour}
	}
	stops := make([]func(), size)
	b.ReportAllocs()
	b.ResetTimer()
	for n := 0; n < b.N; {
		batch, cancel := context.WithCancel(context.Background())
		m := min(size, b.N-n)
		for i := range m {
			leases[i].Deadline = time.Now().Add(time.Hour)
			var ctx context.Context
			ctx, stops[i] = k.Keep(batch, leases[i])
			if ctx.Err() != nil {
				b.Fatal(context.Cause(ctx))
			}
		}
		for i := range m {
			stops[i]()
		}
		cancel()
		n += m
	}
}

// The context Keep returns carries the parent's values and deadline, the
// lease, and its cancellation (and cause) to its children.
func TestKeepContext(t *testing.T) {
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	k, err := New(store, Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Shutdown(context.Background())
	type key struct{}
	parent, cancel := context.WithDeadline(context.WithValue(context.Background(), key{}, "v"), time.Now().Add(time.Hour))
	defer cancel()
	l := lock.Lease{Key: "k", Owner: "o", Fence: 7, Attempt: 1, TTL: time.Hour, Retention: time.Hour, Deadline: time.Now().Add(time.Hour)}
	ctx, stop := k.Keep(parent, l)
	child, cancelChild := context.WithCancel(ctx)
	defer cancelChild()
	if got, _ := LeaseFromContext(child); got.Fence != 7 || got.Key != "k" {
		t.Errorf("LeaseFromContext = %+v", got)
	}
	if child.Value(key{}) != "v" {
		t.Errorf("parent's value lost")
	}
	if d, ok := child.Deadline(); !ok || !d.Equal(func() time.Time { d, _ := parent.Deadline(); return d }()) {
		t.Errorf("Deadline = %v %v", d, ok)
	}
	if ctx.Err() != nil {
		t.Fatal(ctx.Err())
	}
	k.Shutdown(context.Background())
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("child not cancelled with the kept context")
	}
	if !errors.Is(context.Cause(child), ErrClosed) || !errors.Is(context.Cause(ctx), ErrClosed) {
		t.Errorf("causes %v, %v: want ErrClosed", context.Cause(child), context.Cause(ctx))
	}
	stop()
}
