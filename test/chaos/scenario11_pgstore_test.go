//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenarios 11a-11e: the PostgreSQL store (pgstore, issue 11), whose
// transactional handler commits the handler's effect and the completed
// record in one transaction. The effect is a plain INSERT per execution
// with no unique key (worker.EffectsTable): nothing in the sink absorbs a
// second execution, so lost=0 and duplicated=0 hold only if the
// transaction does. See pgRun and README.md.

// Scenario 11a, kill -9: four supervised consumers on pgstore, kill -9 of
// random consumers at random moments, restarted. A killed process's open
// transactions roll back with its connections; the redeliveries run again.
// Every consumer records its store's history (leases held by
// transactions, and record-row leases for redeliveries), and the merged
// history is checked for linearizability at the end (chaos-pg-kill9).
func TestChaos11PGKill9(t *testing.T) {
	r, _ := newPGRun(t, false)
	nOps, kills := pick(250, 3000), pick(3, 15)
	ops := workload.Storm(r.name+"-op", nOps, 2, 200, r.rng)
	r.recordHistory()
	sup := r.supervise(4, r.flags(append(pgFlags, "-concurrency", "4")...)...)
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
	p := r.report("pg-kill9", fmt.Sprintf(" kills=%d restarts=%d", killed, restarts))
	r.checkHistory("pg-kill9", pgClock)
	t.Logf("pg-kill9: %d kill -9, %d restarts; %d executions left no effect (killed, or their transaction rolled back)",
		killed, restarts, p.Uncommitted)
	if killed == 0 {
		t.Errorf("pg-kill9: every operation was applied before the first kill -9: the scenario tested nothing")
	}
}

