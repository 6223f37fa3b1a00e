package storetest

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// NewStore returns a fresh store configured with cfg. cfg.Prefix is unique
// per call so that stores sharing a server do not see each other's records.
type NewStore func(t *testing.T, cfg lock.Config) lock.Store

// Run runs the suite against stores made by newStore, which must also
// implement lock.Admin and lock.Amender.
func Run(t *testing.T, newStore NewStore) {
	prefixes := 0
	store := func(t *testing.T, cfg lock.Config) lock.Store {
		t.Helper()
		prefixes++
		if cfg.Prefix == "" {
			cfg.Prefix = uniquePrefix(t, prefixes)
		}
		return newStore(t, cfg)
	}
	tests := []struct {
		name string
		fn   func(*testing.T, func(*testing.T, lock.Config) lock.Store)
	}{
		{"Lifecycle", testLifecycle},
		{"RetriedWritesAreIdempotent", testRetriedWrites},
		{"ReleaseKeepsAttempts", testRelease},
		{"CancelTakesBackAttempt", testCancel},
		{"FailStoresError", testFail},
		{"ExpiredLeaseTakenOver", testTakeover},
		{"ExpiredLeaseNotTakenOverCanComplete", testExpiredNotTakenOver},
		{"ConcurrentAcquireOneWinner", testConcurrentAcquire},
		{"FenceStrictlyIncreases", testFenceIncreases},
		{"FingerprintConflict", testConflict},
		{"FingerprintOfFirstAcquireOnly", testConflictFirstSeen},
		{"ExtendBatchPositionalErrors", testExtendBatch},
		{"RetentionExpiresRecords", testRetention},
		{"FenceSurvivesLostRecord", testFenceSurvivesLostRecord},
		{"SubMillisecondRetentionRefused", testSubMillisecondRetention},
		{"PrefixesAreNamespaces", testNamespaces},
		{"BadInput", testBadInput},
		{"ResultSizeLimit", testResultLimit},
		{"AdminInspect", testInspect},
		{"AdminForget", testForget},
		{"ListByState", testList},
		{"AmendCompletedValue", testAmend},
		{"AmendRefusedUnlessCompletedWithFenceAndValue", testAmendRefused},
		{"AmendConcurrentOneWinner", testAmendConcurrent},
		{"AmendKeepsExpiry", testAmendExpiry},
		{"AmendBadInput", testAmendBadInput},
		{"AcquireBatchPerKey", testAcquireBatch},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, store) })
	}
}

func uniquePrefix(t *testing.T, n int) string {
	name := strings.NewReplacer("/", "-", "{", "", "}", "", " ", "_").Replace(t.Name())
	if len(name) > 40 {
		name = name[len(name)-40:]
	}
	return "st-" + name + "-" + time.Now().Format("150405.000000") + "-" + string(rune('a'+n%26))
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func acquire(t *testing.T, s lock.Store, req lock.Request, want lock.Status) lock.Result {
	t.Helper()
	res, err := s.Acquire(ctx(t), req)
	if err != nil {
		t.Fatalf("Acquire(%q): %v", req.Key, err)
	}
	if res.Status != want {
		t.Fatalf("Acquire(%q): got %v, want %v (result %+v)", req.Key, res.Status, want, res)
	}
	return res
}

func wantLost(t *testing.T, op string, err error) {
	t.Helper()
	if !errors.Is(err, lock.ErrLeaseLost) {
		t.Fatalf("%s: got %v, want ErrLeaseLost", op, err)
	}
}

func noErr(t *testing.T, op string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", op, err)
	}
}

