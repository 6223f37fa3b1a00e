package lock

import (
	"bytes"
	"context"
	"strconv"
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
		if !bytes.Equal(c.slots[5], raw) || string(c.slots[6]) != strconv.FormatInt(exp, 10) {
			t.Fatalf("finish call names record %x expiring at %s, the record is %x expiring at %d", c.slots[5], c.slots[6], raw, exp)
		}
		putCall(c)
	}

	lease := Lease{Key: "k", Owner: "o", Fence: 7, Attempt: 1, TTL: time.Second, Retention: time.Second}
	c := s.finishCall(lease, stateCompleted, nil, "")
	if c.args[5] != "" || c.args[6] != "" || c.args[7] != "" {
		t.Fatalf("finish call of a lease the script granted: %v, want no made record", c.args)
	}
	putCall(c)
}
