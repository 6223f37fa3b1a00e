//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 12, redis-failover: the consumers reach Redis through Sentinel
// (a master, one replica, three Sentinels); mid-run the replication link
// breaks, the replica stalls for 700 ms and the master is killed (SIGKILL)
// before the replica is back, the Sentinels promote the replica, the
// consumers follow, and a fresh replica (never to be promoted) joins the
// new master.
//
// With lock.Config.Replicas 1 (wait) a write counts only once the replica
// has it, so the promoted replica forgets no lease in use and no completed
// record: nothing may run after its operation completed. Without it
// (nowait) Redis's asynchronous replication can lose the last writes: the
// scenario measures how many operations ran again after they had
// completed (the fenced ledger absorbs those runs), and reports it.
func TestChaos12RedisFailover(t *testing.T) {
	for _, tc := range []struct {
		name     string
		replicas int
	}{
		{"wait", 1},
		{"nowait", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{sentinel: true})
			nOps := pick(1000, 3000)
			for i := range 2 {
				e.consumer(fmt.Sprintf("%s-c%d", e.name, i), "-lease", "2s", "-in-progress-delay", "300ms",
					"-unavailable-delay", "300ms", "-redis-timeout", "900ms", "-concurrency", "8",
					"-sentinels", strings.Join(e.sentinel.SentinelAddrs, ","), "-master", e.sentinel.MasterName,
					"-replicas", strconv.Itoa(tc.replicas))
			}
			ops := workload.Storm(e.name+"-op", nOps, 1, 40, e.rng)
			e.publish(ops)
			e.waitFor("a tenth of the operations applied", 3*time.Minute,
				func() bool { return e.applied() >= nOps/10 }, nil)
			// The replication link breaks and the replica stalls for 700
			// ms (SIGSTOP: a slow host, a network hiccup), and the master
			// crashes before the replica is back: the writes of those 700
			// ms are on the master alone. (A stall alone loses nothing:
			// the stream waits in the replica's socket buffer.)
			old, replica := e.sentinel.Master, e.sentinel.Replica
			replica.Pause()
			if err := old.Client(t).ClientKillByFilter(context.Background(), "TYPE", "replica").Err(); err != nil {
				t.Fatalf("dropping the replica's link: %v", err)
			}
			time.Sleep(700 * time.Millisecond)
			killedAt := time.Now()
			old.Stop() // a crash: the Sentinels promote the replica about 2 s later
			replica.Resume()
			appliedAtKill := e.applied()
			// Once the replica is promoted, a fresh replica of it joins
			// (the writes waiting for a replica go on then), with
			// replica-priority 0 so that the Sentinels never promote it
			// while it is still empty or syncing. The old master stays
			// down: restarted without persistence, it would come back
			// empty, and a spurious second failover to it (one happened
			// under CI load, the new master missing a ping for a second)
			// loses every record, a hazard of running Sentinel that way,
			// not the window measured here.
			sentinel := redis.NewSentinelClient(&redis.Options{Addr: e.sentinel.SentinelAddrs[0]})
			defer sentinel.Close()
			var promoted []string
			e.waitFor("the replica promoted", time.Minute, func() bool {
				addr, err := sentinel.GetMasterAddrByName(context.Background(), e.sentinel.MasterName).Result()
				promoted = addr
				return err == nil && len(addr) == 2 && net.JoinHostPort(addr[0], addr[1]) != old.Addr
			}, nil)
			promotedAfter := time.Since(killedAt)
			testenv.RedisServer(t, "--replicaof", promoted[0], promoted[1], "--replica-priority", "0")
			e.settle(nOps, 4*time.Minute, 2*time.Second)

			e.publishCopies(ops) // every operation again, after the failover
			e.waitDrained(4*time.Minute, 2*time.Second)
			e.terminateAll()
			r := e.report("redis-failover-"+tc.name, nil, tc.replicas == 0)

			completedBefore := e.count(`SELECT count(DISTINCT op_id) FROM completions WHERE at < $1`, killedAt)
			figures := fmt.Sprintf("failover replicas=%d ops=%d completed_before_kill=%d applied_at_kill=%d promoted_after=%v reexecuted=%d ran_again_after_completion=%d absorbed=%d stale_rejected=%d",
				tc.replicas, nOps, completedBefore, appliedAtKill, promotedAfter.Round(100*time.Millisecond), r.Reexecuted, r.AfterComplete, r.Absorbed, r.StaleRejected)
			e.figures(figures)
			if completedBefore == 0 || completedBefore >= nOps {
				t.Errorf("%d of %d operations completed before the kill: the failover must come mid-run", completedBefore, nOps)
			}
		})
	}
}