func testLifecycle(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{LeaseTTL: 5 * time.Second})
	req := lock.Request{Key: "order-1"}
	before := time.Now()
	res := acquire(t, s, req, lock.Acquired)
	l := res.Lease
	if l.Fence < before.UnixMicro() || l.Attempt != 1 || res.Attempts != 1 || l.Key != "order-1" || l.Owner == "" {
		t.Fatalf("first lease: got %+v, want fence from the clock (µs), attempt 1", l)
	}
	if l.TTL != 5*time.Second || l.Deadline.Before(before.Add(5*time.Second-lock.DeadlineSlack)) || l.Deadline.After(time.Now().Add(5*time.Second)) {
		t.Fatalf("lease TTL/deadline: got %v / %v, want 5s from the call", l.TTL, l.Deadline)
	}

	busy := acquire(t, s, req, lock.InProgress)
	if busy.Remaining <= 3*time.Second || busy.Remaining > 5*time.Second {
		t.Fatalf("in progress: remaining %v, want (3s, 5s]", busy.Remaining)
	}
	if busy.Fence != l.Fence || busy.Attempts != 1 {
		t.Fatalf("in progress: fence %d attempts %d, want %d 1", busy.Fence, busy.Attempts, l.Fence)
	}

	noErr(t, "Extend", s.Extend(ctx(t), l)[0])
	noErr(t, "Complete", s.Complete(ctx(t), l, []byte("receipt-42")))

	done := acquire(t, s, req, lock.Completed)
	if got, want := string(done.Value), "receipt-42"; got != want {
		t.Fatalf("stored result: got %q, want %q", got, want)
	}
	if done.Fence != l.Fence || done.Attempts != 1 {
		t.Fatalf("completed: fence %d attempts %d, want %d 1", done.Fence, done.Attempts, l.Fence)
	}
	wantLost(t, "Extend after Complete", s.Extend(ctx(t), l)[0])
	wantLost(t, "Fail after Complete", s.Fail(ctx(t), l, "late"))
	wantLost(t, "Release after Complete", s.Release(ctx(t), l))
	again := acquire(t, s, req, lock.Completed)
	if !bytes.Equal(again.Value, []byte("receipt-42")) {
		t.Fatalf("record changed by a rejected write: %q", again.Value)
	}

	// An empty result is a result.
	res = acquire(t, s, lock.Request{Key: "order-2"}, lock.Acquired)
	noErr(t, "Complete(nil)", s.Complete(ctx(t), res.Lease, nil))
	if got := acquire(t, s, lock.Request{Key: "order-2"}, lock.Completed); len(got.Value) != 0 {
		t.Fatalf("empty result: got %q", got.Value)
	}
}

func testRetriedWrites(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	l := acquire(t, s, lock.Request{Key: "k"}, lock.Acquired).Lease
	noErr(t, "Complete", s.Complete(ctx(t), l, []byte("r")))
	noErr(t, "Complete retried", s.Complete(ctx(t), l, []byte("r")))

	l = acquire(t, s, lock.Request{Key: "f"}, lock.Acquired).Lease
	noErr(t, "Fail", s.Fail(ctx(t), l, "boom"))
	noErr(t, "Fail retried", s.Fail(ctx(t), l, "boom"))

	l = acquire(t, s, lock.Request{Key: "r"}, lock.Acquired).Lease
	noErr(t, "Release", s.Release(ctx(t), l))
	noErr(t, "Release retried", s.Release(ctx(t), l))
	wantLost(t, "Complete after Release", s.Complete(ctx(t), l, nil))

	// A retried Cancel answers nil and takes back no second attempt.
	first := acquire(t, s, lock.Request{Key: "x"}, lock.Acquired).Lease
	noErr(t, "Release", s.Release(ctx(t), first))
	l = acquire(t, s, lock.Request{Key: "x"}, lock.Acquired).Lease
	noErr(t, "Cancel", s.Cancel(ctx(t), l))
	noErr(t, "Cancel retried", s.Cancel(ctx(t), l))
	wantLost(t, "Complete after Cancel", s.Complete(ctx(t), l, nil))
	wantLost(t, "Release after Cancel", s.Release(ctx(t), l))
	if got := acquire(t, s, lock.Request{Key: "x"}, lock.Acquired); got.Attempts != 2 || got.Fence <= l.Fence {
		t.Fatalf("after a retried Cancel: attempts %d fence %d, want 2 and above %d", got.Attempts, got.Fence, l.Fence)
	}
}

