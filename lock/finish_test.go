package lock_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// prevFinish is the finish script of the version before outcomes were
// written without decoding the record (testdata/prev: record.lua and
// finish.lua as they were, byte for byte): a consumer of that version
// running beside this one during a rolling upgrade.
func prevFinish(t *testing.T) *redis.Script {
	t.Helper()
	var src []byte
	for _, f := range []string{"testdata/prev/record.lua", "testdata/prev/finish.lua"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src = append(src, b...)
	}
	return redis.NewScript(string(src))
}

// runPrev runs the previous version's finish script on one record, as an
// old consumer's Complete (state 'c'), Fail ('f'), Release ('r') or Cancel
// ('x') sends it, and returns its answer for that key.
func runPrev(t *testing.T, client redis.UniversalClient, rkey, owner string, fence int64, state, value string, retention time.Duration) int64 {
	t.Helper()
	reply, err := prevFinish(t).Run(context.Background(), client, []string{rkey}, owner, fence, state, value, retention.Milliseconds()).Slice()
	if err != nil || len(reply) != 1 {
		t.Fatalf("previous finish.lua: %v %v", reply, err)
	}
	n, ok := reply[0].(int64)
	if !ok {
		t.Fatalf("previous finish.lua: reply %v", reply)
	}
	return n
}

// format2 is a record exactly as the native Acquire writes it (and wrote
// it before outcomes were written without decoding): key, a 32-byte owner,
// no fingerprint, with ttl and keep (TTL + retention) in ms below 65,536.
func format2(owner, key string, ttl, keep int64) []byte {
	b := append([]byte{0x02, 0xa1, 'p', 0xd9, 0x20}, owner...)
	b = append(b, 0x00, 0xcd, byte(ttl>>8), byte(ttl), 0x01, 0xa0, 0xa0|byte(len(key)))
	b = append(b, key...)
	return append(b, 0xcd, byte(keep>>8), byte(keep), 0x00, 0xa0)
}

// The outcome of a lease whose record the native Acquire made is written
// without decoding the record (finish.lua): the record it writes is, byte
// for byte, the one the previous version's finish script writes for the
// same record (the time it ended aside), with the same expiry; a consumer
// of either version reads it.
func TestRedisFinishWithoutDecoding(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	for _, op := range []struct {
		state, value string
		finish       func(lock.Lease) error
	}{
		{"c", "result", func(l lock.Lease) error { return s.Complete(ctx, l, []byte("result")) }},
		{"f", "reason", func(l lock.Lease) error { return s.Fail(ctx, l, "reason") }},
		{"r", "", func(l lock.Lease) error { return s.Release(ctx, l) }},
		{"x", "", func(l lock.Lease) error { return s.Cancel(ctx, l) }},
	} {
		for _, long := range []bool{false, true} {
			name := op.state
			key, fp := "k-"+op.state, "fp-"+op.state
			if long {
				// Strings of more than 255 bytes: str16, the longest
				// form a key or a fingerprint takes.
				name += "-long"
				key = op.state + strings.Repeat("k", lock.MaxKeyLen-1)
				fp = strings.Repeat("f", lock.MaxFingerprintLen)
			}
			t.Run(name, func(t *testing.T) {
				req := lock.Request{Key: key, Fingerprint: fp, TTL: 5 * time.Second, Retention: time.Hour}
				res, err := s.Acquire(ctx, req)
				if err != nil || res.Status != lock.Acquired || !lock.Made(res.Lease) {
					t.Fatalf("Acquire: %+v %v, want a lease on a record the native Acquire made", res, err)
				}
				// The same record under another key, for the previous
				// version's script.
				rkey, twin := lock.RecordKey(prefix, key), lock.RecordKey(prefix, key)+":twin"
				raw := client.Get(ctx, rkey).Val()
				exp := client.PExpireTime(ctx, rkey).Val()
				if err := client.Set(ctx, twin, raw, 0).Err(); err != nil {
					t.Fatal(err)
				}
				if err := client.PExpireAt(ctx, twin, time.UnixMilli(exp.Milliseconds())).Err(); err != nil {
					t.Fatal(err)
				}

				if err := op.finish(res.Lease); err != nil {
					t.Fatal(err)
				}
				if n := runPrev(t, client, twin, res.Lease.Owner, res.Lease.Fence, op.state, op.value, req.Retention); n != 1 {
					t.Fatalf("previous finish.lua on the twin: %d", n)
				}
				got, want := []byte(client.Get(ctx, rkey).Val()), []byte(client.Get(ctx, twin).Val())
				// Both end with ended (ms, a uint64: 0xcf and 8 bytes) and
				// the value (a fixstr).
				at := len(want) - 1 - len(op.value) - 9
				if len(got) != len(want) || at < 0 || want[at] != 0xcf || got[at] != 0xcf ||
					!bytes.Equal(got[:at], want[:at]) || !bytes.Equal(got[at+9:], want[at+9:]) {
					t.Fatalf("record written without decoding:\n%x\nwant, as the previous version writes it (ended aside):\n%x", got, want)
				}
				if d := client.PTTL(ctx, rkey).Val() - client.PTTL(ctx, twin).Val(); d < -time.Second || d > time.Second {
					t.Fatalf("expiry %v apart from the previous version's", d)
				}
				// A retry of the same call finds its own write.
				if err := op.finish(res.Lease); err != nil {
					t.Fatalf("retried: %v", err)
				}
				// The previous version's script takes it as its own
				// write too, and refuses another owner.
				if n := runPrev(t, client, rkey, res.Lease.Owner, res.Lease.Fence, op.state, op.value, req.Retention); n != 1 {
					t.Fatalf("previous finish.lua, retried on the new record: %d", n)
				}
				if n := runPrev(t, client, rkey, "someone-else", res.Lease.Fence, "c", "x", req.Retention); n != 0 {
					t.Fatalf("previous finish.lua of another owner on the new record: %d", n)
				}
				again, err := s.Acquire(ctx, req)
				switch op.state {
				case "c":
					if err != nil || again.Status != lock.Completed || string(again.Value) != "result" || again.Fence != res.Lease.Fence {
						t.Fatalf("Acquire after Complete: %+v %v", again, err)
					}
				case "f":
					if err != nil || again.Status != lock.Failed || again.Error != "reason" {
						t.Fatalf("Acquire after Fail: %+v %v", again, err)
					}
				case "r":
					if err != nil || again.Status != lock.Acquired || again.Attempts != 2 || again.Lease.Fence <= res.Lease.Fence {
						t.Fatalf("Acquire after Release: %+v %v", again, err)
					}
				case "x":
					if err != nil || again.Status != lock.Acquired || again.Attempts != 1 || again.Lease.Fence <= res.Lease.Fence {
						t.Fatalf("Acquire after Cancel: %+v %v", again, err)
					}
				}
			})
		}
	}
}

