package lock

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// The outcome of a lease the native Acquire made names the record as that
// Acquire wrote it and the expiry it was written with, so that finish.lua
// writes it without decoding (TestRedisFinishWithoutDecoding checks what it
// writes); a lease the acquire script granted names none. A record format
// that drifts from what finishCall expects would still be completed (by
// decoding), only slower: this test says so.
func TestFinishCallNamesTheMadeRecord(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	for _, fp := range []string{"", "a fingerprint"} {
		res, err := s.Acquire(ctx, Request{Key: "k" + fp, Fingerprint: fp, TTL: 3 * time.Second, Retention: 70 * time.Second})
		if err != nil || res.Status != Acquired || !res.Lease.made {
			t.Fatalf("Acquire: %+v %v, want a lease on a record the native Acquire made", res, err)
		}
		c := s.finishCall(res.Lease, stateCompleted, []byte("r"), "")
		raw, _ := client.Get(ctx, res.Lease.rkey).Bytes()
		exp := client.PExpireTime(ctx, res.Lease.rkey).Val().Milliseconds()
		if !bytes.Equal(c.slots[3], raw) || string(c.slots[4]) != strconv.FormatInt(exp, 10) {
			t.Fatalf("finish call names record %x expiring at %s, the record is %x expiring at %d", c.slots[3], c.slots[4], raw, exp)
		}
		putCall(c)
	}

	lease := Lease{Key: "k", Owner: "o", Fence: 7, Attempt: 1, TTL: time.Second, Retention: time.Second}
	c := s.finishCall(lease, stateCompleted, nil, "")
	if c.args[3] != "" || c.args[4] != "" {
		t.Fatalf("finish call of a lease the script granted: %v, want no made record", c.args)
	}
	putCall(c)
}

// finish.lua writes the outcome of a made lease with SET ... GET once the
// key's expiry is the one the lease names, before it has seen the record:
// a record it replaced that is not the made one (here given that same
// expiry on purpose) is put back, bytes and expiry, and judged as any
// other record. Another owner's record stays as it was and the lease is
// lost; the lease's own record, rewritten since, is completed by
// decoding; a hash (a record of an earlier release) is its key's error
// alone and stays a hash.
func TestFinishPutsBackARecordOfTheSameExpiry(t *testing.T) {
	client := testenv.RedisClient(t)
	ctx := context.Background()
	s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	acquire := func(t *testing.T, key string) (Lease, int64) {
		t.Helper()
		res, err := s.Acquire(ctx, Request{Key: key, TTL: 3 * time.Second, Retention: 70 * time.Second})
		if err != nil || res.Status != Acquired || !res.Lease.made {
			t.Fatalf("Acquire: %+v %v, want a lease on a record the native Acquire made", res, err)
		}
		exp := client.PExpireTime(ctx, res.Lease.rkey).Val().Milliseconds()
		return res.Lease, exp
	}

	t.Run("another owner's record", func(t *testing.T) {
		l, exp := acquire(t, "other")
		created := l.Fence/1000 - 1
		other := appendHead(nil, "p", "another owner's token, 32 bytes", l.Fence+5, 2, "", l.Key, created)
		other = appendInt(appendInt(other, 0), 0)
		other = appendStr(other, "")
		if err := client.Set(ctx, l.rkey, other, 0).Err(); err != nil {
			t.Fatal(err)
		}
		client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp))
		if err := s.Complete(ctx, l, []byte("r")); !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("Complete: %v, want ErrLeaseLost", err)
		}
		raw, _ := client.Get(ctx, l.rkey).Bytes()
		if got := client.PExpireTime(ctx, l.rkey).Val().Milliseconds(); !bytes.Equal(raw, other) || got != exp {
			t.Fatalf("record %x expiring at %d, want %x expiring at %d as it was", raw, got, other, exp)
		}
	})

	t.Run("the lease's record rewritten", func(t *testing.T) {
		l, exp := acquire(t, "extended")
		if errs := s.Extend(ctx, l); errs[0] != nil {
			t.Fatal(errs[0])
		}
		client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp))
		if err := s.Complete(ctx, l, []byte("r")); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		rec, err := s.Inspect(ctx, l.Key)
		if err != nil || rec.State != StateCompleted || string(rec.Value) != "r" || rec.Fence != l.Fence {
			t.Fatalf("Inspect: %+v %v, want completed with r under fence %d", rec, err, l.Fence)
		}
		if ttl := client.PTTL(ctx, l.rkey).Val(); ttl <= 60*time.Second || ttl > 70*time.Second {
			t.Fatalf("PTTL %v, want the retention", ttl)
		}
	})

	t.Run("a hash", func(t *testing.T) {
		l, exp := acquire(t, "hash")
		client.Del(ctx, l.rkey)
		client.HSet(ctx, l.rkey, "state", "p")
		client.PExpireAt(ctx, l.rkey, time.UnixMilli(exp))
		err := s.Complete(ctx, l, []byte("r"))
		if !errors.Is(err, ErrBadRecord) || !strings.Contains(err.Error(), "WRONGTYPE") {
			t.Fatalf("Complete: %v, want its key's WRONGTYPE error", err)
		}
		if typ := client.Type(ctx, l.rkey).Val(); typ != "hash" || client.PExpireTime(ctx, l.rkey).Val().Milliseconds() != exp {
			t.Fatalf("key is a %s expiring at %v, want the hash as it was", typ, client.PExpireTime(ctx, l.rkey).Val())
		}
	})
}
