package lock_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/storetest"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

func TestRedisStoreSentinel(t *testing.T) {
	client := testenv.RedisSentinel(t).Client(t)
	storetest.Run(t, func(t *testing.T, cfg lock.Config) lock.Store {
		s := newRedisStore(t, client, cfg)
		if err := s.Check(context.Background()); err != nil {
			t.Fatal(err)
		}
		return s
	})
}

// After a Sentinel failover the store goes on through the same failover
// client: what was replicated is still there, a lease taken before the
// failover is still its owner's, and the scripts are loaded again on the
// new master, which never had them.
func TestRedisStoreSentinelFailover(t *testing.T) {
	ctx := context.Background()
	sen := testenv.RedisSentinel(t)
	client := sen.Client(t)
	var noScript atomic.Int64
	client.AddHook(noScriptHook{&noScript})
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	if err := s.Check(ctx); err != nil {
		t.Fatal(err)
	}

	const completed = 10
	for i := range completed {
		key := fmt.Sprintf("done-%d", i)
		res := acquireStatus(t, s, lock.Request{Key: key}, lock.Acquired)
		if err := s.Complete(ctx, res.Lease, []byte("result-"+key)); err != nil {
			t.Fatalf("Complete(%s): %v", key, err)
		}
	}
	res := acquireStatus(t, s, lock.Request{Key: "failed"}, lock.Acquired)
	if err := s.Fail(ctx, res.Lease, "card declined"); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	held := acquireStatus(t, s, lock.Request{Key: "held", TTL: time.Minute}, lock.Acquired).Lease

	// Replication is asynchronous: a failover right after a write can
	// promote a replica that never received it, and the write is lost
	// (the documented limit in package lock's doc). Wait until the replica
	// has everything written so far. WAIT counts the replicas that have
	// all the writes of its own connection, so write on that connection
	// first: the replication stream is ordered, so the store's earlier
	// writes, made on other connections, are acknowledged with it.
	conn := sen.Master.Client(t).Conn()
	t.Cleanup(func() { _ = conn.Close() })
	if err := conn.Set(ctx, "wait-marker:"+prefix, "1", time.Minute).Err(); err != nil {
		t.Fatalf("SET on the master: %v", err)
	}
	if got, err := conn.Wait(ctx, 1, time.Second).Result(); err != nil || got != 1 {
		t.Fatalf("WAIT 1 1000: got %d replicas, %v; want 1", got, err)
	}
	before := countRecords(t, sen.Master, prefix)
	if got, want := before, completed+2; got != want {
		t.Fatalf("records on the master: got %d, want %d", got, want)
	}

	old := sen.Master.Addr
	sen.Failover(t)
	if sen.Master.Addr == old {
		t.Fatalf("Failover left the master at %s", old)
	}
	if got, want := countRecords(t, sen.Master, prefix), before; got != want {
		t.Fatalf("records on the new master %s: got %d, want %d", sen.Master.Addr, got, want)
	}

	// Redis does not replicate its script cache, so the promoted replica
	// has none of the store's scripts (Check loaded them on the old master
	// only). Flush it anyway, so that the test does not depend on that.
	newMaster := sen.Master.Client(t)
	if err := newMaster.ScriptFlush(ctx).Err(); err != nil {
		t.Fatalf("SCRIPT FLUSH on the new master: %v", err)
	}
	noScript.Store(0)

	for i := range completed {
		key := fmt.Sprintf("done-%d", i)
		got := acquireStatus(t, s, lock.Request{Key: key}, lock.Completed)
		if want := "result-" + key; string(got.Value) != want || got.Fence <= 0 || got.Attempts != 1 {
			t.Fatalf("Acquire(%s) after failover: got %q fence %d attempts %d, want %q, a fence, attempts 1",
				key, got.Value, got.Fence, got.Attempts, want)
		}
	}
	if got := acquireStatus(t, s, lock.Request{Key: "failed"}, lock.Failed); got.Error != "card declined" {
		t.Fatalf("Acquire(failed) after failover: got error %q, want %q", got.Error, "card declined")
	}
	busy := acquireStatus(t, s, lock.Request{Key: "held"}, lock.InProgress)
	if busy.Fence != held.Fence || busy.Remaining <= 0 {
		t.Fatalf("Acquire(held) after failover: got fence %d remaining %v, want fence %d and time left", busy.Fence, busy.Remaining, held.Fence)
	}
	fresh := acquireStatus(t, s, lock.Request{Key: "new"}, lock.Acquired).Lease
	if fresh.Attempt != 1 {
		t.Fatalf("Acquire(new) after failover: got attempt %d, want 1", fresh.Attempt)
	}

	// The owner of the lease taken before the failover keeps it: the batch
	// path (one pipeline for both leases) and the single-lease path.
	for i, err := range s.Extend(ctx, held, fresh) {
		if err != nil {
			t.Fatalf("Extend (batch) after failover, lease %d: %v", i, err)
		}
	}
	if err := s.Extend(ctx, held)[0]; err != nil {
		t.Fatalf("Extend(held) after failover: %v", err)
	}
	if err := s.Complete(ctx, held, []byte("held-result")); err != nil {
		t.Fatalf("Complete(held) after failover: %v", err)
	}
	if err := s.Release(ctx, fresh); err != nil {
		t.Fatalf("Release(new) after failover: %v", err)
	}
	if got := acquireStatus(t, s, lock.Request{Key: "held"}, lock.Completed); string(got.Value) != "held-result" || got.Fence != held.Fence {
		t.Fatalf("Acquire(held) after Complete: got %q fence %d, want %q fence %d", got.Value, got.Fence, "held-result", held.Fence)
	}
	if got := acquireStatus(t, s, lock.Request{Key: "new"}, lock.Acquired); got.Lease.Fence <= fresh.Fence || got.Lease.Attempt != 2 {
		t.Fatalf("Acquire(new) after Release: got fence %d attempt %d, want above %d, 2", got.Lease.Fence, got.Lease.Attempt, fresh.Fence)
	}

	// Each of the three scripts was missing once and loaded again.
	if got, min := noScript.Load(), int64(3); got < min {
		t.Fatalf("NOSCRIPT replies after the failover: got %d, want at least %d (one per script)", got, min)
	}
	hashes := scriptHashes(t)
	exists, err := newMaster.ScriptExists(ctx, hashes...).Result()
	if err != nil {
		t.Fatalf("SCRIPT EXISTS on the new master: %v", err)
	}
	for i, ok := range exists {
		if !ok {
			t.Fatalf("script %s is not loaded on the new master", hashes[i])
		}
	}
}

