package heartbeat

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/redis/go-redis/v9"
)

// faultStore wraps a Store and fails or blocks Extend on demand. It records
// every Extend call.
type faultStore struct {
	lock.Store

	mu       sync.Mutex
	fail     error         // every lease of a call gets it while non-nil
	block    chan struct{} // Extend waits for it to close while non-nil
	honorCtx bool          // a blocked Extend also returns when ctx is done
	delay    time.Duration // Extend sleeps this long before the real call
	calls    []extendCall
}

type extendCall struct {
	at          time.Time // when Extend was entered
	n           int       // leases in the call
	deadline    time.Time // ctx's deadline
	hasDeadline bool
	failed      bool
}

func (s *faultStore) Extend(ctx context.Context, leases ...lock.Lease) []error {
	c := extendCall{at: time.Now(), n: len(leases)}
	c.deadline, c.hasDeadline = ctx.Deadline()
	s.mu.Lock()
	fail, block, honorCtx, delay := s.fail, s.block, s.honorCtx, s.delay
	c.failed = fail != nil
	s.calls = append(s.calls, c)
	s.mu.Unlock()

	if block != nil {
		if honorCtx {
			select {
			case <-block:
			case <-ctx.Done():
			}
		} else {
			<-block
		}
	}
	time.Sleep(delay)
	if fail != nil {
		errs := make([]error, len(leases))
		for i := range errs {
			errs[i] = fail
		}
		return errs
	}
	return s.Store.Extend(ctx, leases...)
}

func (s *faultStore) set(f func(s *faultStore)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

func (s *faultStore) extendCalls() []extendCall {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]extendCall(nil), s.calls...)
}

func newMemoryStore(t *testing.T) *lock.MemoryStore {
	t.Helper()
	s, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatalf("NewMemoryStore: %v", err)
	}
	return s
}

// newKeeper returns a Keeper shut down in t.Cleanup.
func newKeeper(t *testing.T, store lock.Store, cfg Config) *Keeper {
	t.Helper()
	k, err := New(store, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := k.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	return k
}

func acquire(t *testing.T, store lock.Store, key string, ttl time.Duration) lock.Lease {
	t.Helper()
	res, err := store.Acquire(context.Background(), lock.Request{Key: key, TTL: ttl})
	if err != nil {
		t.Fatalf("Acquire %q: %v", key, err)
	}
	if got, want := res.Status, lock.Acquired; got != want {
		t.Fatalf("Acquire %q: got %v, want %v", key, got, want)
	}
	return res.Lease
}

// waitDone waits for ctx to be done and returns when it saw that.
func waitDone(t *testing.T, ctx context.Context, timeout time.Duration) time.Time {
	t.Helper()
	select {
	case <-ctx.Done():
		return time.Now()
	case <-time.After(timeout):
		t.Fatalf("context not cancelled within %v", timeout)
		return time.Time{}
	}
}

// notDone fails the test if ctx is done within d.
func notDone(t *testing.T, ctx context.Context, d time.Duration) {
	t.Helper()
	select {
	case <-ctx.Done():
		t.Fatalf("context cancelled: %v", context.Cause(ctx))
	case <-time.After(d):
	}
}

// eventually polls cond until it holds or timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitGoroutines waits until at most n goroutines run.
func waitGoroutines(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > n {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("goroutines: got %d, want at most %d\n%s", runtime.NumGoroutine(), n, buf)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name  string
		cfg   Config
		field string // empty: valid
	}{
		{"zero", Config{}, ""},
		{"margin", Config{SafetyMargin: time.Second}, ""},
		{"negative margin", Config{SafetyMargin: -time.Millisecond}, "SafetyMargin"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if tc.field == "" {
				if err != nil {
					t.Fatalf("Validate: got %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.field) {
				t.Fatalf("Validate: got %v, want an error naming %s", err, tc.field)
			}
			if _, err := New(newMemoryStore(t), tc.cfg); err == nil {
				t.Fatalf("New with invalid config: got nil error")
			}
		})
	}
}

func TestMarginAndInterval(t *testing.T) {
	tests := []struct {
		ttl, margin       time.Duration // margin 0: default
		wantMargin, wantI time.Duration
	}{
		{ttl: 30 * time.Second, wantMargin: 6 * time.Second, wantI: 10 * time.Second},
		{ttl: 300 * time.Millisecond, wantMargin: 60 * time.Millisecond, wantI: 100 * time.Millisecond},
		{ttl: 3 * time.Second, margin: time.Second, wantMargin: time.Second, wantI: time.Second},
		{ttl: 3 * time.Second, margin: 2 * time.Second, wantMargin: 2 * time.Second, wantI: 500 * time.Millisecond},
		{ttl: 2 * time.Millisecond, wantMargin: 400 * time.Microsecond, wantI: time.Millisecond},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%v/%v", tc.ttl, tc.margin), func(t *testing.T) {
			cfg := Config{SafetyMargin: tc.margin}.withDefaults()
			e := &entry{lease: lock.Lease{TTL: tc.ttl}, margin: cfg.margin(tc.ttl)}
			if got, want := e.margin, tc.wantMargin; got != want {
				t.Fatalf("margin: got %v, want %v", got, want)
			}
			if got, want := e.interval(), tc.wantI; got != want {
				t.Fatalf("interval: got %v, want %v", got, want)
			}
		})
	}
}

