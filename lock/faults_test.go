package lock_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// A key holding something other than a record is that key's fault alone:
// ErrBadRecord, not an outage.
func TestRedisBadRecordIsPerKey(t *testing.T) {
	client := testenv.RedisClient(t)
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	ctx := context.Background()
	if _, err := s.Acquire(ctx, lock.Request{Key: "k"}); err != nil {
		t.Fatal(err)
	}
	keys, err := client.Keys(ctx, prefix+":*").Result()
	if err != nil || len(keys) != 1 {
		t.Fatalf("record keys: %v %v", keys, err)
	}
	client.Del(ctx, keys[0])
	client.HSet(ctx, keys[0], "state", "c")
	client.Expire(ctx, keys[0], time.Minute)
	_, err = s.Acquire(ctx, lock.Request{Key: "k"})
	if !errors.Is(err, lock.ErrBadRecord) || errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Acquire of a hash: got %v, want ErrBadRecord", err)
	}
	if res, err := s.Acquire(ctx, lock.Request{Key: "other"}); err != nil || res.Status != lock.Acquired {
		t.Fatalf("another key: %v %v", res.Status, err)
	}
}

// A store that cannot be reached says so: ErrUnavailable.
func TestRedisUnreachableIsUnavailable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	client := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { client.Close() })
	s := newRedisStore(t, client, lock.Config{})
	_, err = s.Acquire(context.Background(), lock.Request{Key: "k"})
	if !errors.Is(err, lock.ErrUnavailable) || errors.Is(err, lock.ErrBadRecord) {
		t.Fatalf("Acquire on a closed port: got %v, want ErrUnavailable", err)
	}
	l := lock.Lease{Key: "k", Owner: "o", Fence: 1, TTL: time.Second, Retention: time.Hour, Deadline: time.Now().Add(time.Second)}
	if err := s.Complete(context.Background(), l, nil); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Complete on a closed port: got %v, want ErrUnavailable", err)
	}
	if err := s.Amend(context.Background(), "k", 1, nil, []byte("v")); !errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Amend on a closed port: got %v, want ErrUnavailable", err)
	}
	// A value over the limit is refused before any round trip.
	big := make([]byte, lock.DefaultMaxResultSize+1)
	if err := s.Amend(context.Background(), "k", 1, nil, big); !errors.Is(err, lock.ErrResultTooLarge) || errors.Is(err, lock.ErrUnavailable) {
		t.Fatalf("Amend of a value over the limit on a closed port: got %v, want ErrResultTooLarge", err)
	}
}

// crossSlotProxy answers CROSSSLOT, without sending it, to any EVALSHA over
// more than one key, as a proxy in front of a Redis Cluster does.
type crossSlotProxy struct{ refused atomic.Int64 }

func (h *crossSlotProxy) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *crossSlotProxy) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *crossSlotProxy) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var pass []redis.Cmder
		for _, c := range cmds {
			a := c.Args()
			if len(a) > 2 && strings.EqualFold(fmt.Sprint(a[0]), "evalsha") && fmt.Sprint(a[2]) != "1" {
				h.refused.Add(1)
				c.SetErr(replyError("CROSSSLOT Keys in request don't hash to the same slot"))
				continue
			}
			pass = append(pass, c)
		}
		if len(pass) == 0 {
			return nil
		}
		return next(ctx, pass)
	}
}

// replyError is an error reply of the server, as go-redis reports one.
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