func testCancel(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	req := lock.Request{Key: "never-ran"}
	first := acquire(t, s, req, lock.Acquired)
	noErr(t, "Cancel", s.Cancel(ctx(t), first.Lease))
	second := acquire(t, s, req, lock.Acquired)
	if second.Attempts != first.Attempts || second.Lease.Attempt != first.Lease.Attempt {
		t.Fatalf("after Cancel: attempts %d (lease %d), want %d as before",
			second.Attempts, second.Lease.Attempt, first.Attempts)
	}
	if second.Lease.Fence <= first.Lease.Fence || second.Fence != second.Lease.Fence {
		t.Fatalf("after Cancel: fence %d, want above %d", second.Lease.Fence, first.Lease.Fence)
	}
	if second.Lease.Owner == first.Lease.Owner {
		t.Fatal("a new lease reused the cancelled owner token")
	}
	wantLost(t, "Cancel by the cancelled lease", s.Cancel(ctx(t), first.Lease))
	wantLost(t, "Extend by the cancelled lease", s.Extend(ctx(t), first.Lease)[0])
	wantLost(t, "Complete by the cancelled lease", s.Complete(ctx(t), first.Lease, []byte("stale")))

	// A stale lease (taken over after expiry) cannot cancel, and changes
	// nothing.
	stale := acquire(t, s, lock.Request{Key: "taken", TTL: 50 * time.Millisecond}, lock.Acquired).Lease
	time.Sleep(120 * time.Millisecond)
	cur := acquire(t, s, lock.Request{Key: "taken"}, lock.Acquired).Lease
	wantLost(t, "Cancel by a stale lease", s.Cancel(ctx(t), stale))
	busy := acquire(t, s, lock.Request{Key: "taken"}, lock.InProgress)
	if busy.Fence != cur.Fence || busy.Attempts != 2 {
		t.Fatalf("after a stale Cancel: %+v, want the new owner's lease, 2 attempts", busy)
	}

	// Cancel after an outcome is refused and keeps the outcome.
	done := acquire(t, s, lock.Request{Key: "done"}, lock.Acquired).Lease
	noErr(t, "Complete", s.Complete(ctx(t), done, []byte("ok")))
	wantLost(t, "Cancel after Complete", s.Cancel(ctx(t), done))
	if got := acquire(t, s, lock.Request{Key: "done"}, lock.Completed); string(got.Value) != "ok" || got.Attempts != 1 {
		t.Fatalf("completed after a refused Cancel: %+v", got)
	}

	// Attempts never go below zero, and Cancel after Release is refused.
	for range 3 {
		l := acquire(t, s, lock.Request{Key: "again"}, lock.Acquired).Lease
		if l.Attempt != 1 {
			t.Fatalf("cancelled repeatedly: attempt %d, want 1", l.Attempt)
		}
		noErr(t, "Cancel", s.Cancel(ctx(t), l))
	}
	l := acquire(t, s, lock.Request{Key: "again"}, lock.Acquired).Lease
	if l.Attempt != 1 {
		t.Fatalf("after 3 cancels: attempt %d, want 1", l.Attempt)
	}
	noErr(t, "Release", s.Release(ctx(t), l))
	wantLost(t, "Cancel after Release", s.Cancel(ctx(t), l))
	if got := acquire(t, s, lock.Request{Key: "again"}, lock.Acquired).Lease; got.Attempt != 2 {
		t.Fatalf("after Release and a refused Cancel: attempt %d, want 2", got.Attempt)
	}
}

func testRelease(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	req := lock.Request{Key: "payment-7"}
	first := acquire(t, s, req, lock.Acquired).Lease
	noErr(t, "Release", s.Release(ctx(t), first))
	second := acquire(t, s, req, lock.Acquired).Lease
	if second.Fence <= first.Fence || second.Attempt != 2 {
		t.Fatalf("after release: fence %d attempt %d, want above %d, 2", second.Fence, second.Attempt, first.Fence)
	}
	if second.Owner == first.Owner {
		t.Fatal("a new lease reused the old owner token")
	}
	wantLost(t, "Extend by released owner", s.Extend(ctx(t), first)[0])
	wantLost(t, "Complete by released owner", s.Complete(ctx(t), first, []byte("stale")))
	noErr(t, "Complete", s.Complete(ctx(t), second, []byte("ok")))
	if got := acquire(t, s, req, lock.Completed); string(got.Value) != "ok" || got.Attempts != 2 {
		t.Fatalf("completed after retry: %+v", got)
	}
}

func testFail(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{MaxResultSize: 64})
	l := acquire(t, s, lock.Request{Key: "bad"}, lock.Acquired).Lease
	long := strings.Repeat("card declined; ", 20)
	noErr(t, "Fail", s.Fail(ctx(t), l, long))
	got := acquire(t, s, lock.Request{Key: "bad"}, lock.Failed)
	if len(got.Error) > 64 || !strings.HasPrefix(got.Error, "card declined; ") || !strings.Contains(got.Error, "truncated") {
		t.Fatalf("stored error: %q (%d bytes), want a marked cut to 64 bytes", got.Error, len(got.Error))
	}
	wantLost(t, "Complete after Fail", s.Complete(ctx(t), l, nil))
}

