package heartbeat

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// lockedBuffer is a bytes.Buffer safe for the keeper's goroutines to log
// into while the test reads it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestKeepLogsEndpointAndKey: a lost lease of amqpidem's (its key the
// endpoint, a NUL byte and the message key: amqpidem.StoreKey) is logged
// with endpoint= and key= as amqpidem's own records are, not as the
// quoted internal key ("q\x00job-4").
func TestKeepLogsEndpointAndKey(t *testing.T) {
	t.Parallel()
	var logs lockedBuffer
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	lease := acquire(t, store, "q\x00job-4", 300*time.Millisecond)
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()
	if err := store.Release(context.Background(), lease); err != nil {
		t.Fatalf("Release from outside: %v", err)
	}
	waitDone(t, ctx, 5*time.Second)
	eventually(t, time.Second, "the lost lease logged", func() bool { return strings.Contains(logs.String(), "cancelling handler") })
	got := logs.String()
	if !strings.Contains(got, "endpoint=q key=job-4 ") || strings.Contains(got, `key="q`) {
		t.Fatalf("got log %q, want endpoint=q key=job-4", got)
	}
}