// Scenario 11b, crash windows: operations planned to kill their own
// process (SIGKILL, once) in each window of the transactional handler:
//
//   - in-tx: after the effect's INSERT, before the commit. The transaction
//     never commits: the crashed execution left no row, a later one (with
//     a higher fence) committed the only one.
//   - after-commit: after the commit (effect and completed record), before
//     the ack. The redelivery is a duplicate: the crashed execution's row
//     is the only one, and no execution came after it.
func TestChaos11PGCrashWindows(t *testing.T) {
	r, _ := newPGRun(t, false)
	nOps, perWindow := pick(60, 1000), pick(3, 10)
	windows := []string{workload.InTx, workload.AfterCommit}
	ops := workload.Storm(r.name+"-op", nOps, 2, 50, r.rng)
	for i, w := range windows {
		for j := range perWindow {
			ops[i*perWindow+j].Plan.Crash = w
		}
	}
	// One handler per process: a crash takes only its own execution down,
	// so that every planned window is taken.
	sup := r.supervise(4, r.flags(append(pgFlags, "-prefetch", "1", "-concurrency", "1")...)...)
	r.publish(ops)
	r.logf("published")
	r.settle(nOps, pick(3*time.Minute, 6*time.Minute), time.Second)
	restarts, err := sup.halt()
	if err != nil {
		t.Errorf("restarting consumers: %v", err)
	}
	r.terminateAll()

	type crash struct {
		op, win, exec        string
		fence                int64
		completedWith, later int
	}
	var crashes []crash
	taken := map[string]int{}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := r.led.Pool().Query(ctx, `SELECT c.op_id, c.win, c.exec_id, c.fence,
		(SELECT count(*) FROM completions m WHERE m.op_id = c.op_id AND m.fence = c.fence),
		(SELECT count(*) FROM executions x WHERE x.op_id = c.op_id AND x.fence > c.fence)
		FROM crashes c ORDER BY c.win, c.op_id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var c crash
		if err := rows.Scan(&c.op, &c.win, &c.exec, &c.fence, &c.completedWith, &c.later); err != nil {
			t.Fatal(err)
		}
		crashes = append(crashes, c)
		taken[c.win]++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	p := r.report("pg-crash", fmt.Sprintf(" in_tx_crashes=%d after_commit_crashes=%d restarts=%d",
		taken[workload.InTx], taken[workload.AfterCommit], restarts))

	for _, c := range crashes {
		own := 0
		for _, x := range p.effects[c.op] {
			if x == c.exec {
				own++
			}
		}
		rowsOfOp := len(p.effects[c.op])
		switch c.win {
		case workload.InTx:
			if own != 0 || c.later == 0 || rowsOfOp != 1 {
				t.Errorf("%s crashed %s (fence %d): its effect rows %d, later executions %d, effect rows of the operation %d; want 0, >=1, 1",
					c.op, c.win, c.fence, own, c.later, rowsOfOp)
			}
		case workload.AfterCommit:
			if own != 1 || c.later != 0 || c.completedWith != 1 || rowsOfOp != 1 {
				t.Errorf("%s crashed %s (fence %d): its effect rows %d, later executions %d, completions with its fence %d, effect rows of the operation %d; want 1, 0, 1, 1",
					c.op, c.win, c.fence, own, c.later, c.completedWith, rowsOfOp)
			}
		default:
			t.Errorf("%s: unexpected crash window %q", c.op, c.win)
		}
	}
	for _, w := range windows {
		if taken[w] != perWindow {
			t.Errorf("crash window %s taken %d times, planned %d", w, taken[w], perWindow)
		}
	}
	t.Logf("pg-crash: crash windows taken %v (planned %d each), %d restarts", taken, perWindow, restarts)
}

// Scenario 11c, SIGSTOP past the lease with the transaction open: consumer
// A takes operations whose handlers insert their effect and then stall
// (ignoring their context) with the transaction open, and is stopped for
// three lease TTLs. B takes the operations over (a higher fence) and
// commits them. A is continued: its handlers return success, and pgstore's
// compare-and-set on owner and fence must refuse A's completion, rolling
// A's effect back with it (stale_rolled_back counts them). This is the
// record-row lease (-row-leases); TestChaos11PGSigstopHeld is the lease
// held by the transaction.
func TestChaos11PGSigstop(t *testing.T) { pgSigstop(t, false) }

// Scenario 11c with the lease held by the handler's transaction: the
// same run, but A's transactions are ended by the server (idle for the
// lease's TTL) while A is stopped: none is open when B has committed, and
// A's handlers, continued, fail to commit (stale_rolled_back counts them).
func TestChaos11PGSigstopHeld(t *testing.T) { pgSigstop(t, true) }

// pgSigstop is scenario 11c, with leases held by the transactions when held
// is set, else record-row leases.
func pgSigstop(t *testing.T, held bool) {
	r, _ := newPGRun(t, false)
	ttl := time.Second
	if held {
		// Long enough for the test to see A's transactions open before
		// the server ends them (it polls every 200 ms).
		ttl = 3 * time.Second
	}
	nVictims, nOther := pick(3, 10), pick(100, 1000)
	flags := append(append([]string(nil), pgFlags...), "-lease", ttl.String(), "-heartbeat", "30s")
	if !held {
		flags = append(flags, "-row-leases")
	}

	victims := make([]workload.Op, nVictims)
	for i := range victims {
		victims[i] = workload.Op{ID: fmt.Sprintf("%s-victim%d", r.name, i), Plan: workload.Plan{Stall: true, StallMS: 120_000}}
	}
	nameA, nameB := r.name+"-a", r.name+"-b"
	appA := nameA + "-store"
	n := fmt.Sprint(nVictims)
	// A's prefetch is exactly the victims (a stopped process keeps every
	// delivery pushed to it); its store connections have a name of their
	// own, to watch its open transactions.
	a := r.consumer(nameA, r.flags(append(flags, "-prefetch", n, "-concurrency", n, "-store-app", appA)...)...)
	r.publish(victims)
	openTx := func() int {
		return r.storeCount(`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1
			AND state = 'idle in transaction' AND query LIKE 'INSERT INTO pg_effects%'`, appA)
	}
	r.waitFor("A to hold every victim's transaction open after its INSERT", time.Minute, func() bool {
		return openTx() == nVictims
	}, func() string { return fmt.Sprintf("(%d open)", openTx()) })

	a.pause()
	r.logf("A stopped")
	stoppedAt := time.Now()
	time.Sleep(3 * ttl)
	r.consumer(nameB, r.flags(append(flags, "-concurrency", "8")...)...)
	r.publishCopies(victims) // the copies B takes over with (A still holds the originals)
	others := workload.Storm(r.name+"-op", nOther, 2, 20, r.rng)
	r.publish(others)
	r.waitFor("B to commit every victim", 2*time.Minute, func() bool {
		return r.storeCount(`SELECT count(DISTINCT op_id) FROM pg_effects WHERE consumer = $1 AND op_id LIKE '%victim%'`, nameB) == nVictims
	}, nil)
	openAtTakeover := openTx()
	a.resume()
	r.logf("B committed every victim; A continued")
	stopped := time.Since(stoppedAt)
	t.Logf("pg-sigstop: A (pid %d) stopped for %v; %d of its transactions were open when B had committed every victim",
		a.pid(), stopped.Round(time.Millisecond), openAtTakeover)

	r.waitFor("A's stale handlers to end", 2*time.Minute, func() bool {
		return r.count(`SELECT count(*) FROM executions WHERE consumer = $1 AND op_id LIKE '%victim%' AND finished_at IS NOT NULL`, nameA) == nVictims
	}, nil)
	r.logf("A's stale handlers ended")
	r.settle(nVictims+nOther, 3*time.Minute, time.Second)
	r.terminateAll()
	// A record-row lease's stale completion is refused by the
	// compare-and-set; a held one's transaction is gone with its session.
	stale := "failed after-effect lease-lost:%"
	name, wantOpen := "pg-sigstop", nVictims
	if held {
		stale, name, wantOpen = "failed after-effect %", "pg-sigstop-held", 0
	}
	staleRolledBack := r.count(`SELECT count(*) FROM executions WHERE consumer = $1 AND op_id LIKE '%victim%'
		AND result LIKE $2`, nameA, stale)
	p := r.report(name, fmt.Sprintf(" stale_rolled_back=%d open_tx_at_takeover=%d stopped_ms=%d",
		staleRolledBack, openAtTakeover, stopped.Milliseconds()))

	if openAtTakeover != wantOpen {
		t.Errorf("A had %d transactions open when B had committed the victims, want %d", openAtTakeover, wantOpen)
	}
	if staleRolledBack != nVictims {
		t.Errorf("stale transactions rolled back by the compare-and-set: got %d, want %d", staleRolledBack, nVictims)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := r.led.Pool().Query(ctx, `SELECT op_id, exec_id, fence, coalesce(cause, ''), coalesce(result, '') FROM executions
		WHERE consumer = $1 AND op_id LIKE '%victim%' ORDER BY op_id`, nameA)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var op, exec, cause, result string
		var fence int64
		if err := rows.Scan(&op, &exec, &fence, &cause, &result); err != nil {
			t.Fatal(err)
		}
		for _, x := range p.effects[op] {
			if x == exec {
				t.Errorf("%s: the stale holder A's effect (fence %d) was committed", op, fence)
			}
		}
		t.Logf("pg-sigstop: %s: A's handler, fence %d, context cancelled with %q; ended: %s", op, fence, cause, result)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n := r.count(`SELECT count(*) FROM completions WHERE consumer = $1 AND op_id LIKE '%victim%'`, nameA); n != 0 {
		t.Errorf("pgstore committed %d completions of the stale consumer A", n)
	}
	for _, ev := range r.events() {
		if ev.Consumer == nameA && strings.Contains(ev.Op, "victim") {
			if ev.Outcome == "completed" {
				t.Errorf("%s: the stale consumer A acked it as completed (fence %d)", ev.Op, ev.Fence)
			}
			t.Logf("pg-sigstop: A's outcome for %s: %s %q fence %d: %s", ev.Op, ev.Outcome, ev.Reason, ev.Fence, ev.Err)
		}
	}
}

// Scenario 11d, database connections terminated: every few hundred
// milliseconds, pg_terminate_backend on every connection of the
// consumers' store pools (found by their application_name; no other
// backend is touched), while handlers hold their transactions open. The
// consumers must survive, reconnect and lose or duplicate nothing.
func TestChaos11PGTerminate(t *testing.T) {
	r, _ := newPGRun(t, false)
	nOps, maxRounds, consumers := pick(200, 3000), pick(4, 25), 3
	for i := range consumers {
		r.consumer(fmt.Sprintf("%s-c%d", r.name, i), r.flags(append(pgFlags, "-concurrency", "4")...)...)
	}
	ops := workload.Storm(r.name+"-op", nOps, 2, 200, r.rng)
	r.publish(ops)
	r.logf("published")

	rounds, terminated, openTx := 0, 0, 0
	deadline := time.Now().Add(pick(2*time.Minute, 6*time.Minute))
	for rounds < maxRounds && time.Now().Before(deadline) {
		time.Sleep(time.Duration(300+r.rng.IntN(500)) * time.Millisecond)
		n, err := r.applied()
		if err != nil {
			t.Fatal(err)
		}
		if n >= nOps {
			break
		}
		k, x := r.terminateBackends(r.app)
		rounds++
		terminated += k
		openTx += x
	}
	r.settle(nOps, pick(3*time.Minute, 8*time.Minute), time.Second)
	if live := len(r.live()); live != consumers {
		t.Errorf("%d of %d consumers still running; terminated connections must not end them", live, consumers)
	}
	r.terminateAll()
	r.report("pg-terminate", fmt.Sprintf(" rounds=%d terminated=%d open_tx=%d", rounds, terminated, openTx))
	t.Logf("pg-terminate: %d rounds, %d backends terminated, %d of them idle in an open transaction", rounds, terminated, openTx)
	if terminated == 0 || openTx == 0 {
		t.Errorf("pg-terminate: %d backends terminated, %d in an open transaction: the scenario must hit open handler transactions",
			terminated, openTx)
	}
}

// terminateBackends terminates every client backend whose application_name
// is app (never the test's own, nor anyone else's) and returns how many it
// terminated and how many of them were idle in an open transaction.
func (r *pgRun) terminateBackends(app string) (terminated, openTx int) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := r.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE t), count(*) FILTER (WHERE t AND open_tx)
		FROM (SELECT pg_terminate_backend(pid) AS t, state LIKE 'idle in transaction%' AS open_tx
		        FROM pg_stat_activity
		       WHERE application_name = $1 AND backend_type = 'client backend' AND pid <> pg_backend_pid()) s`,
		app).Scan(&terminated, &openTx)
	if err != nil {
		r.t.Fatalf("terminating the consumers' backends: %v", err)
	}
	return terminated, openTx
}

