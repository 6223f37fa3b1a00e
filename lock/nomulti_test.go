package lock_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// slowMultiConn delays every write that holds a MULTI: the native
// Acquire's round trip outlasts a short caller context.
type slowMultiConn struct {
	net.Conn
	delay time.Duration
}

func (c *slowMultiConn) Write(b []byte) (int, error) {
	if bytes.Contains(bytes.ToLower(b), []byte("multi")) {
		time.Sleep(c.delay)
	}
	return c.Conn.Write(b)
}

// When the server refuses MULTI (an ACL) and the caller's context ends
// during that round trip, the bare SET that ran anyway has made the record:
// the acquire script still runs, whatever the context, and finds that
// lease the caller's own. Before, Acquire returned the NOPERM refusal (not
// ErrUnavailable), and the record it had made blocked the key for a TTL.
func TestRedisNativeRefusedAfterContextEnds(t *testing.T) {
	srv := testenv.RedisServer(t)
	ctx := context.Background()
	if err := srv.Client(t).Do(ctx, "ACL", "SETUSER", "nomulti", "on", "nopass", "~*", "+@all", "-multi").Err(); err != nil {
		t.Fatal(err)
	}
	client := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: "nomulti", Password: "any",
		Dialer: wrapDialer(func(c net.Conn) net.Conn { return &slowMultiConn{Conn: c, delay: 200 * time.Millisecond} })})
	t.Cleanup(func() { client.Close() })
	s := newRedisStore(t, client, lock.Config{Prefix: testenv.Name(t)})
	if err := s.Check(ctx); err != nil {
		t.Fatal(err)
	}
	// Any batched call asks the server what it is, once: the native path
	// is on from then on.
	if err := s.Amend(ctx, "nothing", 1, nil, []byte("x")); !errors.Is(err, lock.ErrChanged) {
		t.Fatalf("Amend of no record: %v", err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	res, err := s.Acquire(short, lock.Request{Key: "k", TTL: time.Minute})
	if err != nil {
		t.Fatalf("Acquire, MULTI refused as the context ended: %v; want the lease the bare SET took", err)
	}
	if lock.NativeEnabled(s) {
		t.Fatal("the native path was not tried, or its refusal not noted")
	}
	if res.Status != lock.Acquired || res.Lease.Attempt != 1 {
		t.Fatalf("Acquire, MULTI refused as the context ended: %v attempt %d, want acquired, attempt 1", res.Status, res.Lease.Attempt)
	}
	if err := s.Cancel(ctx, res.Lease); err != nil {
		t.Fatalf("the lease cannot be cancelled: %v", err)
	}
}
