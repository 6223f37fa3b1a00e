package linearizable_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// stuckStore is a store whose Complete never returns until its channel
// closes: a process killed in the middle of that call.
type stuckStore struct {
	*lock.MemoryStore
	stuck chan struct{}
}

func (s *stuckStore) Complete(ctx context.Context, l lock.Lease, result []byte) error {
	<-s.stuck
	return s.MemoryStore.Complete(ctx, l, result)
}

// TestFileRecorder: the files of two recorders merge into one history
// whose times are the wall clock's, and a call whose return was never
// written (its process killed during it) is read as ambiguous, so that a
// later Acquire may find it applied or not.
func TestFileRecorder(t *testing.T) {
	ms, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	stuck := &stuckStore{MemoryStore: ms, stuck: make(chan struct{})}
	defer close(stuck.stuck)
	a, err := linearizable.NewFileRecorder(stuck, filepath.Join(dir, "a.history"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := linearizable.NewFileRecorder(ms, filepath.Join(dir, "b.history"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	before := time.Now().UnixNano()
	req := lock.Request{Key: "k", TTL: 50 * time.Millisecond, Retention: time.Hour}
	res, err := a.Client(0).Acquire(ctx, req)
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %+v, %v", res, err)
	}
	go func() { _ = a.Client(0).Complete(ctx, res.Lease, []byte("v")) }() // never returns
	time.Sleep(100 * time.Millisecond)
	// The lease expired; whether the stuck Complete landed is unknown to
	// b, which takes the key over.
	again, err := b.Client(1).Acquire(ctx, req)
	if err != nil || again.Status != lock.Acquired {
		t.Fatalf("Acquire after expiry: %+v, %v", again, err)
	}
	if err := b.Client(1).Complete(ctx, again.Lease, []byte("w")); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	// a's process "is killed": its file as it is now.
	history, err := linearizable.ReadHistories(filepath.Join(dir, "a.history"), filepath.Join(dir, "b.history"))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := len(history), 4; got != want {
		t.Fatalf("operations: got %d, want %d: %+v", got, want, history)
	}
	pending := history[1]
	if pending.Client != 0 || pending.In.Kind != linearizable.KindComplete || pending.Out.Err != linearizable.ErrAmbiguous {
		t.Errorf("the call without a return: got %+v, want client 0's complete, ambiguous", pending)
	}
	for _, op := range history {
		if op.In.Call < before || op.Out.Return != 0 && op.Out.Return < op.In.Call {
			t.Errorf("times not the wall clock's: %+v (test began at %d)", op, before)
		}
	}
	res2, err := linearizable.Check("file-recorder", linearizable.Params{Early: lock.DeadlineSlack, Late: time.Millisecond}, history, 2, 10*time.Second, "")
	if err != nil {
		t.Fatal(err)
	}
	if got := res2.Verdict(); got != "ok" {
		t.Errorf("check: result=%s, want ok", got)
	}
	// A line cut short by the kill is skipped.
	f, err := os.OpenFile(filepath.Join(dir, "a.history"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.WriteString(`{"seq":9,"in":{"kind":"acq`)
	f.Close()
	if h, err := linearizable.ReadHistories(filepath.Join(dir, "a.history")); err != nil || len(h) != 2 {
		t.Errorf("a file ending in a cut line: %d operations, %v; want 2, nil", len(h), err)
	}
}
