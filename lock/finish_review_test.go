package lock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// The fast completion of a natively made record is judged on owner and
// fence like every other: after the lease expired and another owner took
// the key, after a release and a new Acquire, after a cancel, the old
// lease's Complete is refused and leaves the record as it is; after an
// extend, and when sent twice, it completes once with one attempt.
func TestRedisFastFinishInterleavings(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	acquire := func(key string, ttl time.Duration) lock.Result {
		t.Helper()
		res, err := s.Acquire(ctx, lock.Request{Key: key, TTL: ttl, Retention: time.Hour, Fingerprint: "fp"})
		if err != nil {
			t.Fatalf("Acquire %q: %v", key, err)
		}
		return res
	}
	lost := func(what string, err error, key string, before string) {
		t.Helper()
		if !errors.Is(err, lock.ErrLeaseLost) {
			t.Errorf("%s: %v, want ErrLeaseLost", what, err)
		}
		if got := client.Get(ctx, lock.RecordKey(prefix, key)).Val(); got != before {
			t.Errorf("%s changed the record:\n%x\nwas\n%x", what, got, before)
		}
	}

	// Expired and taken over by another owner.
	a := acquire("expired", 20*time.Millisecond)
	if !lock.Made(a.Lease) {
		t.Fatalf("not a natively made lease: %+v", a)
	}
	time.Sleep(40 * time.Millisecond)
	b := acquire("expired", time.Second)
	if b.Status != lock.Acquired {
		t.Fatalf("take over: %+v", b)
	}
	raw := client.Get(ctx, lock.RecordKey(prefix, "expired")).Val()
	lost("Complete after a take-over", s.Complete(ctx, a.Lease, []byte("old")), "expired", raw)
	lost("Release after a take-over", s.Release(ctx, a.Lease), "expired", raw)
	if err := s.Complete(ctx, b.Lease, []byte("new")); err != nil {
		t.Fatalf("the new owner's Complete: %v", err)
	}

	// Released, then acquired again (attempt 2, another owner).
	a = acquire("released", time.Second)
	if err := s.Release(ctx, a.Lease); err != nil {
		t.Fatal(err)
	}
	b = acquire("released", time.Second)
	if b.Status != lock.Acquired || b.Attempts != 2 {
		t.Fatalf("after a release: %+v", b)
	}
	raw = client.Get(ctx, lock.RecordKey(prefix, "released")).Val()
	lost("Complete after release and re-acquire", s.Complete(ctx, a.Lease, []byte("old")), "released", raw)

	// Cancelled, then completed by the same lease.
	a = acquire("cancelled", time.Second)
	if err := s.Cancel(ctx, a.Lease); err != nil {
		t.Fatal(err)
	}
	raw = client.Get(ctx, lock.RecordKey(prefix, "cancelled")).Val()
	lost("Complete after Cancel", s.Complete(ctx, a.Lease, []byte("old")), "cancelled", raw)
	rec, err := s.Inspect(ctx, "cancelled")
	if err != nil || rec.Attempts != 0 {
		t.Errorf("cancelled record: %+v %v, want 0 attempts", rec, err)
	}

	// Extended, then completed twice.
	a = acquire("extended", time.Second)
	if errs := s.Extend(ctx, a.Lease); errs[0] != nil {
		t.Fatal(errs[0])
	}
	for i := 0; i < 2; i++ {
		if err := s.Complete(ctx, a.Lease, []byte("v")); err != nil {
			t.Fatalf("Complete %d after Extend: %v", i, err)
		}
	}
	rec, err = s.Inspect(ctx, "extended")
	if err != nil || rec.State != lock.StateCompleted || rec.Attempts != 1 || rec.Fence != a.Fence || string(rec.Value) != "v" {
		t.Errorf("extended record: %+v %v", rec, err)
	}

	// Completed twice without an extend (the fast path, then its retry).
	a = acquire("twice", time.Second)
	for i := 0; i < 2; i++ {
		if err := s.Complete(ctx, a.Lease, []byte("v")); err != nil {
			t.Fatalf("Complete %d: %v", i, err)
		}
	}
	raw = client.Get(ctx, lock.RecordKey(prefix, "twice")).Val()
	lost("Fail after Complete", s.Fail(ctx, a.Lease, "no"), "twice", raw)
	rec, err = s.Inspect(ctx, "twice")
	if err != nil || rec.State != lock.StateCompleted || rec.Attempts != 1 || rec.Fence != a.Fence || string(rec.Value) != "v" {
		t.Errorf("record completed twice: %+v %v", rec, err)
	}
}

// A lease is compare-and-set on owner AND fence: a lease whose Fence is
// not the record's is refused, whichever way its record was made. The
// fast completion of a natively made record checks the bytes the Acquire
// wrote (which hold no fence) and the key's expiry, from which only
// Fence/1000 is derived: a Fence off by less than 1000 µs passes both
// checks, and the record is written with that wrong fence.
func TestRedisFastFinishChecksTheFence(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	for _, native := range []bool{false, true} {
		key := "decoded"
		if native {
			key = "made"
		}
		res, err := s.Acquire(ctx, lock.Request{Key: key, TTL: 5 * time.Second, Retention: time.Hour})
		if err != nil || res.Status != lock.Acquired || !lock.Made(res.Lease) {
			t.Fatalf("Acquire: %+v %v", res, err)
		}
		l := res.Lease
		if !native {
			l = lock.Decoded(l)
		}
		l.Fence++ // not the record's fence
		raw := client.Get(ctx, lock.RecordKey(prefix, key)).Val()
		if err := s.Complete(ctx, l, []byte("r")); !errors.Is(err, lock.ErrLeaseLost) {
			rec, _ := s.Inspect(ctx, key)
			t.Errorf("Complete with fence %d of a record of fence %d (fast path %v): %v, want ErrLeaseLost; the record now says fence %d, state %v",
				l.Fence, res.Fence, native, err, rec.Fence, rec.State)
			continue
		}
		if got := client.Get(ctx, lock.RecordKey(prefix, key)).Val(); got != raw {
			t.Errorf("refused Complete changed the record")
		}
	}
}
