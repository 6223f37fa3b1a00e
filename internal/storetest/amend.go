package storetest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

func amender(t *testing.T, s lock.Store) lock.Amender {
	t.Helper()
	a, ok := s.(lock.Amender)
	if !ok {
		t.Fatalf("%T does not implement lock.Amender", s)
	}
	return a
}

// complete makes key's record completed with value and returns the lease
// that completed it.
func complete(t *testing.T, s lock.Store, key string, value []byte) lock.Lease {
	t.Helper()
	l := acquire(t, s, lock.Request{Key: key}, lock.Acquired).Lease
	noErr(t, "Complete("+key+")", s.Complete(ctx(t), l, value))
	return l
}

func wantChanged(t *testing.T, op string, err error) {
	t.Helper()
	if !errors.Is(err, lock.ErrChanged) {
		t.Fatalf("%s: got %v, want ErrChanged", op, err)
	}
}

// wantValue fails unless key's record is completed, with fence, one
// attempt and value.
func wantValue(t *testing.T, s lock.Store, key string, fence int64, value string) {
	t.Helper()
	got := acquire(t, s, lock.Request{Key: key}, lock.Completed)
	if string(got.Value) != value || got.Fence != fence || got.Attempts != 1 {
		t.Fatalf("%s: value %q fence %d attempts %d, want %q, %d, 1", key, got.Value, got.Fence, got.Attempts, value, fence)
	}
}

// inspectExpiry inspects key and says when its record expires, as
// [earliest, latest]: ExpiresIn counted from before and after the call.
func inspectExpiry(t *testing.T, a lock.Admin, key string) (lock.Record, [2]time.Time) {
	t.Helper()
	start := time.Now()
	r := inspect(t, a, key)
	return r, [2]time.Time{start.Add(r.ExpiresIn), time.Now().Add(r.ExpiresIn)}
}

// sameButValue fails unless after is before but for the value, its
// expiry included: the two windows of expiry overlap, allowing for the
// store's rounding (Redis counts milliseconds).
func sameButValue(t *testing.T, before, after lock.Record, expBefore, expAfter [2]time.Time) {
	t.Helper()
	b, a := before, after
	b.Value, a.Value, b.ExpiresIn, a.ExpiresIn = nil, nil, 0, 0
	if b.Key != a.Key || b.State != a.State || b.Owner != a.Owner || b.Fence != a.Fence || b.Attempts != a.Attempts ||
		b.Fingerprint != a.Fingerprint || b.LeaseLeft != a.LeaseLeft || !b.Created.Equal(a.Created) ||
		!b.Ended.Equal(a.Ended) || b.Error != a.Error || b.Location != a.Location {
		t.Fatalf("Amend changed more than the value:\nbefore %+v\nafter  %+v", before, after)
	}
	const slack = 3 * time.Millisecond
	if expAfter[0].After(expBefore[1].Add(slack)) || expBefore[0].After(expAfter[1].Add(slack)) {
		t.Fatalf("Amend moved the expiry: from [%v, %v] to [%v, %v]",
			expBefore[0].Format(time.StampMicro), expBefore[1].Format(time.StampMicro),
			expAfter[0].Format(time.StampMicro), expAfter[1].Format(time.StampMicro))
	}
}