// A record with the bytes a lease's native Acquire wrote but another
// expiry is not that lease's record: it was made again at another time
// (the same Acquire's write sent twice, the first record gone between),
// and its fence follows from its expiry. The outcome is not written
// without decoding it, and the decoded fence refuses the lease.
func TestRedisFinishChecksTheExpiry(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	res, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: 5 * time.Second, Retention: time.Hour})
	if err != nil || res.Status != lock.Acquired || !lock.Made(res.Lease) {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	rkey := lock.RecordKey(prefix, "k")
	exp := client.PExpireTime(ctx, rkey).Val()
	if err := client.PExpireAt(ctx, rkey, time.UnixMilli(exp.Milliseconds()+7)).Err(); err != nil {
		t.Fatal(err)
	}
	raw := client.Get(ctx, rkey).Val()
	if err := s.Complete(ctx, res.Lease, []byte("r")); !errors.Is(err, lock.ErrLeaseLost) {
		t.Fatalf("Complete of a record made at another ms: %v, want ErrLeaseLost", err)
	}
	if got := client.Get(ctx, rkey).Val(); got != raw {
		t.Fatalf("record changed:\n%x\nwas\n%x", got, raw)
	}
}

// A rolling upgrade: consumers of the previous version and of this one on
// the same Redis. The record format is the same (this version writes no
// new one: format 2 by the native Acquire, format 1 by every script, the
// fast completion included), so each reads, completes, takes over and
// answers as a duplicate the other's records, with the leases judged on
// owner and fence.
func TestRedisRollingUpgrade(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	const oldOwner = "0123456789abcdef0123456789abcdef"
	const ttl, keep = 30_000, 30_000 + 30_000
	retention := time.Duration(keep-ttl) * time.Millisecond

	// An old consumer's record, its lease live: in progress for the new
	// one; the old consumer completes it; the new one then answers it
	// as a duplicate.
	rkey := lock.RecordKey(prefix, "a")
	if err := client.Set(ctx, rkey, format2(oldOwner, "a", ttl, keep), keep*time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	fence := (client.PExpireTime(ctx, rkey).Val().Milliseconds() - keep + 1) * 1000
	res, err := s.Acquire(ctx, lock.Request{Key: "a", TTL: time.Second, Retention: retention})
	if err != nil || res.Status != lock.InProgress || res.Fence != fence {
		t.Fatalf("Acquire of an old consumer's live record: %+v %v, want in progress, fence %d", res, err, fence)
	}
	if n := runPrev(t, client, rkey, oldOwner, fence, "c", "old-result", retention); n != 1 {
		t.Fatalf("old consumer's Complete: %d", n)
	}
	res, err = s.Acquire(ctx, lock.Request{Key: "a", TTL: time.Second, Retention: retention})
	if err != nil || res.Status != lock.Completed || string(res.Value) != "old-result" || res.Fence != fence {
		t.Fatalf("Acquire of an old consumer's completed record: %+v %v", res, err)
	}

	// An old consumer's record whose lease expired: the new consumer
	// takes it over with a higher fence; the old consumer's late Complete
	// is refused, the new one's goes through.
	rkey = lock.RecordKey(prefix, "b")
	const shortTTL = 30
	if err := client.Set(ctx, rkey, format2(oldOwner, "b", shortTTL, shortTTL+30_000), (shortTTL+30_000)*time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	fence = (client.PExpireTime(ctx, rkey).Val().Milliseconds() - (shortTTL + 30_000) + 1) * 1000
	time.Sleep(3 * shortTTL * time.Millisecond)
	res, err = s.Acquire(ctx, lock.Request{Key: "b", TTL: 10 * time.Second, Retention: retention})
	if err != nil || res.Status != lock.Acquired || res.Attempts != 2 || res.Lease.Fence <= fence {
		t.Fatalf("takeover of an old consumer's expired lease: %+v %v, want attempt 2 above fence %d", res, err, fence)
	}
	if n := runPrev(t, client, rkey, oldOwner, fence, "c", "late", retention); n != 0 {
		t.Fatalf("old consumer's late Complete after the takeover: %d, want 0", n)
	}
	if err := s.Complete(ctx, res.Lease, []byte("new-result")); err != nil {
		t.Fatal(err)
	}
	res, err = s.Acquire(ctx, lock.Request{Key: "b", TTL: time.Second, Retention: retention})
	if err != nil || res.Status != lock.Completed || string(res.Value) != "new-result" {
		t.Fatalf("duplicate after the takeover: %+v %v", res, err)
	}

	// A new consumer's lease, completed without decoding, next to an old
	// consumer: its Complete with another owner, or a stale fence, is
	// refused before and after.
	res, err = s.Acquire(ctx, lock.Request{Key: "c", TTL: 10 * time.Second, Retention: retention})
	if err != nil || res.Status != lock.Acquired || !lock.Made(res.Lease) {
		t.Fatalf("Acquire: %+v %v", res, err)
	}
	rkey = lock.RecordKey(prefix, "c")
	if n := runPrev(t, client, rkey, oldOwner, res.Lease.Fence, "c", "x", retention); n != 0 {
		t.Fatalf("old consumer's Complete of a new consumer's lease: %d, want 0", n)
	}
	if n := runPrev(t, client, rkey, res.Lease.Owner, res.Lease.Fence-1, "c", "x", retention); n != 0 {
		t.Fatalf("a stale fence through the previous script: %d, want 0", n)
	}
	if err := s.Complete(ctx, res.Lease, []byte("c-result")); err != nil {
		t.Fatal(err)
	}
	if n := runPrev(t, client, rkey, oldOwner, res.Lease.Fence, "c", "x", retention); n != 0 {
		t.Fatalf("old consumer's Complete of a completed record: %d, want 0", n)
	}
	// The old consumer's duplicate check reads the record as this
	// version wrote it: the acquire script and the native Acquire are
	// the previous version's, unchanged; their answer here is its answer.
	lock.DisableNative(s)
	res, err = s.Acquire(ctx, lock.Request{Key: "c", TTL: time.Second, Retention: retention})
	if err != nil || res.Status != lock.Completed || string(res.Value) != "c-result" {
		t.Fatalf("duplicate through the acquire script: %+v %v", res, err)
	}

	// A record an old consumer's script completed (format 1, exactly as
	// the previous version packs it) is a duplicate for the new one.
	rkey = lock.RecordKey(prefix, "d")
	const oldFence, created, ended = 1_790_000_000_000_123, 1_790_000_000_000, 1_790_000_000_050
	rec := append([]byte{0x01, 0xa1, 'c', 0xd9, 0x20}, oldOwner...)
	rec = binary.BigEndian.AppendUint64(append(rec, 0xcf), oldFence)
	rec = append(rec, 0x00, 0x01, 0xa0, 0xa1, 'd') // deadline 0, attempt 1, no fingerprint, key "d"
	rec = binary.BigEndian.AppendUint64(append(rec, 0xcf), created)
	rec = binary.BigEndian.AppendUint64(append(rec, 0xcf), ended)
	rec = append(rec, 0xa2, 'o', 'k')
	if err := client.Set(ctx, rkey, rec, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	for _, native := range []bool{false, true} {
		s := newRedisStore(t, client, lock.Config{Prefix: prefix})
		if !native {
			lock.DisableNative(s)
		}
		res, err = s.Acquire(ctx, lock.Request{Key: "d", TTL: time.Second, Retention: retention})
		if err != nil || res.Status != lock.Completed || string(res.Value) != "ok" || res.Fence != oldFence || res.Attempts != 1 {
			t.Fatalf("Acquire (native %v) of an old consumer's completed record: %+v %v", native, res, err)
		}
	}
}
