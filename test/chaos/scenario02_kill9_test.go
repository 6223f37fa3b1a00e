//go:build linux

package chaos_test

import (
	"context"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 2, kill -9: four supervised consumer processes, some operations
// planned to crash their process (SIGKILL, once) in each crash window, and
// kill -9 of random consumers at random moments on top.
//
//   - before the side effect: the handler runs again after the lease
//     expires; one effect.
//   - after the side effect, before the record is completed: the window no
//     lease can close. The handler runs again and writes again; the ledger
//     absorbs the second write (reexecuted, never duplicated).
//   - after the record is completed, before the ack: the redelivery is a
//     duplicate; the handler never runs again.
//
// Every consumer records its store's history, and the merged history is
// checked for linearizability at the end (chaos-kill9).
func TestChaos02Kill9(t *testing.T) {
	e := newEnv(t, envOptions{})
	nOps, perWindow, kills := pick(400, 3000), pick(3, 10), pick(4, 15)
	windows := []string{workload.BeforeEffect, workload.AfterEffect, workload.AfterComplete}

	ops := workload.Storm(e.name+"-op", nOps, 2, 100, e.rng)
	for i, w := range windows {
		for j := range perWindow {
			ops[i*perWindow+j].Plan.Crash = w
		}
	}
	e.recordHistory()
	sup := e.supervise(4, "-lease", "2s", "-in-progress-delay", "300ms", "-max-attempts", "20", "-concurrency", "4")
	e.publish(ops)

	killed := 0
	for killed < kills && e.applied() < nOps {
		time.Sleep(time.Duration(300+e.rng.IntN(700)) * time.Millisecond)
		live := sup.live()
		if len(live) == 0 {
			continue
		}
		live[e.rng.IntN(len(live))].kill()
		killed++
	}
	e.settle(nOps, pick(4*time.Minute, 8*time.Minute), 2*time.Second)
	restarts, err := sup.halt()
	if err != nil {
		t.Errorf("restarting consumers: %v", err)
	}
	e.terminateAll()
	r := e.report("kill9", nil, false)
	e.checkHistory("kill9", redisClock)
	t.Logf("kill9: %d external kill -9, %d crash windows taken, %d restarts", killed, r.Crashes, restarts)

	// Every planned window is normally taken; a kill -9 that lands between
	// an after-complete operation's Complete and its crash leaves that one
	// out, so only "at least one per window" is required.
	taken := map[string]int{}
	// Each window, checked on the execution that crashed in it.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := e.led.Pool().Query(ctx, `SELECT c.op_id, c.win, c.fence,
		(SELECT count(*) FROM effects f WHERE f.exec_id = c.exec_id),
		(SELECT count(*) FROM effects f WHERE f.op_id = c.op_id AND f.absorbed),
		(SELECT count(*) FROM completions m WHERE m.op_id = c.op_id AND m.fence = c.fence),
		(SELECT count(*) FROM executions x WHERE x.op_id = c.op_id AND x.fence > c.fence)
		FROM crashes c ORDER BY c.win, c.op_id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var op, win string
		var fence int64
		var ownEffects, absorbed, completed, later int
		if err := rows.Scan(&op, &win, &fence, &ownEffects, &absorbed, &completed, &later); err != nil {
			t.Fatal(err)
		}
		taken[win]++
		switch win {
		case workload.BeforeEffect:
			if ownEffects != 0 || later == 0 {
				t.Errorf("%s crashed %s (fence %d): its effects %d, later executions %d; want 0 and at least 1",
					op, win, fence, ownEffects, later)
			}
		case workload.AfterEffect:
			if ownEffects != 1 || later == 0 || absorbed == 0 {
				t.Errorf("%s crashed %s (fence %d): its effects %d, later executions %d, absorbed writes %d; want 1, >=1, >=1",
					op, win, fence, ownEffects, later, absorbed)
			}
		case workload.AfterComplete:
			if completed != 1 || later != 0 {
				t.Errorf("%s crashed %s (fence %d): completed %d, later executions %d; want 1 and 0",
					op, win, fence, completed, later)
			}
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, w := range windows {
		if taken[w] == 0 {
			t.Errorf("crash window %s was never taken (taken: %v)", w, taken)
		}
	}
	t.Logf("kill9: crash windows taken %v (planned %d each)", taken, perWindow)
}
