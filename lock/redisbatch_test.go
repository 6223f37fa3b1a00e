package lock

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// roundTrips counts every exchange with the server: a pipeline, or a
// command sent alone.
type roundTrips struct{ n atomic.Int64 }

func (h *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}
func (h *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

// A batch's leases are taken in one round trip when the native
// transaction decides every key, two when some need the acquire script
// (the second holding only those), one with every Acquire through the
// script; its records are completed in one. Per-key answers are checked
// by the storetest suite; here the round trips, exactly.
func TestRedisBatchRoundTrips(t *testing.T) {
	client := testenv.RedisClient(t)
	var rt roundTrips
	client.AddHook(&rt)
	ctx := context.Background()
	for _, native := range []bool{true, false} {
		t.Run(fmt.Sprint("native=", native), func(t *testing.T) {
			s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
			if err != nil {
				t.Fatal(err)
			}
			if !native {
				s.batch.noNative.Store(true)
			}
			if err := s.Check(ctx); err != nil { // loads the scripts
				t.Fatal(err)
			}
			if !s.batch.merging(ctx) { // asks INFO once
				t.Fatal("not a standalone server")
			}
			// A first call dials the pipelines' connection (HELLO, CLIENT
			// SETINFO): a cost of the pool, not of a batch.
			if _, errs := s.AcquireBatch(ctx, []Request{{Key: "warm-up"}}); errs[0] != nil {
				t.Fatal(errs[0])
			}
			keys := func(prefix string, n int) []Request {
				reqs := make([]Request, n)
				for i := range reqs {
					reqs[i] = Request{Key: fmt.Sprint(prefix, i)}
				}
				return reqs
			}
			batch := func(name string, reqs []Request, wantTrips int64, want Status) []Result {
				t.Helper()
				before := rt.n.Load()
				rs, errs := s.AcquireBatch(ctx, reqs)
				if got := rt.n.Load() - before; got != wantTrips {
					t.Fatalf("%s: %d leases in %d round trips, want %d", name, len(reqs), got, wantTrips)
				}
				if err := errors.Join(errs...); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				for i, r := range rs {
					if r.Status != want {
						t.Fatalf("%s: key %q: got %v, want %v", name, reqs[i].Key, r.Status, want)
					}
				}
				return rs
			}
			script := int64(1)
			if native {
				script = 2
			}

			rs := batch("new keys", keys("a", 100), 1, Acquired)
			leases := make([]Lease, len(rs))
			results := make([][]byte, len(rs))
			for i, r := range rs {
				leases[i], results[i] = r.Lease, []byte(fmt.Sprint("result-", i))
			}
			before := rt.n.Load()
			if err := errors.Join(s.CompleteBatch(ctx, leases, results)...); err != nil {
				t.Fatal(err)
			}
			if got, want := rt.n.Load()-before, int64(1); got != want {
				t.Fatalf("CompleteBatch of 100: %d round trips, want %d", got, want)
			}
			batch("duplicates", keys("a", 100), 1, Completed)

			held := batch("held", keys("b", 100), 1, Acquired)
			batch("busy", keys("b", 100), script, InProgress)
			for _, r := range held[:50] {
				if err := s.Release(ctx, r.Lease); err != nil {
					t.Fatal(err)
				}
			}
			// 50 released keys (the script retakes them) and 50 new ones.
			mixed := append(keys("b", 50), keys("c", 50)...)
			rs = batch("released and new", mixed, script, Acquired)
			for i, r := range rs[:50] {
				if r.Lease.Fence <= held[i].Lease.Fence || r.Lease.Attempt != 2 {
					t.Fatalf("key %q: got fence %d attempt %d, want above %d and 2", mixed[i].Key, r.Lease.Fence, r.Lease.Attempt, held[i].Lease.Fence)
				}
			}
		})
	}
}

// Requests whose answer was lost are sent again together, with their
// owner tokens: the leases the lost pipeline took are the caller's, with
// one attempt counted.
func TestRedisAcquireBatchRetryAfterLostReply(t *testing.T) {
	client := testenv.RedisClient(t)
	lose := &loseReplies{left: 1}
	client.AddHook(lose)
	s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	reqs := []Request{{Key: "x"}, {Key: "y"}}
	rs, errs := s.AcquireBatch(ctx, reqs)
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if got, want := lose.lost.Load(), int64(1); got != want {
		t.Fatalf("replies lost: got %d, want %d", got, want)
	}
	for i, r := range rs {
		if r.Status != Acquired || r.Attempts != 1 {
			t.Fatalf("key %q: got %v attempts %d, want Acquired attempts 1", reqs[i].Key, r.Status, r.Attempts)
		}
		if err := s.Complete(ctx, r.Lease, nil); err != nil {
			t.Fatalf("key %q: the lease answered is not the one held: %v", reqs[i].Key, err)
		}
	}
}

// loseReplies runs the first left pipelines of the store (a connection's
// handshake is not one) and then reports them failed
// as a broken connection would: their writes landed, their replies lost.
type loseReplies struct {
	left int64
	lost atomic.Int64
}

func (h *loseReplies) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *loseReplies) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *loseReplies) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		store := false
		for _, c := range cmds {
			store = store || c.Name() == "exec" || c.Name() == "evalsha"
		}
		if store && h.lost.Load() < h.left {
			h.lost.Add(1)
			for _, c := range cmds {
				c.SetErr(errLostReply)
			}
			return errLostReply
		}
		return err
	}
}

var errLostReply error = &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