func TestNewNilStore(t *testing.T) {
	if _, err := New(nil, Config{}); err == nil {
		t.Fatalf("New(nil): got nil error")
	}
}

func TestKeepExtendsBeyondTTL(t *testing.T) {
	t.Parallel()
	store := &faultStore{Store: newMemoryStore(t)}
	k := newKeeper(t, store, Config{})
	const ttl = 500 * time.Millisecond
	lease := acquire(t, store, "long-handler", ttl)

	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()
	if got, want := k.Len(), 1; got != want {
		t.Fatalf("Len: got %d, want %d", got, want)
	}
	notDone(t, ctx, 6*ttl)

	got, ok := LeaseFromContext(ctx)
	if !ok {
		t.Fatalf("LeaseFromContext: no lease")
	}
	if got.Key != lease.Key || got.Owner != lease.Owner || got.Fence != lease.Fence {
		t.Fatalf("LeaseFromContext: got %+v, want %+v", got, lease)
	}
	if !got.Deadline.After(lease.Deadline.Add(4 * ttl)) {
		t.Fatalf("deadline not moved on: got %v, acquired with %v", got.Deadline, lease.Deadline)
	}
	if n := len(store.extendCalls()); n < 12 {
		t.Fatalf("Extend calls over 6 TTLs: got %d, want at least 12 (about every TTL/3)", n)
	}
	stop()
	if err := store.Complete(context.Background(), lease, []byte("ok")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if got, want := k.Len(), 0; got != want {
		t.Fatalf("Len after stop: got %d, want %d", got, want)
	}
}

func TestKeepBatchesDueLeases(t *testing.T) {
	store := &faultStore{Store: newMemoryStore(t)}
	base := runtime.NumGoroutine()
	k := newKeeper(t, store, Config{})
	const n, ttl = 5000, time.Second
	ctxs := make([]context.Context, n)
	for i := range n {
		var stop func()
		ctxs[i], stop = k.Keep(context.Background(), acquire(t, store, fmt.Sprint("batch-", i), ttl))
		defer stop()
	}
	time.Sleep(3 * ttl)
	for i, ctx := range ctxs {
		if ctx.Err() != nil {
			t.Fatalf("lease %d cancelled: %v", i, context.Cause(ctx))
		}
	}
	if got, max := runtime.NumGoroutine(), base+2; got > max {
		t.Fatalf("goroutines with %d leases: got %d, want at most %d", n, got, max)
	}
	calls := store.extendCalls()
	var leases int
	for _, c := range calls {
		leases += c.n
	}
	// Each lease is extended about every TTL/3: ~9 times in 3 TTLs.
	if leases < n*4 {
		t.Fatalf("leases extended: got %d, want at least %d", leases, n*4)
	}
	if avg := leases / len(calls); avg < n/4 {
		t.Fatalf("leases per Extend call: got %d (%d calls), want at least %d", avg, len(calls), n/4)
	}
}

func TestKeepDeadlineIsConservative(t *testing.T) {
	t.Parallel()
	const ttl, delay = 3 * time.Second, 200 * time.Millisecond
	store := &faultStore{Store: newMemoryStore(t), delay: delay}
	k := newKeeper(t, store, Config{})
	lease := acquire(t, store, "conservative", ttl)
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()

	eventually(t, 5*time.Second, "first extension", func() bool {
		l, _ := LeaseFromContext(ctx)
		return l.Deadline.After(lease.Deadline)
	})
	l, _ := LeaseFromContext(ctx)
	calls := store.extendCalls()
	if got, want := len(calls), 1; got != want {
		t.Fatalf("Extend calls: got %d, want %d", got, want)
	}
	c := calls[0]
	// The new deadline is the local time before the call plus TTL: not
	// after the call's entry plus TTL, and not counting the time the store
	// took to answer.
	if l.Deadline.After(c.at.Add(ttl)) {
		t.Fatalf("deadline %v is after the call's entry %v + TTL", l.Deadline, c.at)
	}
	if !l.Deadline.After(c.at.Add(ttl - delay)) {
		t.Fatalf("deadline %v is not near the call's entry %v + TTL", l.Deadline, c.at)
	}
	if !c.hasDeadline || !c.deadline.Equal(lease.Deadline) {
		t.Fatalf("Extend context deadline: got %v (%v), want the lease's deadline %v", c.deadline, c.hasDeadline, lease.Deadline)
	}
}

func TestKeepLostLease(t *testing.T) {
	t.Parallel()
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	const ttl = 1500 * time.Millisecond // extended every 500ms
	lease := acquire(t, store, "lost", ttl)
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()

	if err := store.Release(context.Background(), lease); err != nil {
		t.Fatalf("Release from outside: %v", err)
	}
	released := time.Now()
	done := waitDone(t, ctx, 5*time.Second)
	if err := context.Cause(ctx); !errors.Is(err, lock.ErrLeaseLost) {
		t.Fatalf("cause: got %v, want %v", err, lock.ErrLeaseLost)
	}
	if !strings.Contains(context.Cause(ctx).Error(), "lost") {
		t.Fatalf("cause %q does not name the key", context.Cause(ctx))
	}
	if got, max := done.Sub(released), ttl/3+500*time.Millisecond; got > max {
		t.Fatalf("cancelled %v after the lease was lost, want within one interval (%v, plus slack)", got, max)
	}
	eventually(t, time.Second, "lost lease unregistered", func() bool { return k.Len() == 0 })
}

func TestKeepRetriesTransportErrors(t *testing.T) {
	t.Parallel()
	store := &faultStore{Store: newMemoryStore(t)}
	k := newKeeper(t, store, Config{})
	const ttl = 2 * time.Second // extend every ~667ms, retry every ~200ms, cancel at 1.6s
	lease := acquire(t, store, "flaky", ttl)
	store.set(func(s *faultStore) { s.fail = errors.New("connection reset") })
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()

	eventually(t, 5*time.Second, "two failed Extend calls", func() bool { return len(store.extendCalls()) >= 2 })
	store.set(func(s *faultStore) { s.fail = nil })
	notDone(t, ctx, ttl)

	calls := store.extendCalls()
	if !calls[0].failed || !calls[1].failed {
		t.Fatalf("first calls did not fail: %+v", calls[:2])
	}
	if got, max := calls[1].at.Sub(calls[0].at), ttl/3; got >= max {
		t.Fatalf("retry after a transport error: got %v, want sooner than the interval %v", got, max)
	}
}

func TestKeepUnconfirmedWhenStoreFails(t *testing.T) {
	t.Parallel()
	store := &faultStore{Store: newMemoryStore(t)}
	store.set(func(s *faultStore) { s.fail = errors.New("connection refused") })
	k := newKeeper(t, store, Config{})
	const ttl = time.Second
	lease := acquire(t, store, "down", ttl)
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()

	done := waitDone(t, ctx, 5*time.Second)
	err := context.Cause(ctx)
	if !errors.Is(err, ErrLeaseUnconfirmed) {
		t.Fatalf("cause: got %v, want %v", err, ErrLeaseUnconfirmed)
	}
	if !strings.Contains(err.Error(), "connection refused") || !strings.Contains(err.Error(), "down") {
		t.Fatalf("cause %q lacks the key or the last error", err)
	}
	if !done.Before(lease.Deadline) {
		t.Fatalf("cancelled at %v, not before the deadline %v", done, lease.Deadline)
	}
}

// TestKeepBlockedExtend: an Extend call that hangs, ignoring its context,
// delays no deadline check, and Shutdown reports that it could not wait.
func TestKeepBlockedExtend(t *testing.T) {
	base := runtime.NumGoroutine()
	block := make(chan struct{})
	store := &faultStore{Store: newMemoryStore(t), block: block}
	k, err := New(store, Config{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	const ttl = time.Second
	lease1 := acquire(t, store, "blocked-1", ttl)
	ctx1, stop1 := k.Keep(context.Background(), lease1)
	defer stop1()
	eventually(t, 5*time.Second, "Extend called", func() bool { return len(store.extendCalls()) == 1 })

	// A lease kept while the extender hangs is watched all the same.
	lease2 := acquire(t, store, "blocked-2", 3*ttl/2)
	ctx2, stop2 := k.Keep(context.Background(), lease2)
	defer stop2()

	for _, c := range []struct {
		ctx   context.Context
		lease lock.Lease
	}{{ctx1, lease1}, {ctx2, lease2}} {
		done := waitDone(t, c.ctx, 5*time.Second)
		if err := context.Cause(c.ctx); !errors.Is(err, ErrLeaseUnconfirmed) {
			t.Fatalf("%s: cause: got %v, want %v", c.lease.Key, err, ErrLeaseUnconfirmed)
		}
		if c.lease.Key == "blocked-1" && !strings.Contains(context.Cause(c.ctx).Error(), "unanswered") {
			t.Fatalf("%s: cause %q does not say the extension is unanswered", c.lease.Key, context.Cause(c.ctx))
		}
		if !done.Before(c.lease.Deadline) {
			t.Fatalf("%s: cancelled at %v, not before the deadline %v", c.lease.Key, done, c.lease.Deadline)
		}
	}
	if got, want := len(store.extendCalls()), 1; got != want {
		t.Fatalf("Extend calls while one hangs: got %d, want %d", got, want)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := k.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown with a hanging Extend: got %v, want %v", err, context.DeadlineExceeded)
	}
	close(block)
	if err := k.Shutdown(context.Background()); err != nil {
		t.Fatalf("Shutdown after Extend returned: %v", err)
	}
	waitGoroutines(t, base)
}

func TestShutdownCancelsExtendContext(t *testing.T) {
	store := &faultStore{Store: newMemoryStore(t), block: make(chan struct{}), honorCtx: true}
	k, err := New(store, Config{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx, stop := k.Keep(context.Background(), acquire(t, store, "shutdown-extend", 300*time.Millisecond))
	defer stop()
	eventually(t, 5*time.Second, "Extend called", func() bool { return len(store.extendCalls()) == 1 })

	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := k.Shutdown(sctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if err := context.Cause(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("cause: got %v, want %v", err, ErrClosed)
	}
}

func TestShutdown(t *testing.T) {
	base := runtime.NumGoroutine()
	store := newMemoryStore(t)
	k, err := New(store, Config{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	const n = 100
	ctxs := make([]context.Context, n)
	for i := range n {
		var stop func()
		ctxs[i], stop = k.Keep(context.Background(), acquire(t, store, fmt.Sprint("shutdown-", i), time.Second))
		defer stop()
	}
	if got, want := k.Len(), n; got != want {
		t.Fatalf("Len: got %d, want %d", got, want)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := k.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	for i, c := range ctxs {
		if err := context.Cause(c); !errors.Is(err, ErrClosed) {
			t.Fatalf("lease %d: cause: got %v, want %v", i, err, ErrClosed)
		}
	}
	if got, want := k.Len(), 0; got != want {
		t.Fatalf("Len after Shutdown: got %d, want %d", got, want)
	}
	waitGoroutines(t, base)

	if err := k.Shutdown(ctx); err != nil {
		t.Fatalf("second Shutdown: %v", err)
	}
	kctx, stop := k.Keep(context.Background(), acquire(t, store, "after-shutdown", time.Second))
	defer stop()
	if err := context.Cause(kctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("Keep after Shutdown: cause: got %v, want %v", err, ErrClosed)
	}
	if got, want := k.Len(), 0; got != want {
		t.Fatalf("Len after Keep on a closed keeper: got %d, want %d", got, want)
	}
}

func TestKeepRefusesBadLeases(t *testing.T) {
	store := newMemoryStore(t)
	good := acquire(t, store, "good", time.Second)
	with := func(f func(l *lock.Lease)) lock.Lease {
		l := good
		f(&l)
		return l
	}
	tests := []struct {
		name   string
		margin time.Duration
		lease  lock.Lease
		want   error
		text   string
	}{
		{"zero TTL", 0, with(func(l *lock.Lease) { l.TTL = 0 }), ErrInvalidLease, "TTL"},
		{"negative TTL", 0, with(func(l *lock.Lease) { l.TTL = -time.Second }), ErrInvalidLease, "TTL"},
		{"margin equals TTL", time.Second, good, ErrInvalidLease, "margin"},
		{"margin above TTL", 2 * time.Second, good, ErrInvalidLease, "margin"},
		{"empty key", 0, with(func(l *lock.Lease) { l.Key = "" }), ErrInvalidLease, "key"},
		{"long key", 0, with(func(l *lock.Lease) { l.Key = strings.Repeat("k", lock.MaxKeyLen+1) }), ErrInvalidLease, "key"},
		{"zero deadline", 0, with(func(l *lock.Lease) { l.Deadline = time.Time{} }), ErrInvalidLease, "deadline"},
		{"past deadline", 0, with(func(l *lock.Lease) { l.Deadline = time.Now().Add(-time.Millisecond) }), ErrLeaseUnconfirmed, "good"},
		{"within margin", 0, with(func(l *lock.Lease) { l.Deadline = time.Now().Add(100 * time.Millisecond) }), ErrLeaseUnconfirmed, "good"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			k := newKeeper(t, store, Config{SafetyMargin: tc.margin})
			ctx, stop := k.Keep(context.Background(), tc.lease)
			defer stop()
			if ctx.Err() == nil {
				t.Fatalf("context not cancelled")
			}
			err := context.Cause(ctx)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("cause: got %v, want %v mentioning %q", err, tc.want, tc.text)
			}
			if got, want := k.Len(), 0; got != want {
				t.Fatalf("Len: got %d, want %d", got, want)
			}
		})
	}
}

// TestKeepStoreRefusesLease: a lease the store refuses as invalid is not
// retried until its deadline.
func TestKeepStoreRefusesLease(t *testing.T) {
	t.Parallel()
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	lease := acquire(t, store, "refused", 3*time.Second)
	lease.Retention = -time.Second // the store answers lock.ErrInvalidTTL
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()
	waitDone(t, ctx, 2*time.Second) // extended at 1s; unconfirmed would be 2.4s
	if err := context.Cause(ctx); !errors.Is(err, ErrInvalidLease) || !errors.Is(err, lock.ErrInvalidTTL) {
		t.Fatalf("cause: got %v, want %v and %v", err, ErrInvalidLease, lock.ErrInvalidTTL)
	}
}

func TestKeepStopAndParent(t *testing.T) {
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})

	ctx, stop := k.Keep(context.Background(), acquire(t, store, "stop", time.Second))
	stop()
	stop()
	if err := context.Cause(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("cause after stop: got %v, want %v", err, context.Canceled)
	}
	if got, want := k.Len(), 0; got != want {
		t.Fatalf("Len after stop: got %d, want %d", got, want)
	}

	errParent := errors.New("consumer stopping")
	parent, cancel := context.WithCancelCause(context.Background())
	ctx, stop = k.Keep(parent, acquire(t, store, "parent", 300*time.Millisecond))
	defer stop()
	cancel(errParent)
	if err := context.Cause(ctx); !errors.Is(err, errParent) {
		t.Fatalf("cause after parent cancel: got %v, want %v", err, errParent)
	}
	// The keeper stops extending a lease whose context is done.
	eventually(t, 2*time.Second, "lease dropped after parent cancel", func() bool { return k.Len() == 0 })

	ctx, stop = k.Keep(parent, acquire(t, store, "parent-done", time.Second))
	defer stop()
	if err := context.Cause(ctx); !errors.Is(err, errParent) {
		t.Fatalf("Keep with a done parent: cause: got %v, want %v", err, errParent)
	}
	if got, want := k.Len(), 0; got != want {
		t.Fatalf("Len with a done parent: got %d, want %d", got, want)
	}
}

func TestLeaseFromContext(t *testing.T) {
	if _, ok := LeaseFromContext(context.Background()); ok {
		t.Fatalf("LeaseFromContext(Background): got a lease")
	}
	want := lock.Lease{Key: "k", Owner: "o", Fence: 7, TTL: time.Second}
	got, ok := LeaseFromContext(WithLease(context.Background(), want))
	if !ok || got != want {
		t.Fatalf("LeaseFromContext(WithLease): got %+v, %v, want %+v", got, ok, want)
	}
}

func TestKeepConcurrent(t *testing.T) {
	store := newMemoryStore(t)
	k := newKeeper(t, store, Config{})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				res, err := store.Acquire(context.Background(), lock.Request{Key: fmt.Sprintf("concurrent-%d-%d", g, i), TTL: 200 * time.Millisecond})
				if err != nil || res.Status != lock.Acquired {
					t.Errorf("Acquire: %v, %v", res.Status, err)
					return
				}
				lease := res.Lease
				ctx, stop := k.Keep(context.Background(), lease)
				if i%2 == 0 {
					time.Sleep(time.Millisecond)
				}
				if _, ok := LeaseFromContext(ctx); !ok {
					t.Errorf("no lease in context")
				}
				if ctx.Err() != nil {
					t.Errorf("lease %q cancelled: %v", lease.Key, context.Cause(ctx))
				}
				stop()
			}
		})
	}
	wg.Wait()
	if got, want := k.Len(), 0; got != want {
		t.Fatalf("Len: got %d, want %d", got, want)
	}
}

// Integration tests against a real Redis (see internal/testenv).

// redisStore returns a RedisStore on client under prefix, with the scripts
// loaded.
func redisStore(t *testing.T, client *redis.Client, prefix string) *lock.RedisStore {
	t.Helper()
	store, err := lock.NewRedisStore(client, lock.Config{Prefix: prefix})
	if err != nil {
		t.Fatalf("NewRedisStore: %v", err)
	}
	if err := store.Check(context.Background()); err != nil {
		t.Fatalf("Check: %v", err)
	}
	return store
}

// sharedRedisStore returns a RedisStore on the shared test Redis under
// prefix, whose keys are deleted in t.Cleanup.
func sharedRedisStore(t *testing.T, prefix string) *lock.RedisStore {
	t.Helper()
	client := testenv.RedisClient(t)
	store := redisStore(t, client, prefix)
	t.Cleanup(func() {
		ctx := context.Background()
		iter := client.Scan(ctx, 0, prefix+":*", 1000).Iterator()
		for iter.Next(ctx) {
			client.Del(ctx, iter.Val())
		}
		if err := iter.Err(); err != nil {
			t.Errorf("cleaning up %s:*: %v", prefix, err)
		}
	})
	return store
}

// TestRedisLongHandler: a handler running 10 TTLs keeps its lease.
func TestRedisLongHandler(t *testing.T) {
	t.Parallel()
	store := sharedRedisStore(t, testenv.Name(t))
	k := newKeeper(t, store, Config{})
	const ttl = 500 * time.Millisecond
	lease := acquire(t, store, "long-handler", ttl)

	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()
	notDone(t, ctx, 10*ttl)
	stop()
	if err := store.Complete(context.Background(), lease, []byte("done")); err != nil {
		t.Fatalf("Complete after 10 TTLs: %v", err)
	}
}

// countHook counts the round trips that run Lua scripts (EVALSHA, EVAL):
// single commands and pipelines, and the records the piped scripts work on.
// Connection setup (HELLO, CLIENT SETINFO) is not counted.
type countHook struct {
	singles, pipelines, pipedCmds atomic.Int64
}

func isScript(cmd redis.Cmder) bool {
	name := cmd.Name()
	return name == "evalsha" || name == "eval"
}

// scriptKeys is the number of records a script call works on: one call
// may extend many leases.
func scriptKeys(cmd redis.Cmder) int64 {
	if args := cmd.Args(); len(args) > 2 {
		if n, ok := args[2].(int); ok {
			return int64(n)
		}
	}
	return 1
}

func (h *countHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScript(cmd) {
			h.singles.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var n int64
		for _, cmd := range cmds {
			if isScript(cmd) {
				n += scriptKeys(cmd)
			}
		}
		if n > 0 {
			h.pipelines.Add(1)
			h.pipedCmds.Add(n)
		}
		return next(ctx, cmds)
	}
}

func (h *countHook) reset() {
	h.singles.Store(0)
	h.pipelines.Store(0)
	h.pipedCmds.Store(0)
}

// TestRedisThousandLeases: one keeper keeps 1,000 leases with a constant
// number of goroutines and one pipelined round trip per Extend call.
func TestRedisThousandLeases(t *testing.T) {
	prefix := testenv.Name(t)
	acquirer := sharedRedisStore(t, prefix)
	client := testenv.RedisClient(t)
	hook := &countHook{}
	client.AddHook(hook)
	counted := &faultStore{Store: redisStore(t, client, prefix)}

	base := runtime.NumGoroutine()
	k := newKeeper(t, counted, Config{})
	const n, ttl = 1000, time.Second
	ctxs := make([]context.Context, n)
	for i := range n {
		var stop func()
		ctxs[i], stop = k.Keep(context.Background(), acquire(t, acquirer, fmt.Sprint("lease-", i), ttl))
		defer stop()
	}
	// Let the leases acquired over a spread of time settle into one batch.
	time.Sleep(ttl)
	hook.reset()
	calls0 := len(counted.extendCalls())

	const window = 3 * ttl
	time.Sleep(window)

	for i, ctx := range ctxs {
		if ctx.Err() != nil {
			t.Fatalf("lease %d cancelled: %v", i, context.Cause(ctx))
		}
	}
	if got, want := k.Len(), n; got != want {
		t.Fatalf("Len: got %d, want %d", got, want)
	}
	// The keeper's two goroutines, plus a little slack for the Redis
	// clients' connection pools: nothing per lease.
	goroutines := runtime.NumGoroutine()
	if max := base + 5; goroutines > max {
		t.Fatalf("goroutines with %d leases: got %d, want at most %d (%d before New)", n, goroutines, max, base)
	}

	calls := counted.extendCalls()[calls0:]
	singles, pipes, cmds := hook.singles.Load(), hook.pipelines.Load(), hook.pipedCmds.Load()
	t.Logf("%v: %d Extend calls, %d pipelines extending %d leases, %d single scripts; goroutines %d before New, %d with %d leases",
		window, len(calls), pipes, cmds, singles, base, goroutines, n)
	// Every Extend call is one round trip: a pipeline, or a single command
	// for a batch of one lease. One call may straddle each end of the window.
	if d := int64(len(calls)) - (pipes + singles); d < -1 || d > 1 {
		t.Fatalf("round trips: got %d pipelines + %d single commands for %d Extend calls, want one each", pipes, singles, len(calls))
	}
	// Each lease is extended about every TTL/3: ~9 times in 3 TTLs.
	if min := int64(n * 3); cmds+singles < min {
		t.Fatalf("leases extended: got %d, want at least %d", cmds+singles, min)
	}
	if avg := (cmds + singles) / max(pipes+singles, 1); avg < n/4 {
		t.Fatalf("leases per round trip: got %d, want at least %d", avg, n/4)
	}
}

// TestRedisLostLease: a lease completed from outside cancels the handler
// within one extension interval.
func TestRedisLostLease(t *testing.T) {
	t.Parallel()
	prefix := testenv.Name(t)
	store := sharedRedisStore(t, prefix)
	other := sharedRedisStore(t, prefix)
	k := newKeeper(t, store, Config{})
	const ttl = 1500 * time.Millisecond // extended every 500ms
	lease := acquire(t, store, "lost", ttl)
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()

	if err := other.Complete(context.Background(), lease, []byte("elsewhere")); err != nil {
		t.Fatalf("Complete from outside: %v", err)
	}
	lost := time.Now()
	done := waitDone(t, ctx, 5*time.Second)
	if err := context.Cause(ctx); !errors.Is(err, lock.ErrLeaseLost) || !strings.Contains(err.Error(), "lost") {
		t.Fatalf("cause: got %v, want %v naming the key", err, lock.ErrLeaseLost)
	}
	if got, max := done.Sub(lost), ttl/3+500*time.Millisecond; got > max {
		t.Fatalf("cancelled %v after the lease was lost, want within one interval (%v, plus slack)", got, max)
	}
}

// TestRedisPaused: with Redis paused (CLIENT PAUSE ALL) the Extend call
// hangs; the handler is cancelled with ErrLeaseUnconfirmed before the lease's
// conservative deadline all the same.
func TestRedisPaused(t *testing.T) {
	t.Parallel()
	srv := testenv.RedisServer(t)
	store := redisStore(t, srv.Client(t), testenv.Name(t))
	admin := srv.Client(t)
	const ttl, margin = time.Second, 300 * time.Millisecond
	k := newKeeper(t, store, Config{SafetyMargin: margin})
	lease := acquire(t, store, "paused", ttl)
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()
	eventually(t, 5*time.Second, "first extension", func() bool {
		l, _ := LeaseFromContext(ctx)
		return l.Deadline.After(lease.Deadline)
	})
	if ctx.Err() != nil {
		t.Fatalf("cancelled before the pause: %v", context.Cause(ctx))
	}

	const pause = 3 * ttl
	if err := admin.Do(context.Background(), "CLIENT", "PAUSE", pause.Milliseconds(), "ALL").Err(); err != nil {
		t.Fatalf("CLIENT PAUSE: %v", err)
	}
	paused := time.Now()
	done := waitDone(t, ctx, 5*time.Second)
	l, _ := LeaseFromContext(ctx)
	t.Logf("cancelled %v after the pause, %v before the local deadline", done.Sub(paused), l.Deadline.Sub(done))
	if err := context.Cause(ctx); !errors.Is(err, ErrLeaseUnconfirmed) || !strings.Contains(err.Error(), "unanswered") {
		t.Fatalf("cause: got %v, want %v with the extension unanswered", err, ErrLeaseUnconfirmed)
	}
	if !done.Before(l.Deadline) {
		t.Fatalf("cancelled at %v, not before the lease's local deadline %v", done, l.Deadline)
	}
	if done.Before(paused) {
		t.Fatalf("cancelled before the pause")
	}
}

// TestRedisDown: with Redis killed, extensions fail (or hang while go-redis
// redials); the handler is cancelled with ErrLeaseUnconfirmed before the
// deadline.
func TestRedisDown(t *testing.T) {
	t.Parallel()
	srv := testenv.RedisServer(t)
	store := redisStore(t, srv.Client(t), testenv.Name(t))
	const ttl, margin = time.Second, 300 * time.Millisecond
	k := newKeeper(t, store, Config{SafetyMargin: margin})
	lease := acquire(t, store, "down", ttl)
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()
	eventually(t, 5*time.Second, "first extension", func() bool {
		l, _ := LeaseFromContext(ctx)
		return l.Deadline.After(lease.Deadline)
	})

	srv.Stop()
	done := waitDone(t, ctx, 5*time.Second)
	l, _ := LeaseFromContext(ctx)
	err := context.Cause(ctx)
	if !errors.Is(err, ErrLeaseUnconfirmed) {
		t.Fatalf("cause: got %v, want %v", err, ErrLeaseUnconfirmed)
	}
	if !done.Before(l.Deadline) {
		t.Fatalf("cancelled at %v, not before the lease's local deadline %v", done, l.Deadline)
	}
}

// A lease already past its deadline when Keep is called is cancelled at
// once with ErrLeaseUnconfirmed, and its cause says that no extension was
// tried (h-trial saw "lease extension not confirmed before deadline" for
// a lease whose acquire had answered late, which sends an operator after
// an extension that never happened).
func TestKeepLateLeaseSaysNoExtensionTried(t *testing.T) {
	k := newKeeper(t, newMemoryStore(t), Config{})
	l := lock.Lease{Key: "late", Owner: "o", Fence: 1, Attempt: 1, TTL: time.Second, Retention: time.Hour, Deadline: time.Now().Add(-time.Millisecond)}
	ctx, stop := k.Keep(context.Background(), l)
	defer stop()
	cause := context.Cause(ctx)
	if !errors.Is(cause, ErrLeaseUnconfirmed) || !strings.Contains(cause.Error(), "no extension tried") {
		t.Fatalf("cause %v: want ErrLeaseUnconfirmed saying that no extension was tried", cause)
	}
}

// panicExtendStore is a Store whose Extend panics.
type panicExtendStore struct{ lock.Store }

func (panicExtendStore) Extend(context.Context, ...lock.Lease) []error {
	panic("the driver's state is corrupt")
}

// TestKeepStoreExtendPanics: a store whose Extend panics does not take the
// process down (the extender runs on a goroutine of its own, where a panic
// cannot be recovered by anyone else): the lease counts as not extended,
// and the kept context is cancelled as unconfirmed before its deadline,
// saying why. Before the fix the test binary crashed.
func TestKeepStoreExtendPanics(t *testing.T) {
	t.Parallel()
	mem := newMemoryStore(t)
	var logs testenv.SyncBuffer
	k := newKeeper(t, panicExtendStore{mem}, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	lease := acquire(t, mem, "panics", time.Second)
	ctx, stop := k.Keep(context.Background(), lease)
	defer stop()

	done := waitDone(t, ctx, 5*time.Second)
	err := context.Cause(ctx)
	if !errors.Is(err, ErrLeaseUnconfirmed) || !strings.Contains(err.Error(), "Extend panicked: the driver's state is corrupt") {
		t.Fatalf("cause: got %v, want %v saying the store panicked", err, ErrLeaseUnconfirmed)
	}
	if !done.Before(lease.Deadline) {
		t.Fatalf("cancelled at %v, not before the deadline %v", done, lease.Deadline)
	}
	if s := logs.String(); !strings.Contains(s, "the store's Extend panicked") || !strings.Contains(s, "keeper_test.go") {
		t.Fatalf("log lacks the panic and its stack:\n%s", s)
	}
}