// Merged script calls refused as a whole do not decide their batch-mates'
// answers: each call is sent alone, and merging stops.
func TestRedisMergedCallRefusedAsAWhole(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t)})
	t.Cleanup(func() { client.Close() })
	proxy := &crossSlotProxy{}
	client.AddHook(proxy)
	s := newRedisStore(t, client, lock.Config{Prefix: testenv.Name(t)})
	ctx := context.Background()
	if err := s.Check(ctx); err != nil {
		t.Fatal(err)
	}
	var refused int64
	for round := range 3 {
		const n = 32
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				res, err := s.Acquire(ctx, lock.Request{Key: fmt.Sprintf("r%d-k%d", round, i)})
				if err == nil && res.Status != lock.Acquired {
					err = fmt.Errorf("status %v", res.Status)
				}
				if err == nil {
					err = s.Complete(ctx, res.Lease, []byte("ok"))
				}
				errs[i] = err
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("round %d, key %d: %v", round, i, err)
			}
		}
		// The first round merges (and is refused); then merging stops.
		switch n := proxy.refused.Load(); {
		case round == 0 && n == 0:
			t.Fatal("no merged call was sent: the fault was never injected")
		case round == 0:
			refused = n
		case n != refused:
			t.Fatalf("round %d: %d merged calls refused after %d in round 0: merging did not stop", round, n, refused)
		}
	}
	for i := range 32 {
		res, err := s.Acquire(ctx, lock.Request{Key: fmt.Sprintf("r0-k%d", i)})
		if err != nil || res.Status != lock.Completed || res.Attempts != 1 {
			t.Fatalf("key %d: %v attempts %d %v; want completed once", i, res.Status, res.Attempts, err)
		}
	}
}

// lostReplyConn loses the reply of the first script call written after arm:
// the server ran it, the connection breaks, and for outage the server
// cannot be dialled, so that go-redis's own resend fails too and the error
// reaches the store.
type lostReplyConn struct {
	net.Conn
	armed *atomic.Bool
	down  *atomic.Int64 // dials fail until this time (unix ns)
	lose  bool
}

const outage = 120 * time.Millisecond

func (c *lostReplyConn) Write(b []byte) (int, error) {
	if acquireWrite(b) && c.armed.CompareAndSwap(true, false) {
		c.lose = true
	}
	return c.Conn.Write(b)
}

func (c *lostReplyConn) Read(b []byte) (int, error) {
	if c.lose {
		_ = c.Conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, _ = c.Conn.Read(b) // the reply came: the command surely ran
		c.down.Store(time.Now().Add(outage).UnixNano())
		c.Conn.Close()
		return 0, net.ErrClosed
	}
	return c.Conn.Read(b)
}

// An Acquire whose reply is lost, with the server briefly unreachable
// after, resolves itself with the same owner token: the lease it took is
// its own, and no attempt is wasted.
func TestRedisAcquireResolvesALostReply(t *testing.T) {
	var armed atomic.Bool
	var down atomic.Int64
	client := redis.NewClient(&redis.Options{
		Addr:       testenv.RedisAddr(t),
		MaxRetries: -1,
		// go-redis retries a failed dial for 500 ms by default, which would
		// ride out the outage itself; here it gives up at once.
		DialerRetries:      1,
		DialerRetryTimeout: time.Millisecond,
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if time.Now().UnixNano() < down.Load() {
				return nil, &net.OpError{Op: "dial", Net: network, Err: errors.New("connection refused (test outage)")}
			}
			return wrapDialer(func(c net.Conn) net.Conn { return &lostReplyConn{Conn: c, armed: &armed, down: &down} })(ctx, network, addr)
		},
	})
	t.Cleanup(func() { client.Close() })
	wantResolved(t, client, &armed)
}

// stallConn stalls the reply of the first script call written after arm
// until the client's read deadline passes: the server ran the call, the
// client sees an i/o timeout.
type stallConn struct {
	net.Conn
	armed *atomic.Bool
	stall bool
}

func (c *stallConn) Write(b []byte) (int, error) {
	if acquireWrite(b) && c.armed.CompareAndSwap(true, false) {
		c.stall = true
	}
	return c.Conn.Write(b)
}

func (c *stallConn) Read(b []byte) (int, error) {
	if c.stall {
		c.stall = false
		_, _ = c.Conn.Read(b) // the reply came: the command surely ran
		return c.Conn.Read(b) // nothing more comes: blocks until the read deadline
	}
	return c.Conn.Read(b)
}