func acquireStatus(t *testing.T, s lock.Store, req lock.Request, want lock.Status) lock.Result {
	t.Helper()
	res, err := s.Acquire(context.Background(), req)
	if err != nil {
		t.Fatalf("Acquire(%s): %v", req.Key, err)
	}
	if res.Status != want {
		t.Fatalf("Acquire(%s): got %v, want %v (result %+v)", req.Key, res.Status, want, res)
	}
	return res
}

// countRecords counts the store's records (one Redis key each) on srv
// alone.
func countRecords(t *testing.T, srv *testenv.Server, prefix string) int {
	t.Helper()
	keys, err := srv.Client(t).Keys(context.Background(), prefix+":*").Result()
	if err != nil {
		t.Fatalf("KEYS on %s: %v", srv.Addr, err)
	}
	return len(keys)
}

// scriptHashes returns the SHA-1 digests of the store's scripts.
func scriptHashes(t *testing.T) []string {
	t.Helper()
	var hashes []string
	record, err := os.ReadFile("scripts/record.lua")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"acquire", "extend", "finish"} {
		src, err := os.ReadFile("scripts/" + name + ".lua")
		if err != nil {
			t.Fatal(err)
		}
		hashes = append(hashes, redis.NewScript(string(record)+string(src)).Hash())
	}
	return hashes
}

// noScriptHook counts NOSCRIPT replies, of single commands and in pipelines.
type noScriptHook struct{ n *atomic.Int64 }

func (h noScriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h noScriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.count(cmd)
		return err
	}
}
func (h noScriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			h.count(cmd)
		}
		return err
	}
}

func (h noScriptHook) count(cmd redis.Cmder) {
	if err := cmd.Err(); err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
		h.n.Add(1)
	}
}