func testAmend(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{Retention: time.Hour})
	am, a := amender(t, s), admin(t, s)
	l := acquire(t, s, lock.Request{Key: "order-1", Fingerprint: "fp-1"}, lock.Acquired).Lease
	noErr(t, "Complete", s.Complete(ctx(t), l, []byte("staged 2")))
	// What a later delivery sees: the fence and the value to amend from.
	seen := acquire(t, s, lock.Request{Key: "order-1"}, lock.Completed)
	before, expBefore := inspectExpiry(t, a, "order-1")
	time.Sleep(250 * time.Millisecond) // an expiry set again by Amend would move by this much

	noErr(t, "Amend", am.Amend(ctx(t), "order-1", seen.Fence, seen.Value, []byte("staged 2, published 2")))
	after, expAfter := inspectExpiry(t, a, "order-1")
	sameButValue(t, before, after, expBefore, expAfter)
	if got, want := string(after.Value), "staged 2, published 2"; got != want {
		t.Fatalf("Inspect after Amend: value %q, want %q", got, want)
	}
	wantValue(t, s, "order-1", l.Fence, "staged 2, published 2")

	// A retry of the call that landed, or another writer of the same
	// bytes: nil, and nothing changes.
	noErr(t, "Amend retried", am.Amend(ctx(t), "order-1", seen.Fence, seen.Value, []byte("staged 2, published 2")))
	// Another writer that saw the old value, or a writer with another
	// fence: ErrChanged, and nothing changes.
	wantChanged(t, "Amend from a value replaced since", am.Amend(ctx(t), "order-1", seen.Fence, seen.Value, []byte("other")))
	wantChanged(t, "Amend with a lower fence", am.Amend(ctx(t), "order-1", seen.Fence-1, []byte("staged 2, published 2"), []byte("other")))
	err := am.Amend(ctx(t), "order-1", seen.Fence+1, []byte("staged 2, published 2"), []byte("other"))
	wantChanged(t, "Amend with a higher fence", err)
	if msg := err.Error(); !strings.Contains(msg, "order-1") || !strings.Contains(msg, strconv.FormatInt(seen.Fence+1, 10)) {
		t.Fatalf("ErrChanged %q does not name the key and the fence", msg)
	}
	wantValue(t, s, "order-1", l.Fence, "staged 2, published 2")

	// Amends chain, each from the value the last one wrote; an Amend to
	// the value already there changes nothing.
	noErr(t, "Amend to the same value", am.Amend(ctx(t), "order-1", seen.Fence, []byte("staged 2, published 2"), []byte("staged 2, published 2")))
	noErr(t, "Amend again", am.Amend(ctx(t), "order-1", seen.Fence, []byte("staged 2, published 2"), []byte("done")))
	wantValue(t, s, "order-1", l.Fence, "done")

	// nil and empty are the same, empty, value.
	noErr(t, "Amend to nil", am.Amend(ctx(t), "order-1", seen.Fence, []byte("done"), nil))
	wantValue(t, s, "order-1", l.Fence, "")
	noErr(t, "Amend from empty", am.Amend(ctx(t), "order-1", seen.Fence, []byte{}, []byte("x")))
	noErr(t, "Amend to empty", am.Amend(ctx(t), "order-1", seen.Fence, []byte("x"), []byte{}))
	// The store keeps its own copy of the bytes.
	last := []byte("last")
	noErr(t, "Amend from nil", am.Amend(ctx(t), "order-1", seen.Fence, nil, last))
	last[0] = 'X'
	wantValue(t, s, "order-1", l.Fence, "last")
	empty := complete(t, s, "order-2", nil)
	noErr(t, "Amend of a nil result", am.Amend(ctx(t), "order-2", empty.Fence, []byte{}, []byte("y")))
	wantValue(t, s, "order-2", empty.Fence, "y")

	// After all that, the record is the one completed but for the value.
	final, expFinal := inspectExpiry(t, a, "order-1")
	sameButValue(t, before, final, expBefore, expFinal)
}