// Scenario 11e, PostgreSQL restarted: the store's database is a private
// server (startPGServer; the shared one is never restarted), stopped
// mid-run, immediately (SIGQUIT: no checkpoint, crash recovery at the next
// start) and in full mode later also fast (SIGINT), each time started
// again a second later. Every operation committed before a stop is then
// published once more: its record survived the crash, so the copy is a
// duplicate (after_complete=0), never run again.
func TestChaos11PGRestart(t *testing.T) {
	r, srv := newPGRun(t, true)
	nOps := pick(200, 2000)
	for i := range 2 {
		r.consumer(fmt.Sprintf("%s-c%d", r.name, i), r.flags(append(pgFlags, "-concurrency", "8")...)...)
	}
	ops := workload.Storm(r.name+"-op", nOps, 1, 200, r.rng)
	byID := map[string]workload.Op{}
	for _, o := range ops {
		byID[o.ID] = o
	}
	r.publish(ops)
	r.logf("published")

	type mode struct {
		name string
		sig  syscall.Signal
	}
	modes := pick([]mode{{"immediate", syscall.SIGQUIT}}, []mode{{"immediate", syscall.SIGQUIT}, {"fast", syscall.SIGINT}})
	committed := map[string]bool{} // operations committed before a stop
	openTx := 0
	for i, m := range modes {
		r.waitApplied(nOps*(i+1)/(len(modes)+1), 3*time.Minute)
		open := r.storeCount(`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state LIKE 'idle in transaction%'`, r.app)
		openTx += open
		var again []workload.Op
		for _, id := range r.committedOps() {
			if !committed[id] {
				committed[id] = true
				again = append(again, byID[id])
			}
		}
		srv.Restart(m.sig, time.Second)
		r.logf("PostgreSQL stopped (%s) and started again with %d operations committed, %d handler transactions open",
			m.name, len(committed), open)
		r.publishCopies(again) // must be duplicates: their records survived
	}
	r.settle(nOps, 4*time.Minute, time.Second)
	r.terminateAll()
	r.report("pg-restart", fmt.Sprintf(" restarts=%d committed_before_restart=%d open_tx_at_stop=%d",
		len(modes), len(committed), openTx))

	if len(committed) == 0 {
		t.Errorf("pg-restart: no operation had committed before the restart")
	}
	d := 0
	for _, ev := range r.events() {
		if ev.Outcome == "duplicate" {
			d++
		}
	}
	if d < len(committed) {
		t.Errorf("pg-restart: %d duplicates acked, want at least the %d copies of operations committed before a restart", d, len(committed))
	}
}

// committedOps returns the operations with an effect row: those committed.
func (r *pgRun) committedOps() []string {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := r.pool.Query(ctx, `SELECT DISTINCT op_id FROM `+worker.EffectsTable)
	if err != nil {
		r.t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		r.t.Fatal(err)
	}
	return ids
}
