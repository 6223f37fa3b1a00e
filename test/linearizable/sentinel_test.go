package linearizable_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// TestRedisSentinel runs against a Sentinel set of the test's own (a
// master, one replica, three sentinels) while the master crashes and the
// sentinels promote the replica. Each failover is made to lose what
// asynchronous replication can lose: the replica stalls (SIGSTOP) and its
// link is dropped, the master goes on answering for 500 ms, and is killed
// (SIGKILL) before the replica is back. (A stall alone loses nothing: the
// stream waits in the replica's socket buffer; a crash alone almost
// nothing on loopback, where the stream reaches the replica with the
// answers.)
//
// With Config.Replicas 1 (wait) a write is answered only once the replica
// has it: the writes of those 500 ms time out, ambiguous, and the history
// must be linearizable. Without it (nowait) they are acknowledged by the
// master alone and forgotten by the failover, which the checker must find:
// the expected result is a violation (docs/testing.md, lock.Config.Replicas).
func TestRedisSentinel(t *testing.T) {
	for _, tc := range []struct {
		name     string
		replicas int
	}{{"wait", 1}, {"nowait", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			sen := testenv.RedisSentinel(t)
			client := redis.NewFailoverClient(&redis.FailoverOptions{
				MasterName: sen.MasterName, SentinelAddrs: append([]string(nil), sen.SentinelAddrs...),
				ContextTimeoutEnabled: true, DialTimeout: 200 * time.Millisecond,
				ReadTimeout: 500 * time.Millisecond, WriteTimeout: 500 * time.Millisecond,
			})
			t.Cleanup(func() { _ = client.Close() })
			cfg := lock.Config{Prefix: testenv.Name(t)}
			if tc.replicas > 0 {
				cfg.Replicas, cfg.ReplicaTimeout = tc.replicas, 200*time.Millisecond
			}
			s, err := lock.NewRedisStore(client, cfg)
			if err != nil {
				t.Fatal(err)
			}
			sc := redis.NewSentinelClient(&redis.Options{Addr: sen.SentinelAddrs[0]})
			t.Cleanup(func() { _ = sc.Close() })
			w := size(
				linearizable.Workload{Clients: 4, Keys: 8, Ops: 5000, Duration: 10 * time.Second, TTL: 50 * time.Millisecond, Timeout: 300 * time.Millisecond, Seed: seed()},
				// More operations than the other full runs: 20,000 take
				// about 20 s here, and three failovers need about 40.
				linearizable.Workload{Clients: 8, Keys: 16, Ops: 50000, Duration: 60 * time.Second, TTL: 50 * time.Millisecond, Timeout: 300 * time.Millisecond, Seed: seed()},
			)
			run := linearizable.Start(s, w)
			var lastWindow int
			n := faults(run, sizeInt(1, 3), sizeDur(3*time.Second, 8*time.Second), func() {
				lastWindow = lossyFailover(t, sen, sc)
			})
			name := "redis-sentinel-failover-" + tc.name
			res := check(t, name, localClock, w, run.History())
			t.Logf("%s: %d failovers, %d commands processed by the master alone before the last one (sentinel pings included), %d ambiguous operations",
				name, n, lastWindow, res.Ambiguous)
			if n == 0 {
				t.Fatalf("%s: the run ended before a failover", name)
			}
			if tc.replicas > 0 {
				wantOK(t, res)
				return
			}
			switch res.Check {
			case porcupine.Illegal:
				t.Logf("%s: violation, as expected without Replicas: see %s", name, res.Visualization)
			case porcupine.Ok:
				t.Errorf("%s: no violation: the failover lost no acknowledged write that a later call read", name)
			default:
				t.Errorf("%s: the check did not finish within its budget", name)
			}
		})
	}
}

// sizeInt and sizeDur pick a short or a full-size figure.
func sizeInt(short, fullSize int) int {
	if full() {
		return fullSize
	}
	return short
}