func testTakeover(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	req := lock.Request{Key: "inventory-9", TTL: 150 * time.Millisecond}
	old := acquire(t, s, req, lock.Acquired).Lease
	acquire(t, s, req, lock.InProgress)
	time.Sleep(250 * time.Millisecond)

	req.TTL = 10 * time.Second
	cur := acquire(t, s, req, lock.Acquired).Lease
	if cur.Fence <= old.Fence || cur.Attempt != 2 {
		t.Fatalf("takeover: fence %d attempt %d, want fence > %d and attempt 2", cur.Fence, cur.Attempt, old.Fence)
	}
	wantLost(t, "old Extend", s.Extend(ctx(t), old)[0])
	wantLost(t, "old Complete", s.Complete(ctx(t), old, []byte("stale")))
	wantLost(t, "old Fail", s.Fail(ctx(t), old, "stale"))
	wantLost(t, "old Release", s.Release(ctx(t), old))

	// The record is the new owner's, untouched by the stale writes.
	busy := acquire(t, s, req, lock.InProgress)
	if busy.Fence != cur.Fence || busy.Attempts != 2 || busy.Remaining < 5*time.Second {
		t.Fatalf("after stale writes: %+v, want the new owner's live lease", busy)
	}
	noErr(t, "new Extend", s.Extend(ctx(t), cur)[0])
	noErr(t, "new Complete", s.Complete(ctx(t), cur, []byte("fresh")))
	if got := acquire(t, s, req, lock.Completed); string(got.Value) != "fresh" {
		t.Fatalf("result: %q", got.Value)
	}
}

func testExpiredNotTakenOver(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	// Nobody else ran the operation after the lease expired, so the
	// owner's result is still the only one: owner and fence decide, not
	// the deadline.
	s := store(t, lock.Config{})
	l := acquire(t, s, lock.Request{Key: "slow", TTL: 50 * time.Millisecond}, lock.Acquired).Lease
	time.Sleep(120 * time.Millisecond)
	noErr(t, "Complete after expiry", s.Complete(ctx(t), l, []byte("late but only")))
	acquire(t, s, lock.Request{Key: "slow"}, lock.Completed)
}

func testConcurrentAcquire(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{LeaseTTL: 30 * time.Second})
	const n = 200
	var (
		wg       sync.WaitGroup
		start    = make(chan struct{})
		statuses = make([]lock.Status, n)
		errs     = make([]error, n)
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			res, err := s.Acquire(context.Background(), lock.Request{Key: "hot"})
			statuses[i], errs[i] = res.Status, err
		}()
	}
	close(start)
	wg.Wait()
	counts := map[lock.Status]int{}
	for i := range n {
		noErr(t, "Acquire", errs[i])
		counts[statuses[i]]++
	}
	if counts[lock.Acquired] != 1 || counts[lock.InProgress] != n-1 {
		t.Fatalf("200 concurrent acquires: got %v, want 1 acquired and 199 in progress", counts)
	}
}

func testFenceIncreases(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	var last int64
	for i := range 12 {
		req := lock.Request{Key: "fenced", TTL: 30 * time.Second}
		if i%3 == 2 {
			req.TTL = 20 * time.Millisecond
		}
		l := acquire(t, s, req, lock.Acquired).Lease
		if l.Fence <= last {
			t.Fatalf("round %d: fence %d after %d", i, l.Fence, last)
		}
		last = l.Fence
		if i%3 == 2 {
			time.Sleep(60 * time.Millisecond) // expire, to be taken over
		} else {
			noErr(t, "Release", s.Release(ctx(t), l))
		}
	}
	// The last lease expired: the next is the 13th.
	if res := acquire(t, s, lock.Request{Key: "fenced"}, lock.Acquired); res.Attempts != 13 || res.Fence <= last {
		t.Fatalf("after 12 leases: attempts %d fence %d, want 13 and above %d", res.Attempts, res.Fence, last)
	}
}

func testConflict(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	l := acquire(t, s, lock.Request{Key: "pay", Fingerprint: "sha:aaa"}, lock.Acquired).Lease
	acquire(t, s, lock.Request{Key: "pay", Fingerprint: "sha:bbb"}, lock.Conflict)
	acquire(t, s, lock.Request{Key: "pay", Fingerprint: "sha:aaa"}, lock.InProgress)
	acquire(t, s, lock.Request{Key: "pay"}, lock.InProgress) // empty: no check
	noErr(t, "Complete", s.Complete(ctx(t), l, []byte("done")))
	acquire(t, s, lock.Request{Key: "pay", Fingerprint: "sha:bbb"}, lock.Conflict)
	acquire(t, s, lock.Request{Key: "pay", Fingerprint: "sha:aaa"}, lock.Completed)
}

