//go:build linux

package chaos_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenarios 17a-17b: the DynamoDB store (dynamostore, issue 25), whose
// TxHandler sends the handler's writes and the record's completion in one
// TransactWriteItems. The effect is a plain Put of one item per execution,
// with no condition (worker.DynamoEffectKey): nothing in the sink absorbs
// a second execution, so lost=0 and duplicated=0 hold only if the
// transaction does. Each scenario runs once per DynamoDB server of the
// tests (testenv.EachDynamo: minidyn from scripts/dynamo.sh, then Amazon's
// DynamoDB Local from scripts/dynamodb-local.sh), one after the other, and
// its line names the server (scenario dynamo-kill9/minidyn, ...); each run
// makes its own two tables and deletes them. See dynRun and README.md.

// Scenario 17a, kill -9: four supervised consumers on dynamostore, kill -9
// of random consumers at random moments, restarted. A killed process's
// transactions were sent whole or not at all; the redeliveries of its
// messages wait for its leases to expire (lease TTL plus the store's
// MaxClockSkew) and run again.
func TestChaos17DynamoKill9(t *testing.T) {
	testenv.EachDynamo(t, func(t *testing.T, srv testenv.DynamoServer) {
		r := newDynRun(t, srv)
		nOps, kills := pick(200, 2000), pick(3, 12)
		ops := workload.Storm(r.name+"-op", nOps, 2, 200, r.rng)
		sup := r.supervise(4, r.flags(append(dynFlags, "-concurrency", "4")...)...)
		r.publish(ops)
		r.logf("published")

		killed := 0
		deadline := time.Now().Add(pick(2*time.Minute, 6*time.Minute))
		for killed < kills && time.Now().Before(deadline) {
			time.Sleep(time.Duration(300+r.rng.IntN(700)) * time.Millisecond)
			n, err := r.applied()
			if err != nil {
				t.Fatal(err)
			}
			if n >= nOps {
				break
			}
			live := sup.live()
			if len(live) == 0 {
				continue
			}
			live[r.rng.IntN(len(live))].kill()
			killed++
		}
		r.settle(nOps, pick(3*time.Minute, 8*time.Minute), time.Second)
		restarts, err := sup.halt()
		if err != nil {
			t.Errorf("restarting consumers: %v", err)
		}
		r.terminateAll()
		p := r.report("dynamo-kill9", fmt.Sprintf(" kills=%d restarts=%d", killed, restarts))
		t.Logf("dynamo-kill9: %d kill -9, %d restarts; %d executions left no effect (killed before their transaction, or it was cancelled)",
			killed, restarts, p.Uncommitted)
		if killed == 0 {
			t.Errorf("dynamo-kill9: every operation was applied before the first kill -9: the scenario tested nothing")
		}
	})
}

// Scenario 17b, SIGSTOP past the lease with the effect in the
// transaction: consumer A takes operations whose handlers add their effect
// to the Tx and then stall (ignoring their context), and is stopped for
// three lease TTLs. B takes the operations over (a higher fence, once the
// lease TTL and MaxClockSkew have passed) and commits them. A is
// continued: its handlers return success, and the record's condition on
// owner and fence must make DynamoDB cancel A's transactions, its effect
// items with them (stale_rolled_back counts them).
func TestChaos17DynamoSigstop(t *testing.T) {
	testenv.EachDynamo(t, func(t *testing.T, srv testenv.DynamoServer) {
		r := newDynRun(t, srv)
		const ttl = time.Second
		nVictims, nOther := pick(3, 10), pick(100, 1000)
		flags := append(append([]string(nil), dynFlags...), "-lease", ttl.String(), "-heartbeat", "30s")

		victims := make([]workload.Op, nVictims)
		for i := range victims {
			victims[i] = workload.Op{ID: fmt.Sprintf("%s-victim%d", r.name, i), Plan: workload.Plan{Stall: true, StallMS: 120_000}}
		}
		nameA, nameB := r.name+"-a", r.name+"-b"
		n := fmt.Sprint(nVictims)
		// A's prefetch is exactly the victims (a stopped process keeps every
		// delivery pushed to it).
		a := r.consumer(nameA, r.flags(append(flags, "-prefetch", n, "-concurrency", n)...)...)
		r.publish(victims)
		stalled := func() int { return strings.Count(a.output(), "with its effect in the transaction") }
		r.waitFor("A to stall every victim with its effect in the transaction", time.Minute, func() bool {
			return stalled() == nVictims
		}, func() string { return fmt.Sprintf("(%d stalled)", stalled()) })

		a.pause()
		r.logf("A stopped")
		stoppedAt := time.Now()
		time.Sleep(3 * ttl)
		r.consumer(nameB, r.flags(append(flags, "-concurrency", "8")...)...)
		r.publishCopies(victims) // the copies B takes over with (A still holds the originals)
		others := workload.Storm(r.name+"-op", nOther, 2, 20, r.rng)
		r.publish(others)
		r.waitFor("B to commit every victim", 2*time.Minute, func() bool {
			return r.count(`SELECT count(DISTINCT op_id) FROM completions WHERE consumer = $1 AND op_id LIKE '%victim%'`, nameB) == nVictims
		}, nil)
		a.resume()
		r.logf("B committed every victim; A continued")
		stopped := time.Since(stoppedAt)
		t.Logf("dynamo-sigstop: A (pid %d) stopped for %v with %d handlers stalled", a.pid(), stopped.Round(time.Millisecond), stalled())

		r.waitFor("A's stale handlers to end", 2*time.Minute, func() bool {
			return r.count(`SELECT count(*) FROM executions WHERE consumer = $1 AND op_id LIKE '%victim%' AND finished_at IS NOT NULL`, nameA) == nVictims
		}, nil)
		r.logf("A's stale handlers ended")
		r.settle(nVictims+nOther, 3*time.Minute, time.Second)
		r.terminateAll()
		staleRolledBack := r.count(`SELECT count(*) FROM executions WHERE consumer = $1 AND op_id LIKE '%victim%'
			AND result LIKE 'failed after-effect lease-lost:%'`, nameA)
		p := r.report("dynamo-sigstop", fmt.Sprintf(" stale_rolled_back=%d stopped_ms=%d", staleRolledBack, stopped.Milliseconds()))

		if staleRolledBack != nVictims {
			t.Errorf("stale transactions cancelled by the record's condition: got %d, want %d", staleRolledBack, nVictims)
		}
		for op, execs := range p.effects {
			if !strings.Contains(op, "victim") {
				continue
			}
			if len(execs) != 1 || !strings.HasPrefix(execs[0], nameB+".") {
				t.Errorf("%s: effect items of executions %v, want exactly one, of B", op, execs)
			}
		}
		if n := r.count(`SELECT count(*) FROM completions WHERE consumer = $1 AND op_id LIKE '%victim%'`, nameA); n != 0 {
			t.Errorf("dynamostore committed %d completions of the stale consumer A", n)
		}
		for _, ev := range r.events() {
			if ev.Consumer == nameA && strings.Contains(ev.Op, "victim") {
				if ev.Outcome == "completed" {
					t.Errorf("%s: the stale consumer A acked it as completed (fence %d)", ev.Op, ev.Fence)
				}
				t.Logf("dynamo-sigstop: A's outcome for %s: %s %q fence %d: %s", ev.Op, ev.Outcome, ev.Reason, ev.Fence, ev.Err)
			}
		}
	})
}