func sizeDur(short, fullSize time.Duration) time.Duration {
	if full() {
		return fullSize
	}
	return short
}

// lossyFailover stalls sen's replica, drops its link, lets the master
// answer alone for 500 ms, kills it, resumes the replica and waits until
// the sentinels have promoted it. A fresh replica of the new master then
// joins, with replica-priority 0 until it is in sync (so that the
// sentinels never promote it empty), and sen.Master and sen.Replica are
// updated. The old master stays down: restarted without persistence it
// would come back empty, and a failover to it would lose everything, a
// hazard of running Sentinel so, not the window tested here. It returns
// how many commands the master processed in its 500 ms alone.
func lossyFailover(t *testing.T, sen *testenv.Sentinel, sc *redis.SentinelClient) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	old, replica := sen.Master, sen.Replica
	direct := redis.NewClient(&redis.Options{Addr: old.Addr, DialTimeout: time.Second, ReadTimeout: time.Second})
	defer direct.Close()
	before := commandsProcessed(ctx, direct)
	replica.Pause()
	if err := direct.ClientKillByFilter(ctx, "TYPE", "replica").Err(); err != nil {
		t.Fatalf("dropping the replica's link: %v", err)
	}
	time.Sleep(500 * time.Millisecond)
	window := commandsProcessed(ctx, direct) - before
	old.Stop()
	replica.Resume()
	var master []string
	if err := until(ctx, func() error {
		addr, err := sc.GetMasterAddrByName(ctx, sen.MasterName).Result()
		if err != nil {
			return err
		}
		if len(addr) != 2 || net.JoinHostPort(addr[0], addr[1]) != replica.Addr {
			return fmt.Errorf("master %v, want %s", addr, replica.Addr)
		}
		master = addr
		return nil
	}); err != nil {
		t.Fatalf("the replica %s not promoted: %v", replica.Addr, err)
	}
	fresh := testenv.RedisServer(t, "--replicaof", master[0], master[1], "--replica-priority", "0", "--repl-diskless-sync-delay", "0")
	fc := redis.NewClient(&redis.Options{Addr: fresh.Addr, DialTimeout: time.Second, ReadTimeout: time.Second})
	defer fc.Close()
	if err := until(ctx, func() error {
		info, err := fc.Info(ctx, "replication").Result()
		if err != nil {
			return err
		}
		if !strings.Contains(info, "master_link_status:up") {
			return errors.New("fresh replica not in sync")
		}
		return nil
	}); err != nil {
		t.Fatalf("fresh replica %s of %s: %v", fresh.Addr, replica.Addr, err)
	}
	if err := fc.ConfigSet(ctx, "replica-priority", "100").Err(); err != nil {
		t.Fatalf("fresh replica %s: %v", fresh.Addr, err)
	}
	// The next failover needs the sentinels to see it as a candidate.
	if err := until(ctx, func() error {
		reps, err := sc.Replicas(ctx, sen.MasterName).Result()
		if err != nil {
			return err
		}
		for _, r := range reps {
			if r["name"] == fresh.Addr && r["slave-priority"] == "100" && r["master-link-status"] == "ok" &&
				!strings.Contains(r["flags"], "down") {
				return nil
			}
		}
		return fmt.Errorf("sentinel does not see %s as a replica fit to promote: %v", fresh.Addr, reps)
	}); err != nil {
		t.Fatalf("%v", err)
	}
	sen.Master, sen.Replica = replica, fresh
	return window
}

// commandsProcessed is the server's total_commands_processed, or 0.
func commandsProcessed(ctx context.Context, c *redis.Client) int {
	info, err := c.Info(ctx, "stats").Result()
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "total_commands_processed:"); ok {
			var n int
			_, _ = fmt.Sscan(v, &n)
			return n
		}
	}
	return 0
}

// until calls f every 100 ms until it returns nil or ctx ends.
func until(ctx context.Context, f func() error) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}