func testAmendRefused(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{LeaseTTL: 10 * time.Second, Retention: time.Hour})
	am, a := amender(t, s), admin(t, s)
	v := []byte("amended")

	// No record: none is made.
	wantChanged(t, "Amend of an unknown key", am.Amend(ctx(t), "never-seen", time.Now().UnixMicro(), nil, v))
	if _, err := a.Inspect(ctx(t), "never-seen"); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Inspect after Amend of an unknown key: got %v, want ErrNotFound", err)
	}

	// In progress: the lease still completes, with its own result.
	l := acquire(t, s, lock.Request{Key: "running"}, lock.Acquired).Lease
	wantChanged(t, "Amend in progress", am.Amend(ctx(t), "running", l.Fence, nil, v))
	if r := inspect(t, a, "running"); r.State != lock.StateInProgress || !r.Live() || r.Fence != l.Fence {
		t.Fatalf("in progress after Amend: %+v", r)
	}
	noErr(t, "Complete after a refused Amend", s.Complete(ctx(t), l, []byte("result")))
	wantValue(t, s, "running", l.Fence, "result")

	// Failed, released, cancelled: not completed.
	l = acquire(t, s, lock.Request{Key: "failed"}, lock.Acquired).Lease
	noErr(t, "Fail", s.Fail(ctx(t), l, "boom"))
	wantChanged(t, "Amend of a failed record", am.Amend(ctx(t), "failed", l.Fence, []byte("boom"), v))
	wantChanged(t, "Amend of a failed record from nil", am.Amend(ctx(t), "failed", l.Fence, nil, v))
	if got := acquire(t, s, lock.Request{Key: "failed"}, lock.Failed); got.Error != "boom" {
		t.Fatalf("failed after Amend: %+v", got)
	}
	for _, state := range []lock.State{lock.StateReleased, lock.StateCancelled} {
		key := string(state)
		l = acquire(t, s, lock.Request{Key: key}, lock.Acquired).Lease
		if state == lock.StateReleased {
			noErr(t, "Release", s.Release(ctx(t), l))
		} else {
			noErr(t, "Cancel", s.Cancel(ctx(t), l))
		}
		wantChanged(t, "Amend of a "+key+" record", am.Amend(ctx(t), key, l.Fence, nil, v))
		if r := inspect(t, a, key); r.State != state || r.Fence != l.Fence || len(r.Value) != 0 {
			t.Fatalf("%s after Amend: %+v", key, r)
		}
	}

	// Forgotten, then made again: the old fence is refused, the new one
	// amends.
	old := complete(t, s, "again", []byte("r"))
	noErr(t, "Forget", a.Forget(ctx(t), "again", lock.StateCompleted, old.Fence))
	wantChanged(t, "Amend of a forgotten record", am.Amend(ctx(t), "again", old.Fence, []byte("r"), v))
	if _, err := a.Inspect(ctx(t), "again"); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Inspect after Amend of a forgotten record: got %v, want ErrNotFound", err)
	}
	cur := complete(t, s, "again", []byte("r"))
	if cur.Fence == old.Fence {
		t.Fatalf("the record made again has the forgotten one's fence %d", old.Fence)
	}
	wantChanged(t, "Amend with the forgotten record's fence", am.Amend(ctx(t), "again", old.Fence, []byte("r"), v))
	wantValue(t, s, "again", cur.Fence, "r")
	noErr(t, "Amend with the new fence", am.Amend(ctx(t), "again", cur.Fence, []byte("r"), v))
	wantValue(t, s, "again", cur.Fence, string(v))

	// Expired: refused, and no record is made again.
	brief := store(t, lock.Config{Retention: 50 * time.Millisecond})
	l = complete(t, brief, "brief", []byte("r"))
	time.Sleep(150 * time.Millisecond)
	wantChanged(t, "Amend of an expired record", amender(t, brief).Amend(ctx(t), "brief", l.Fence, []byte("r"), v))
	if got := acquire(t, brief, lock.Request{Key: "brief"}, lock.Acquired); got.Lease.Attempt != 1 {
		t.Fatalf("after Amend of an expired record: attempt %d, want a new record (1)", got.Lease.Attempt)
	}
}

