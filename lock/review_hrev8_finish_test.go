package lock

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// Review h-rev8: finish.lua's SET ... GET swap, gated on PEXPIRETIME, must
// answer and leave the key exactly as the decoding path does, on every
// branch. For each state a made lease is ended with ('c', 'f', 'r', 'x')
// and each thing that can have happened to its record, the key is set up,
// snapshotted (DUMP, with its expiry), ended through the swap path (the
// lease as the native Acquire made it), put back from the snapshot, and
// ended again through the decoding path (Decoded: the same lease without
// the made record). The two answers must be of the same kind and the two
// keys the same: type, bytes (the ended time aside) and expiry (within a
// second: the outcome's PX is counted from each call's clock).
func TestReviewHrev8FinishSwapMatchesDecoding(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	// The store may learn the server's version on its first call.
	_, _ = s.Acquire(ctx, Request{Key: "probe", TTL: time.Second, Retention: time.Second})
	const ttl, retention = 3 * time.Second, 70 * time.Second
	keep := (ttl + retention).Milliseconds()
	// record is a format 1 record of key in state with owner and fence.
	record := func(state, owner string, fence int64, key string) []byte {
		b := appendHead(nil, state, owner, fence, 1, "", key, fence/1000-1)
		b = appendInt(b, 0)
		return appendStr(b, "")
	}
	scenarios := []struct {
		name  string
		setup func(t *testing.T, l Lease, exp int64)
	}{
		{"untouched", func(*testing.T, Lease, int64) {}},
		{"key missing", func(_ *testing.T, l Lease, _ int64) { client.Del(ctx, l.rkey) }},
		{"another owner, same expiry", func(_ *testing.T, l Lease, exp int64) {
			client.Set(ctx, l.rkey, record("p", "another owner's token, 32 bytes!", l.Fence+5, l.Key), 0)
			client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp))
		}},
		{"another owner, other expiry", func(_ *testing.T, l Lease, exp int64) {
			client.Set(ctx, l.rkey, record("p", "another owner's token, 32 bytes!", l.Fence+5, l.Key), 0)
			client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp+1))
		}},
		{"same owner, other fence, same expiry", func(_ *testing.T, l Lease, exp int64) {
			client.Set(ctx, l.rkey, record("p", l.Owner, l.Fence+1, l.Key), 0)
			client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp))
		}},
		{"same lease as format 1, same expiry", func(_ *testing.T, l Lease, exp int64) {
			client.Set(ctx, l.rkey, record("p", l.Owner, l.Fence, l.Key), 0)
			client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp))
		}},
		{"extended", func(t *testing.T, l Lease, exp int64) {
			if errs := s.Extend(ctx, l); errs[0] != nil {
				t.Fatal(errs[0])
			}
		}},
		{"made record without an expiry", func(_ *testing.T, l Lease, _ int64) { client.Persist(ctx, l.rkey) }},
		{"already completed by this lease", func(t *testing.T, l Lease, _ int64) {
			if err := s.Complete(ctx, Decoded(l), []byte("v")); err != nil {
				t.Fatal(err)
			}
		}},
		{"already released by this lease", func(t *testing.T, l Lease, _ int64) {
			if err := s.Release(ctx, Decoded(l)); err != nil {
				t.Fatal(err)
			}
		}},
		{"a hash, same expiry", func(_ *testing.T, l Lease, exp int64) {
			client.Del(ctx, l.rkey)
			client.HSet(ctx, l.rkey, "state", "p")
			client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp))
		}},
		{"garbage, same expiry", func(_ *testing.T, l Lease, exp int64) {
			client.Set(ctx, l.rkey, "\x07not a record", 0)
			client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp))
		}},
	}
	ops := []struct {
		state string
		end   func(Lease) error
	}{
		{"c", func(l Lease) error { return s.Complete(ctx, l, []byte("result")) }},
		{"f", func(l Lease) error { return s.Fail(ctx, l, "reason") }},
		{"r", func(l Lease) error { return s.Release(ctx, l) }},
		{"x", func(l Lease) error { return s.Cancel(ctx, l) }},
	}
	// kind names the class of an answer.
	kind := func(err error) string {
		switch {
		case err == nil:
			return "nil"
		case errors.Is(err, ErrLeaseLost):
			return "lease lost"
		case errors.Is(err, ErrBadRecord):
			return "bad record"
		}
		return "other: " + err.Error()
	}
	type state struct {
		typ string
		raw []byte
		exp int64 // PEXPIRETIME: -1 none, -2 no key
	}
	look := func(key string) state {
		st := state{typ: client.Type(ctx, key).Val(), exp: client.Do(ctx, "PEXPIRETIME", key).Val().(int64)}
		if st.typ == "string" {
			st.raw, _ = client.Get(ctx, key).Bytes()
		}
		return st
	}
	for _, sc := range scenarios {
		for _, op := range ops {
			t.Run(sc.name+"/"+op.state, func(t *testing.T) {
				key := fmt.Sprintf("%s-%s", sc.name, op.state)
				res, err := s.Acquire(ctx, Request{Key: key, Fingerprint: "fp", TTL: ttl, Retention: retention})
				if err != nil || res.Status != Acquired || !res.Lease.made {
					t.Skipf("Acquire: %+v %v: no lease the native Acquire made (Redis before 7.0?)", res, err)
				}
				l := res.Lease
				exp := client.Do(ctx, "PEXPIRETIME", l.rkey).Val().(int64)
				if exp != l.Fence/1000-1+keep {
					t.Fatalf("made record expires at %d, want %d", exp, l.Fence/1000-1+keep)
				}
				sc.setup(t, l, exp)
				before := look(l.rkey)
				dump, derr := client.Dump(ctx, l.rkey).Result()
				if derr != nil && !errors.Is(derr, redis.Nil) {
					t.Fatal(derr)
				}
				restore := func() {
					client.Del(ctx, l.rkey)
					if derr == nil {
						args := []any{"RESTORE", l.rkey, 0, dump, "REPLACE"}
						if before.exp > 0 {
							args = []any{"RESTORE", l.rkey, before.exp, dump, "REPLACE", "ABSTTL"}
						}
						if err := client.Do(ctx, args...).Err(); err != nil {
							t.Fatal(err)
						}
					}
					if got := look(l.rkey); got.typ != before.typ || !bytes.Equal(got.raw, before.raw) || got.exp != before.exp {
						t.Fatalf("restored %+v, want %+v", got, before)
					}
				}

				swapErr := op.end(l)
				swapped := look(l.rkey)
				restore()
				decErr := op.end(Decoded(l))
				decoded := look(l.rkey)

				if kind(swapErr) != kind(decErr) {
					t.Errorf("answer through the swap: %v; through decoding: %v", swapErr, decErr)
				}
				if swapped.typ != decoded.typ {
					t.Fatalf("key after the swap is a %q, after decoding a %q", swapped.typ, decoded.typ)
				}
				if !sameButEnded(swapped.raw, decoded.raw) {
					t.Errorf("record after the swap:\n%x\nafter decoding:\n%x\nbefore:\n%x", swapped.raw, decoded.raw, before.raw)
				}
				if d := swapped.exp - decoded.exp; (swapped.exp < 0 || decoded.exp < 0) && d != 0 || d < -1000 || d > 1000 {
					t.Errorf("expiry after the swap %d, after decoding %d (before %d)", swapped.exp, decoded.exp, before.exp)
				}
			})
		}
	}
}

// sameButEnded reports whether two records are the same bytes but for
// the ended time, a uint64 (0xcf and 8 bytes) where they first differ.
func sameButEnded(a, b []byte) bool {
	if bytes.Equal(a, b) {
		return true
	}
	if len(a) != len(b) {
		return false
	}
	i := 0
	for i < len(a) && a[i] == b[i] {
		i++
	}
	// The first difference is inside the ended field: find its 0xcf.
	for at := max(0, i-8); at <= i && at+9 <= len(a); at++ {
		if a[at] == 0xcf && b[at] == 0xcf && bytes.Equal(a[:at], b[:at]) && bytes.Equal(a[at+9:], b[at+9:]) {
			return true
		}
	}
	return false
}