// testConflictFirstSeen: a record keeps the fingerprint it was made with,
// none included, across later leases: a key first seen without one never
// conflicts, whatever later Acquires pass (dynamostore took the
// fingerprint of the Acquire that took a released record over, which the
// linearizability check of test/linearizable found).
func testConflictFirstSeen(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	l := acquire(t, s, lock.Request{Key: "pay"}, lock.Acquired).Lease
	noErr(t, "Release", s.Release(ctx(t), l))
	l = acquire(t, s, lock.Request{Key: "pay", Fingerprint: "sha:bbb"}, lock.Acquired).Lease
	noErr(t, "Cancel", s.Cancel(ctx(t), l))
	l = acquire(t, s, lock.Request{Key: "pay", Fingerprint: "sha:aaa"}, lock.Acquired).Lease
	noErr(t, "Complete", s.Complete(ctx(t), l, []byte("done")))
	acquire(t, s, lock.Request{Key: "pay", Fingerprint: "sha:bbb"}, lock.Completed)
}

func testExtendBatch(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{LeaseTTL: 300 * time.Millisecond})
	var leases []lock.Lease
	for _, k := range []string{"a", "b", "c", "d"} {
		leases = append(leases, acquire(t, s, lock.Request{Key: k}, lock.Acquired).Lease)
	}
	noErr(t, "Complete b", s.Complete(ctx(t), leases[1], nil))
	bad := leases[3]
	bad.Fence = 0 // not a lease any store issued
	leases[3] = bad

	// Keep a and c alive past several TTLs with batched extends.
	for range 5 {
		time.Sleep(100 * time.Millisecond)
		errs := s.Extend(ctx(t), leases...)
		if len(errs) != 4 {
			t.Fatalf("Extend returned %d errors for 4 leases", len(errs))
		}
		noErr(t, "Extend a", errs[0])
		wantLost(t, "Extend b (completed)", errs[1])
		noErr(t, "Extend c", errs[2])
		if errs[3] == nil {
			t.Fatal("Extend of a forged lease: got nil error")
		}
	}
	acquire(t, s, lock.Request{Key: "a"}, lock.InProgress)
	acquire(t, s, lock.Request{Key: "c"}, lock.InProgress)
	if got := s.Extend(ctx(t)); len(got) != 0 {
		t.Fatalf("Extend of nothing: %v", got)
	}
}

func testRetention(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{Retention: 150 * time.Millisecond})
	l := acquire(t, s, lock.Request{Key: "short-lived"}, lock.Acquired).Lease
	noErr(t, "Complete", s.Complete(ctx(t), l, []byte("x")))
	acquire(t, s, lock.Request{Key: "short-lived"}, lock.Completed)
	time.Sleep(300 * time.Millisecond)
	fresh := acquire(t, s, lock.Request{Key: "short-lived"}, lock.Acquired)
	if fresh.Lease.Attempt != 1 {
		t.Fatalf("after retention: attempt %d, want a new record (1)", fresh.Lease.Attempt)
	}
}

// testFenceSurvivesLostRecord: a record lost (here: expired after its
// retention) and made again hands out fences above the lost one's, so a
// sink that keeps the highest fence still refuses the old holder.
func testFenceSurvivesLostRecord(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{Retention: 5 * time.Millisecond})
	var old lock.Lease
	for range 3 { // a few leases, so that the lost fence is not the first
		old = acquire(t, s, lock.Request{Key: "lost"}, lock.Acquired).Lease
		noErr(t, "Release", s.Release(ctx(t), old))
	}
	time.Sleep(50 * time.Millisecond) // the record expires
	fresh := acquire(t, s, lock.Request{Key: "lost"}, lock.Acquired).Lease
	if fresh.Attempt != 1 {
		t.Fatalf("the record did not expire: attempt %d", fresh.Attempt)
	}
	if fresh.Fence <= old.Fence {
		t.Fatalf("after a lost record: fence %d, not above the lost record's %d", fresh.Fence, old.Fence)
	}
}

