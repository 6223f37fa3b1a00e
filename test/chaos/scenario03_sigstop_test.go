//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 3, SIGSTOP past the lease: consumer A holds some operations
// (their handlers stall, ignoring their context), is stopped for three
// lease TTLs, and consumer B takes the operations over with a higher fence
// and applies them. A is then continued: its handlers' contexts must have
// been cancelled, their late ledger writes are rejected by the fence check,
// the store refuses their Complete, and A never acks them as completed.
func TestChaos03SigstopPastLease(t *testing.T) {
	e := newEnv(t, envOptions{})
	const ttl = 2 * time.Second
	nVictims, nOther := pick(3, 10), pick(100, 1000)
	flags := []string{"-lease", ttl.String(), "-in-progress-delay", "300ms", "-heartbeat", "30s"}

	victims := make([]workload.Op, nVictims)
	for i := range victims {
		victims[i] = workload.Op{ID: fmt.Sprintf("%s-victim%d", e.name, i), Plan: workload.Plan{Stall: true, StallMS: 120_000}}
	}
	nameA, nameB := e.name+"-a", e.name+"-b"
	// A's prefetch is exactly the victims: a stopped process keeps every
	// delivery the broker pushed to it, and nothing else must wait for A.
	n := fmt.Sprint(nVictims)
	a := e.consumer(nameA, append(flags, "-prefetch", n, "-concurrency", n)...)
	e.publish(victims)
	e.waitFor("A to start every victim", time.Minute, func() bool {
		return e.count(`SELECT count(*) FROM executions WHERE consumer = $1 AND op_id LIKE '%victim%'`, nameA) == nVictims
	}, nil)

	a.pause()
	stoppedAt := time.Now()
	time.Sleep(3 * ttl)
	e.consumer(nameB, append(flags, "-concurrency", "16")...)
	e.publishCopies(victims) // the copies B takes over with (A still holds the originals)
	others := workload.Storm(e.name+"-op", nOther, 2, 20, e.rng)
	e.publish(others)
	e.waitFor("B to apply every victim", 2*time.Minute, func() bool {
		return e.count(`SELECT count(*) FROM applied a JOIN executions x USING (exec_id)
			WHERE x.consumer = $1 AND a.op_id LIKE '%victim%'`, nameB) == nVictims
	}, nil)
	a.resume()
	t.Logf("sigstop: A (pid %d) stopped for %v", a.pid(), time.Since(stoppedAt).Round(time.Millisecond))

	// A's stalled handlers now write late and return; their outcome events
	// follow.
	e.waitFor("A's stale handlers to finish", 2*time.Minute, func() bool {
		return e.count(`SELECT count(*) FROM executions WHERE consumer = $1 AND op_id LIKE '%victim%' AND finished_at IS NOT NULL`, nameA) == nVictims
	}, nil)
	e.waitFor("A to report the victims' outcomes", time.Minute, func() bool {
		n := 0
		for _, ev := range e.events() {
			if ev.Consumer == nameA && strings.Contains(ev.Op, "victim") && ev.Attempt == 1 {
				n++
			}
		}
		return n >= nVictims
	}, nil)
	e.settle(nVictims+nOther, 3*time.Minute, 2*time.Second)
	e.terminateAll()
	r := e.report("sigstop", nil, false)

	if got, want := r.StaleRejected, nVictims; got != want {
		t.Errorf("stale writes rejected: got %d, want %d", got, want)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := e.led.Pool().Query(ctx, `SELECT op_id, fence, coalesce(cause, ''), coalesce(result, '') FROM executions
		WHERE consumer = $1 AND op_id LIKE '%victim%' ORDER BY op_id`, nameA)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var op, cause, result string
		var fence int64
		if err := rows.Scan(&op, &fence, &cause, &result); err != nil {
			t.Fatal(err)
		}
		if cause == "" {
			t.Errorf("%s: A's handler (fence %d) was not cancelled by the time it wrote late", op, fence)
		}
		if result != ledger.Stale.String() {
			t.Errorf("%s: A's late write (fence %d): got %q, want it rejected as %q", op, fence, result, ledger.Stale)
		}
		t.Logf("sigstop: %s: A's handler, fence %d, cancelled with %q; late write %s", op, fence, cause, result)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n := e.count(`SELECT count(*) FROM completions WHERE consumer = $1 AND op_id LIKE '%victim%'`, nameA); n != 0 {
		t.Errorf("the store accepted %d completions from the stale consumer A", n)
	}
	for _, ev := range e.events() {
		if ev.Consumer != nameA || !strings.Contains(ev.Op, "victim") {
			continue
		}
		if ev.Outcome == "completed" {
			t.Errorf("%s: the stale consumer A acked it as completed (fence %d)", ev.Op, ev.Fence)
		}
		t.Logf("sigstop: A's outcome for %s: %s %q fence %d: %s", ev.Op, ev.Outcome, ev.Reason, ev.Fence, ev.Err)
	}
}