func testAmendConcurrent(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{Retention: time.Hour})
	am := amender(t, s)
	const n = 50
	run := func(key string, fence int64, value func(i int) string) []error {
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make([]error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				errs[i] = am.Amend(context.Background(), key, fence, []byte("v0"), []byte(value(i)))
			}()
		}
		close(start)
		wg.Wait()
		return errs
	}

	// Different values from the same old one: one wins.
	l := complete(t, s, "hot", []byte("v0"))
	winner := -1
	for i, err := range run("hot", l.Fence, func(i int) string { return fmt.Sprint("v", i+1) }) {
		switch {
		case err == nil && winner >= 0:
			t.Fatalf("Amends %d and %d both answered nil", winner, i)
		case err == nil:
			winner = i
		case !errors.Is(err, lock.ErrChanged):
			t.Fatalf("Amend %d: got %v, want nil or ErrChanged", i, err)
		}
	}
	if winner < 0 {
		t.Fatalf("%d concurrent Amends: none answered nil", n)
	}
	wantValue(t, s, "hot", l.Fence, fmt.Sprint("v", winner+1))

	// The same value from many writers: every one has its outcome.
	l = complete(t, s, "same", []byte("v0"))
	for i, err := range run("same", l.Fence, func(int) string { return "v1" }) {
		noErr(t, fmt.Sprint("Amend ", i, " to the same value"), err)
	}
	wantValue(t, s, "same", l.Fence, "v1")
}

func testAmendExpiry(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	// The record expires where the completion put it, 400 ms after it
	// (by the store's clock, not later than completed below), and is
	// looked for 10 ms after that: an Amend 200 ms in that set an expiry
	// more than about 210 ms after itself (the retention again, say), or
	// none, would keep it.
	s := store(t, lock.Config{Retention: 400 * time.Millisecond})
	l := complete(t, s, "brief", []byte("v0"))
	completed := time.Now()
	time.Sleep(200 * time.Millisecond)
	noErr(t, "Amend", amender(t, s).Amend(ctx(t), "brief", l.Fence, []byte("v0"), []byte("v1")))
	wantValue(t, s, "brief", l.Fence, "v1")
	time.Sleep(time.Until(completed.Add(410 * time.Millisecond)))
	if got := acquire(t, s, lock.Request{Key: "brief"}, lock.Acquired); got.Lease.Attempt != 1 {
		t.Fatalf("after the completion's retention: attempt %d, want a new record (1)", got.Lease.Attempt)
	}
}

func testAmendBadInput(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{MaxResultSize: 1024})
	am := amender(t, s)
	l := complete(t, s, "big", []byte("v0"))
	err := am.Amend(ctx(t), "big", l.Fence, []byte("v0"), make([]byte, 1025))
	if !errors.Is(err, lock.ErrResultTooLarge) {
		t.Fatalf("Amend to 1025 bytes: got %v, want ErrResultTooLarge", err)
	}
	wantValue(t, s, "big", l.Fence, "v0")
	// Refused before the record is looked at.
	if err := am.Amend(ctx(t), "absent", 1, nil, make([]byte, 1025)); !errors.Is(err, lock.ErrResultTooLarge) {
		t.Fatalf("Amend of an unknown key to 1025 bytes: got %v, want ErrResultTooLarge", err)
	}
	noErr(t, "Amend to 1024 bytes", am.Amend(ctx(t), "big", l.Fence, []byte("v0"), make([]byte, 1024)))
	if got := acquire(t, s, lock.Request{Key: "big"}, lock.Completed); len(got.Value) != 1024 {
		t.Fatalf("stored %d bytes, want 1024", len(got.Value))
	}

	for _, key := range []string{"", strings.Repeat("k", lock.MaxKeyLen+1)} {
		if err := am.Amend(ctx(t), key, l.Fence, nil, nil); !errors.Is(err, lock.ErrInvalidKey) {
			t.Errorf("Amend of a %d-byte key: got %v, want ErrInvalidKey", len(key), err)
		}
	}
	// Odd but valid keys are records like any other.
	for _, key := range []string{"{order}\x00\xff", strings.Repeat("k", lock.MaxKeyLen)} {
		l := complete(t, s, key, []byte("\x00\xff"))
		noErr(t, "Amend of an odd key", am.Amend(ctx(t), key, l.Fence, []byte("\x00\xff"), []byte("\xff\x00")))
		wantValue(t, s, key, l.Fence, "\xff\x00")
	}
}