// An Acquire whose reply does not come in time (the server ran it) is
// tried again with the same owner token: the lease it took is its own,
// attempt 1, and another caller sees it in progress. MaxRetries -1 keeps
// go-redis from resending the pipeline after the timeout itself.
func TestRedisAcquireResolvesATimedOutReply(t *testing.T) {
	var armed atomic.Bool
	client := redis.NewClient(&redis.Options{
		Addr:        testenv.RedisAddr(t),
		MaxRetries:  -1,
		ReadTimeout: 200 * time.Millisecond,
		Dialer:      wrapDialer(func(c net.Conn) net.Conn { return &stallConn{Conn: c, armed: &armed} }),
	})
	t.Cleanup(func() { client.Close() })
	wantResolved(t, client, &armed)
}

// A retention the server would keep as 0 ms is refused.
func TestConfigRefusesSubMillisecondRetention(t *testing.T) {
	err := lock.Config{Retention: 500 * time.Microsecond}.Validate()
	if !errors.Is(err, lock.ErrInvalidTTL) {
		t.Fatalf("Retention 500µs: got %v, want ErrInvalidTTL", err)
	}
}

// notStandalone answers INFO as a proxy in front of a cluster might, and
// counts script calls over more than one key.
type notStandalone struct{ merged atomic.Int64 }

func (h *notStandalone) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *notStandalone) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if c, ok := cmd.(*redis.StringCmd); ok && strings.EqualFold(cmd.Name(), "info") {
			c.SetVal("# Server\r\nredis_mode:cluster\r\n")
			return nil
		}
		return next(ctx, cmd)
	}
}
func (h *notStandalone) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			if a := c.Args(); len(a) > 2 && strings.EqualFold(fmt.Sprint(a[0]), "evalsha") && fmt.Sprint(a[2]) != "1" {
				h.merged.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

// Script calls are merged only on a server that says it is a standalone
// Redis: behind a proxy a merged call could run on the shard of its first
// key.
func TestRedisMergesOnlyOnAStandaloneServer(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t)})
	t.Cleanup(func() { client.Close() })
	hook := &notStandalone{}
	client.AddHook(hook)
	s := newRedisStore(t, client, lock.Config{Prefix: testenv.Name(t)})
	ctx := context.Background()
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.Acquire(ctx, lock.Request{Key: fmt.Sprint("k", i)}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := hook.merged.Load(); n != 0 {
		t.Fatalf("%d script calls over many keys sent to a server that is not standalone", n)
	}
}

// wantResolved arms the fault of client's connections, acquires a key and
// checks that the Acquire whose reply was lost resolved to its own lease:
// attempt 1, in progress for another caller, and able to complete.
// acquireWrite reports whether b holds an Acquire: a script call, or the
// native Acquire's transaction.
func acquireWrite(b []byte) bool {
	b = bytes.ToLower(b)
	return bytes.Contains(b, []byte("evalsha")) || bytes.Contains(b, []byte("pexpiretime"))
}

// wantResolved checks the resolution on both Acquire paths, native and
// script.
func wantResolved(t *testing.T, client *redis.Client, armed *atomic.Bool) {
	t.Helper()
	for _, native := range []bool{true, false} {
		s := newRedisStore(t, client, lock.Config{Prefix: fmt.Sprintf("%s-native-%v", testenv.Name(t), native)})
		if !native {
			lock.DisableNative(s)
		}
		wantResolvedOn(t, s, armed)
	}
}

func wantResolvedOn(t *testing.T, s *lock.RedisStore, armed *atomic.Bool) {
	t.Helper()
	ctx := context.Background()
	if err := s.Check(ctx); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	res, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: time.Minute})
	if armed.Load() {
		t.Fatal("the fault was never injected")
	}
	if err != nil || res.Status != lock.Acquired || res.Lease.Attempt != 1 {
		t.Fatalf("Acquire with its reply lost: %v attempt %d %v; want acquired, attempt 1", res.Status, res.Lease.Attempt, err)
	}
	busy, err := s.Acquire(ctx, lock.Request{Key: "k"})
	if err != nil || busy.Status != lock.InProgress || busy.Fence != res.Lease.Fence || busy.Attempts != 1 {
		t.Fatalf("another caller: %v fence %d attempts %d %v; want the same lease in progress", busy.Status, busy.Fence, busy.Attempts, err)
	}
	if err := s.Complete(ctx, res.Lease, []byte("ok")); err != nil {
		t.Fatalf("the resolved lease cannot complete: %v", err)
	}
}
