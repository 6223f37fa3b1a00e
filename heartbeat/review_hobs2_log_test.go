package heartbeat

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// The warning logged when a kept lease is lost says what the Keeper does
// about it: a Keep lease's context is cancelled ("cancelling handler"), a
// KeepWith lease's LossHandler is told, and nothing is cancelled by the
// Keeper. Both ways a lease is lost: an Extend answering it lost, and no
// extension confirmed before its deadline.
func TestHobs2KeepWithLossLogSaysLossHandler(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		lose func(t *testing.T, s *faultStore, lease lock.Lease)
	}{
		{"lost", func(t *testing.T, s *faultStore, lease lock.Lease) {
			if err := s.Release(context.Background(), lease); err != nil {
				t.Fatalf("Release from outside: %v", err)
			}
		}},
		{"unconfirmed", func(t *testing.T, s *faultStore, _ lock.Lease) {
			s.set(func(s *faultStore) { s.fail = errors.New("transport down (test)") })
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var logs lockedBuffer
			store := &faultStore{Store: newMemoryStore(t)}
			k := newKeeper(t, store, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			lease := acquire(t, store, "hobs2-log-"+tc.name, 300*time.Millisecond)
			r := newLossRecorder()
			kept, err := k.KeepWith(lease, r)
			if err != nil {
				t.Fatal(err)
			}
			defer kept.Stop()
			tc.lose(t, store, lease)
			r.wait(t, 5*time.Second)
			eventually(t, time.Second, "the lost lease logged", func() bool { return strings.Contains(logs.String(), "level=WARN msg=\"heartbeat: lease") })
			got := logs.String()
			if strings.Contains(got, "cancelling handler") || !strings.Contains(got, "telling its LossHandler") {
				t.Errorf("a KeepWith lease's loss logged %q: want it to say its LossHandler is told, not that a handler is cancelled", got)
			}
		})
	}
}