// testSubMillisecondRetention: a retention the server would keep as 0 ms
// (no idempotency at all) is refused.
func testSubMillisecondRetention(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	_, err := s.Acquire(ctx(t), lock.Request{Key: "k", Retention: 500 * time.Microsecond})
	if !errors.Is(err, lock.ErrInvalidTTL) {
		t.Fatalf("Acquire with a 500µs retention: got %v, want ErrInvalidTTL", err)
	}
}

func testNamespaces(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	a := store(t, lock.Config{})
	b := store(t, lock.Config{})
	acquire(t, a, lock.Request{Key: "shared"}, lock.Acquired)
	acquire(t, b, lock.Request{Key: "shared"}, lock.Acquired)
}

func testBadInput(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{})
	errCases := []struct {
		name string
		req  lock.Request
		want error
	}{
		{"empty key", lock.Request{Key: ""}, lock.ErrInvalidKey},
		{"10 KB key", lock.Request{Key: strings.Repeat("k", 10<<10)}, lock.ErrInvalidKey},
		{"key one over the limit", lock.Request{Key: strings.Repeat("k", lock.MaxKeyLen+1)}, lock.ErrInvalidKey},
		{"negative TTL", lock.Request{Key: "k", TTL: -time.Second}, lock.ErrInvalidTTL},
		{"sub-millisecond TTL", lock.Request{Key: "k", TTL: time.Microsecond}, lock.ErrInvalidTTL},
		{"negative retention", lock.Request{Key: "k", Retention: -time.Second}, lock.ErrInvalidTTL},
		{"negative sub-millisecond retention", lock.Request{Key: "k", Retention: -500 * time.Microsecond}, lock.ErrInvalidTTL},
		{"negative sub-millisecond TTL", lock.Request{Key: "k", TTL: -500 * time.Microsecond}, lock.ErrInvalidTTL},
		{"long fingerprint", lock.Request{Key: "k", Fingerprint: strings.Repeat("f", 200)}, lock.ErrInvalidFingerprint},
	}
	for _, tc := range errCases {
		_, err := s.Acquire(ctx(t), tc.req)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}

	// Odd but valid keys are distinct records.
	odd := []string{
		"{order}", "}{", "{}", "{a}{b}", "\x00\xff\xfe binary \x01",
		strings.Repeat("k", lock.MaxKeyLen), "ключ", " ", "a\nb",
	}
	for _, k := range odd {
		acquire(t, s, lock.Request{Key: k}, lock.Acquired)
	}
	for _, k := range odd {
		acquire(t, s, lock.Request{Key: k}, lock.InProgress)
	}

	// Zero TTL and retention in a request mean the store's defaults.
	l := acquire(t, s, lock.Request{Key: "defaults"}, lock.Acquired).Lease
	if l.TTL != lock.DefaultLeaseTTL || l.Retention != lock.DefaultRetention {
		t.Fatalf("defaults: TTL %v retention %v", l.TTL, l.Retention)
	}

	// Leases no store issued are refused, never a panic.
	forged := []lock.Lease{
		{},
		{Key: "defaults", Owner: "someone", Fence: 1, TTL: time.Second},
		{Key: "defaults", Owner: l.Owner, Fence: l.Fence, TTL: 0},
		{Key: "defaults", Owner: l.Owner, Fence: l.Fence + 1, TTL: time.Second},
	}
	for i, f := range forged {
		if err := s.Complete(ctx(t), f, nil); err == nil {
			t.Errorf("forged lease %d: Complete succeeded", i)
		}
		if err := s.Extend(ctx(t), f)[0]; err == nil {
			t.Errorf("forged lease %d: Extend succeeded", i)
		}
	}
	acquire(t, s, lock.Request{Key: "defaults"}, lock.InProgress)
}

func testResultLimit(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{MaxResultSize: 1024})
	l := acquire(t, s, lock.Request{Key: "big"}, lock.Acquired).Lease
	err := s.Complete(ctx(t), l, make([]byte, 1025))
	if !errors.Is(err, lock.ErrResultTooLarge) {
		t.Fatalf("oversized result: got %v, want ErrResultTooLarge", err)
	}
	// Nothing changed: the lease is still held and can complete properly.
	acquire(t, s, lock.Request{Key: "big"}, lock.InProgress)
	noErr(t, "Complete at the limit", s.Complete(ctx(t), l, make([]byte, 1024)))
	if got := acquire(t, s, lock.Request{Key: "big"}, lock.Completed); len(got.Value) != 1024 {
		t.Fatalf("stored %d bytes, want 1024", len(got.Value))
	}
}
