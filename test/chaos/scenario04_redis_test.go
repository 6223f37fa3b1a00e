//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 4a, Redis paused: CLIENT PAUSE on the consumers' (throwaway)
// Redis for longer than the lease TTL while handlers run. The keeper cannot
// confirm their leases: their contexts are cancelled before the leases'
// deadlines, and their messages are requeued and applied later.
func TestChaos04RedisPause(t *testing.T) {
	e := newEnv(t, envOptions{})
	const ttl = 3 * time.Second
	nOps, nLong, pauses := pick(100, 600), 4, pick(1, 3)
	for i := range 2 {
		e.consumer(fmt.Sprintf("%s-c%d", e.name, i), "-lease", ttl.String(), "-in-progress-delay", "300ms",
			"-unavailable-delay", "300ms", "-redis-timeout", "500ms", "-concurrency", "16")
	}
	// Work up to 4 s: longer than a lease TTL, so that handlers are still
	// running when their unconfirmed leases near their deadlines.
	ops := workload.Storm(e.name+"-op", nOps, 1, 4000, e.rng)
	e.publish(ops)
	rdb := e.redis.Client(t)
	total := nOps
	for i := range pauses {
		want := nOps * (i + 1) / (pauses + 2)
		e.waitFor(fmt.Sprintf("%d operations applied", want), 3*time.Minute,
			func() bool { return e.applied() >= want }, nil)
		// A few handlers certain to outlive their leases in the pause.
		long := workload.Storm(fmt.Sprintf("%s-long%d-", e.name, i), nLong, 1, 0, e.rng)
		for j := range long {
			long[j].Plan.WorkMS = 10_000
		}
		e.publish(long)
		total += nLong
		e.waitFor("the long handlers to start", time.Minute, func() bool {
			return e.count(`SELECT count(*) FROM executions WHERE op_id LIKE $1`, fmt.Sprintf("%%-long%d-%%", i)) >= nLong
		}, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := rdb.Do(ctx, "CLIENT", "PAUSE", (2 * ttl).Milliseconds(), "ALL").Err()
		cancel()
		if err != nil {
			t.Fatalf("CLIENT PAUSE: %v", err)
		}
		t.Logf("redis-pause: paused for %v with %d operations applied", 2*ttl, e.applied())
		time.Sleep(2*ttl + time.Second)
	}
	e.settle(total, 4*time.Minute, 2*time.Second)
	e.terminateAll()
	e.report("redis-pause", nil, false)

	unconfirmed := e.count(`SELECT count(*) FROM executions WHERE cause LIKE '%not confirmed%'`)
	early := e.count(`SELECT count(*) FROM executions WHERE cause LIKE '%not confirmed%' AND deadline_left_ms > 0`)
	minLeft := e.count(`SELECT coalesce(min(deadline_left_ms), 0) FROM executions WHERE cause LIKE '%not confirmed%'`)
	t.Logf("redis-pause: %d handlers cancelled for an unconfirmed lease, %d of them before the lease's deadline (least margin left %d ms)",
		unconfirmed, early, minLeft)
	if unconfirmed == 0 {
		t.Errorf("no handler was cancelled for an unconfirmed lease while Redis was paused")
	}
	if early != unconfirmed {
		t.Errorf("%d of %d handlers were cancelled after their lease's deadline", unconfirmed-early, unconfirmed)
	}
	requeued := 0
	for _, ev := range e.events() {
		if ev.Outcome == "abandoned" {
			requeued++
		}
	}
	if requeued == 0 {
		t.Errorf("no message was requeued (abandoned) while Redis was paused")
	}
}

// Scenario 4b, Redis restarted: the consumers' Redis is killed (SIGKILL)
// and started again mid-run, then every operation is published once more
// (a producer resending). Without persistence the restart forgets every
// completed record, and the resent operations run again: the ledger absorbs
// them. With appendonly everysec the records survive a crash of the
// process. The figures go to the log and to CHAOS_RESULTS.
func TestChaos04RedisRestart(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"none", nil},
		{"aof", []string{"--appendonly", "yes", "--appendfsync", "everysec"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{redisArgs: tc.args})
			nOps := pick(300, 2000)
			for i := range 2 {
				e.consumer(fmt.Sprintf("%s-c%d", e.name, i), "-lease", "2s", "-in-progress-delay", "300ms",
					"-unavailable-delay", "300ms", "-redis-timeout", "500ms", "-concurrency", "8")
			}
			ops := workload.Storm(e.name+"-op", nOps, 1, 40, e.rng)
			e.publish(ops)
			e.waitFor("half the operations applied", 3*time.Minute,
				func() bool { return e.applied() >= nOps/2 }, nil)
			restartAt := time.Now()
			e.redis.Stop()
			time.Sleep(time.Second)
			e.redis.Start()
			appliedAtRestart := e.applied()
			e.settle(nOps, 4*time.Minute, 2*time.Second)

			e.publishCopies(ops) // every operation again, after the restart
			e.waitDrained(4*time.Minute, 2*time.Second)
			e.terminateAll()
			r := e.report("redis-restart-"+tc.name, nil, true)

			completedBefore := e.count(`SELECT count(DISTINCT op_id) FROM completions WHERE at < $1`, restartAt)
			rerunAfterDone := e.count(`SELECT count(DISTINCT x.op_id) FROM executions x
				JOIN (SELECT op_id, min(at) AS at FROM completions GROUP BY op_id) c USING (op_id)
				WHERE x.acquired_at > c.at`)
			figures := fmt.Sprintf("restart persistence=%s ops=%d completed_before_restart=%d applied_at_restart=%d reexecuted=%d ran_again_after_completion=%d absorbed=%d stale_rejected=%d",
				tc.name, nOps, completedBefore, appliedAtRestart, r.Reexecuted, rerunAfterDone, r.Absorbed, r.StaleRejected)
			e.figures(figures)
		})
	}
}
