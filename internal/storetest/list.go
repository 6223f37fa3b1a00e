package storetest

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// listAll pages through l with req until the listing ends, checking that
// no call reads more than about req.Scan records, and returns how many
// times each key was listed, with its record.
func listAll(t *testing.T, l lock.Lister, req lock.ListRequest) (map[string]int, map[string]lock.Record) {
	t.Helper()
	seen, recs := map[string]int{}, map[string]lock.Record{}
	for pages := 0; ; pages++ {
		if pages > 100000 {
			t.Fatalf("List(%+v): no end after %d pages", req, pages)
		}
		p, err := l.List(ctx(t), req)
		if err != nil {
			t.Fatalf("List(%+v): %v", req, err)
		}
		// A RedisStore's bound is SCAN's COUNT, which a bucket of
		// several keys can pass by a few.
		if p.Scanned > 2*req.Scan || len(p.Records) > p.Scanned {
			t.Fatalf("List: scanned %d, returned %d, for Scan %d: the bound did not hold", p.Scanned, len(p.Records), req.Scan)
		}
		for _, r := range p.Records {
			seen[r.Key]++
			recs[r.Key] = r
		}
		if p.Next == "" {
			return seen, recs
		}
		req.Cursor = p.Next
	}
}

func testList(t *testing.T, store func(*testing.T, lock.Config) lock.Store) {
	s := store(t, lock.Config{LeaseTTL: time.Minute, Retention: time.Hour})
	l, ok := s.(lock.Lister)
	if !ok {
		t.Skipf("%T does not implement lock.Lister", s)
	}
	if _, err := l.List(ctx(t), lock.ListRequest{Scan: 1}); errors.Is(err, lock.ErrListUnsupported) {
		t.Skipf("List: %v", err)
	}
	// Endpoint a: 12 completed, 9 failed, 6 in progress, 3 released;
	// endpoint b (a prefix of a's keys without the separator), 5
	// completed.
	want := map[string]lock.State{}
	mk := func(key string, st lock.State) {
		res := acquire(t, s, lock.Request{Key: key}, lock.Acquired)
		switch st {
		case lock.StateCompleted:
			noErr(t, "Complete", s.Complete(ctx(t), res.Lease, []byte("result of "+key)))
		case lock.StateFailed:
			noErr(t, "Fail", s.Fail(ctx(t), res.Lease, "failed: "+key))
		case lock.StateReleased:
			noErr(t, "Release", s.Release(ctx(t), res.Lease))
		}
		want[key] = st
	}
	for i := range 30 {
		st := lock.StateCompleted
		switch {
		case i >= 27:
			st = lock.StateReleased
		case i >= 21:
			st = lock.StateInProgress
		case i >= 12:
			st = lock.StateFailed
		}
		mk(fmt.Sprintf("a\x00k-%02d", i), st)
	}
	for i := range 5 {
		mk(fmt.Sprintf("a-b\x00k-%02d", i), lock.StateCompleted)
	}

	for _, tc := range []struct {
		state lock.State
		scan  int
	}{{"", 4}, {lock.StateFailed, 4}, {lock.StateInProgress, 7}, {lock.StateCompleted, 1000}} {
		seen, recs := listAll(t, l, lock.ListRequest{Prefix: "a\x00", State: tc.state, Scan: tc.scan})
		n := 0
		for k, st := range want {
			if k[:2] != "a\x00" || (tc.state != "" && st != tc.state) {
				if seen[k] != 0 {
					t.Fatalf("state %q: listed %q (%s) %d times, want none", tc.state, k, st, seen[k])
				}
				continue
			}
			n++
			if got, want := seen[k], 1; got != want {
				t.Fatalf("state %q: listed %q %d times, want %d", tc.state, k, got, want)
			}
			r := recs[k]
			if r.State != st || r.Attempts != 1 || r.Fence == 0 || r.Location == "" || r.Value != nil || r.ExpiresIn <= 0 {
				t.Fatalf("state %q: record %+v, want %s, attempt 1, a fence, a location, an expiry, no value", tc.state, r, st)
			}
			if st == lock.StateFailed && r.Error != "failed: "+k {
				t.Fatalf("failed record's error %q, want %q", r.Error, "failed: "+k)
			}
			if st == lock.StateInProgress && (!r.Live() || r.LeaseLeft > time.Minute) {
				t.Fatalf("in progress record: lease left %v, want live, at most a minute", r.LeaseLeft)
			}
		}
		if len(seen) != n {
			t.Fatalf("state %q: listed %d keys, want %d", tc.state, len(seen), n)
		}
	}
	// Forgotten records are not listed.
	f := inspect(t, admin(t, s), "a\x00k-12")
	noErr(t, "Forget", admin(t, s).Forget(ctx(t), "a\x00k-12", lock.StateFailed, f.Fence))
	if seen, _ := listAll(t, l, lock.ListRequest{Prefix: "a\x00", State: lock.StateFailed, Scan: 50}); len(seen) != 8 || seen["a\x00k-12"] != 0 {
		t.Fatalf("after Forget: listed %d failed keys (the forgotten one %d times), want 8 and 0", len(seen), seen["a\x00k-12"])
	}
	// Values: a completed record's result, with it only.
	_, withValues := listAll(t, l, lock.ListRequest{Prefix: "a\x00", State: lock.StateCompleted, Values: true, Scan: 1000})
	if got, want := string(withValues["a\x00k-03"].Value), "result of a\x00k-03"; got != want || len(withValues) != 12 {
		t.Fatalf("Values: %d completed records, k-03's value %q, want 12 and %q", len(withValues), got, want)
	}
	for _, bad := range []lock.ListRequest{{State: "done"}, {Scan: -1}, {Scan: lock.MaxListScan + 1}} {
		if _, err := l.List(ctx(t), bad); err == nil {
			t.Fatalf("List(%+v): no error", bad)
		}
	}
}
