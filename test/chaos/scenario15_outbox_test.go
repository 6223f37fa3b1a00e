//go:build linux

package chaos_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenarios 15a-15d: the consumer-side outbox (issue 23) in a two-stage
// pipeline. Stage A's handler does the operation's work and stages one
// message per operation (amqpidem.Stage) for stage B; it writes no ledger
// effect. Stage B writes the operation to the ledger: the fenced ledger on
// the Redis store (15a, 15b), pgstore's TxHandler with the plain,
// non-idempotent INSERT of scenario 11 (15c, 15d), where stage A stages in
// its TxHandler's transaction. Consumers of both stages are killed (kill
// -9) or stopped (SIGSTOP) at random. Every operation must reach stage B's
// ledger exactly once (lost=0 duplicated=0), whatever stage A published
// twice: a re-published message carries the same MessageId, a duplicate to
// stage B.
//
// Stage A publishes to an exchange of the run bound to stage B's queue and
// to a tap queue nobody consumes: the tap holds every raw copy stage B
// received (stageb_copies), read after the run. Besides the ledger, every
// operation is checked against stage A's record (read with lock.Admin):
//
//   - completed, its one staged message marked published;
//   - every raw copy stage B received is that message, byte for byte (body
//     and MessageId), staged by the execution whose outcome the record
//     holds (the body names its fence): no copy of a message staged by an
//     execution that failed, lost its lease or was never stored (no
//     phantom);
//   - the MessageId is the one stage A set (a quarter of the operations),
//     else one amqpidem derived, the same on every copy and distinct per
//     operation.

// stageKey is the routing key stage A stages with; the run's exchange
// routes it to stage B's queue and to the tap.
const stageKey = "b"

// outboxRun is one pipeline scenario: the env (stage A consumes its queue,
// stage B queueB), stage A's ledger (its executions, completions and crash
// claims, in a schema of its own), and, on pgstore, the pgRun.
type outboxRun struct {
	*env
	pg                            *pgRun // nil on the Redis store
	queueB, exchange, tap         string
	schemaA                       string
	ledA                          *ledger.Ledger
	flagsA, flagsB                []string
	nameA, nameB                  string // consumer name prefixes of the stages
	ops                           map[string]workload.Op
	failAfterStaging, stageWithID int
	// start is when the run was set up, for the timings in the log.
	start time.Time
}

// logf logs with the time since the run was set up.
func (o *outboxRun) logf(format string, args ...any) {
	o.t.Helper()
	o.t.Logf("[%5.1fs] "+format, append([]any{time.Since(o.start).Seconds()}, args...)...)
}

// outboxFlags are both stages' consumer flags on the Redis store (on
// pgstore, pgFlags'); both get outboxLease.
var outboxFlags = []string{"-in-progress-delay", "300ms", "-unavailable-delay", "300ms",
	"-backoff", "100ms", "-max-attempts", "20", "-concurrency", "4"}

// outboxLease is the consumers' lease TTL, and so the claim a stage A
// execution keeps on publishing what it stored.
const outboxLease = time.Second

// newOutboxRun sets a pipeline up, on pgstore when pg is set: stage A's
// ledger, the exchange, stage B's queue and the tap.
func newOutboxRun(t *testing.T, pg bool) *outboxRun {
	t.Helper()
	o := &outboxRun{ops: map[string]workload.Op{}, start: time.Now()}
	if pg {
		o.pg, _ = newPGRun(t, false)
		o.env = o.pg.env
	} else {
		o.env = newEnv(t, envOptions{})
		consumerBinary(t)
	}
	e := o.env
	o.queueB, o.exchange, o.tap = e.queue+".b", e.name+".stage", "tap."+e.name
	o.schemaA = schemaFor(e.name + "-a")
	o.nameA, o.nameB = e.name+"-a", e.name+"-b"

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ledger.Create(ctx, e.dsn, o.schemaA); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The consumers go first (the env's cleanup, which runs after this
		// one, checks their output): on pgstore, a stage A consumer holds
		// rows of this schema in its transactions.
		e.mu.Lock()
		procs := append([]*proc(nil), e.procs...)
		e.mu.Unlock()
		for _, p := range procs {
			p.resume()
			p.kill()
		}
		if os.Getenv("CHAOS_KEEP") == "1" {
			t.Logf("chaos: CHAOS_KEEP=1: stage A's ledger schema %s kept", o.schemaA)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := ledger.Drop(ctx, e.dsn, o.schemaA); err != nil {
			t.Errorf("dropping stage A's ledger: %v", err)
		}
	})
	var err error
	if o.ledA, err = ledger.Open(ctx, e.dsn, o.schemaA, 4); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(o.ledA.Close)

	ch := e.pub.Channel()
	e.ownExchange(o.exchange)
	e.ownQueue(o.queueB)
	e.ownQueue(o.tap)
	if err := ch.ExchangeDeclare(o.exchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		t.Fatalf("declare %s: %v", o.exchange, err)
	}
	for _, q := range []string{o.queueB, o.tap} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatalf("declare %s: %v", q, err)
		}
		if err := ch.QueueBind(q, stageKey, o.exchange, false, nil); err != nil {
			t.Fatalf("bind %s: %v", q, err)
		}
	}

	stageA := []string{"-schema", o.schemaA, "-stage-to", stageKey, "-stage-exchange", o.exchange}
	stageB := []string{"-queue", o.queueB}
	if pg {
		// Stage A's records live in its schema, beside its ledger; stage
		// B's in the env's, beside the effects table.
		if err := pgstore.Migrate(ctx, o.pg.pool, worker.StoreConfig(e.name, o.schemaA, 0)); err != nil {
			t.Fatal(err)
		}
		common := o.pg.flags(append(append([]string(nil), pgFlags...), "-concurrency", "4", "-lease", outboxLease.String())...)
		o.flagsA = append(append([]string(nil), common...), stageA...)
		o.flagsB = append(append([]string(nil), common...), stageB...)
	} else {
		common := append(append([]string(nil), outboxFlags...), "-lease", outboxLease.String())
		o.flagsA = append(append([]string(nil), common...), stageA...)
		o.flagsB = append(append([]string(nil), common...), stageB...)
	}
	return o
}

// outboxOps makes n operations named <env>-<kind>0 … for stage A, each in
// 1 or 2 copies with up to maxWorkMS of work, whose staged message plans up
// to 50 ms of work at stage B; a quarter set the staged message's
// MessageId themselves (<operation>.b). The first of them get windows
// (each perWindow times), then failAfter fail their first execution after
// staging.
func (o *outboxRun) outboxOps(kind string, n, maxWorkMS int, windows []string, perWindow, failAfter int) []workload.Op {
	ops := workload.Storm(o.name+"-"+kind, n, 2, maxWorkMS, o.rng)
	for i := range ops {
		ops[i].Plan.Next = &workload.Plan{WorkMS: o.rng.IntN(51)}
		if i%4 == 3 {
			ops[i].Plan.StageID = ops[i].ID + ".b"
		}
	}
	i := 0
	for _, w := range windows {
		for range perWindow {
			ops[i].Plan.Crash = w
			i++
		}
	}
	for range failAfter {
		ops[i].Plan.FailUntil = 2
		i++
	}
	return ops
}

// publish records ops in both stages' ledgers and publishes their copies
// to stage A.
func (o *outboxRun) publish(ops []workload.Op) {
	o.t.Helper()
	recs := make([]ledger.Op, len(ops))
	for i, op := range ops {
		recs[i] = ledger.Op{ID: op.ID, Expect: ledger.ExpectApply}
		if _, dup := o.ops[op.ID]; dup {
			o.t.Fatalf("operation %s published twice as new", op.ID)
		}
		o.ops[op.ID] = op
		if op.Plan.StageID != "" {
			o.stageWithID++
		}
		if op.Plan.FailUntil > 1 {
			o.failAfterStaging++
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := o.ledA.AddOps(ctx, recs); err != nil {
		o.t.Fatal(err)
	}
	o.env.publish(ops)
}

// appliedB returns how many operations stage B applied.
func (o *outboxRun) appliedB() int {
	o.t.Helper()
	if o.pg == nil {
		return o.applied()
	}
	n, err := o.pg.applied()
	if err != nil {
		o.t.Fatal(err)
	}
	return n
}

// settle waits until stage B applied want operations and every queue of
// the run (stage A's, stage B's, their delay queues) has drained.
func (o *outboxRun) settle(want int, timeout time.Duration) {
	o.t.Helper()
	if o.pg == nil {
		o.env.settle(want, timeout, time.Second)
		return
	}
	o.pg.settle(want, timeout, time.Second)
}

// tapCopy is one raw copy of a message, as a tap queue holds it: one
// stage B received (scenario 15; plan is its body's), one a relay
// published (drainTap: plan not read).
type tapCopy struct {
	id   string // MessageId
	body []byte
	plan workload.Plan
}

// readTap takes every message the tap holds (the consumers have stopped),
// by operation.
func (o *outboxRun) readTap() (map[string][]tapCopy, int) {
	o.t.Helper()
	n := o.queueMessages(o.tap)
	conn, err := amqp.DialConfig(o.amqp, amqp.Config{Properties: amqp.Table{"connection_name": o.name + "-tap"}})
	if err != nil {
		o.t.Fatalf("reading the tap: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		o.t.Fatalf("reading the tap: %v", err)
	}
	if err := ch.Qos(500, 0, false); err != nil {
		o.t.Fatalf("reading the tap: %v", err)
	}
	ds, err := ch.Consume(o.tap, "", true, false, false, false, nil)
	if err != nil {
		o.t.Fatalf("reading the tap: %v", err)
	}
	out := map[string][]tapCopy{}
	timeout := time.NewTimer(time.Minute)
	defer timeout.Stop()
	for i := 0; i < n; i++ {
		select {
		case d, ok := <-ds:
			if !ok {
				o.t.Fatalf("reading the tap: the channel closed after %d of %d messages", i, n)
			}
			p := workload.ParsePlan(d.Body)
			out[p.Op] = append(out[p.Op], tapCopy{id: d.MessageId, body: d.Body, plan: p})
		case <-timeout.C:
			o.t.Fatalf("reading the tap: %d of %d messages after a minute", i, n)
		}
	}
	return out, n
}

// recordsA reads stage A's record of every operation, through the store's
// lock.Admin (the consumers have stopped).
func (o *outboxRun) recordsA() map[string]lock.Record {
	o.t.Helper()
	var admin lock.Admin
	if o.pg == nil {
		rs, err := lock.NewRedisStore(o.redis.Client(o.t), lock.Config{Prefix: o.name})
		if err != nil {
			o.t.Fatal(err)
		}
		admin = rs
	} else {
		ps, err := pgstore.New(o.pg.pool, worker.StoreConfig(o.name, o.schemaA, 0))
		if err != nil {
			o.t.Fatal(err)
		}
		defer ps.Close()
		admin = ps
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out := map[string]lock.Record{}
	for id := range o.ops {
		rec, err := admin.Inspect(ctx, amqpidem.StoreKey(o.queue, id))
		if err != nil {
			rec = lock.Record{Error: err.Error()}
		}
		out[id] = rec
	}
	return out
}

// execA is one of stage A's executions, as its ledger logged it.
type execA struct {
	op, consumer, result string
	fence                int64
}

// executionsA reads stage A's executions by execution id.
func (o *outboxRun) executionsA() map[string]execA {
	o.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := o.ledA.Pool().Query(ctx, `SELECT exec_id, op_id, consumer, fence, coalesce(result, '') FROM executions`)
	if err != nil {
		o.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]execA{}
	for rows.Next() {
		var id string
		var x execA
		if err := rows.Scan(&id, &x.op, &x.consumer, &x.fence, &x.result); err != nil {
			o.t.Fatal(err)
		}
		out[id] = x
	}
	if err := rows.Err(); err != nil {
		o.t.Fatal(err)
	}
	return out
}

// outboxFigures is what a pipeline run shows beyond stage B's ledger.
type outboxFigures struct {
	copies                                   map[string][]tapCopy // the tap's raw copies, by operation
	records                                  map[string]lock.Record
	execs                                    map[string]execA
	stageBCopies, extraCopies                int
	staged, published, republished, returned int
	duplicatesB                              int // stage B deliveries acked as duplicates
	executionsA, reexecutedA, afterCompleteA int
	crashesA                                 int
	problems                                 []string
}

// line is what the scenario line adds to stage B's figures.
func (f *outboxFigures) line() string {
	return fmt.Sprintf(" stageb_copies=%d extra_copies=%d stageb_duplicates=%d staged=%d published=%d republished=%d returned=%d"+
		" stagea_executions=%d stagea_reexecuted=%d stagea_after_complete=%d stagea_crashes=%d",
		f.stageBCopies, f.extraCopies, f.duplicatesB, f.staged, f.published, f.republished, f.returned,
		f.executionsA, f.reexecutedA, f.afterCompleteA, f.crashesA)
}

// examine reads the tap, stage A's records, executions and ledger, and the
// consumers' events, and checks every operation's staged message against
// them (see the scenarios' comment). Call it once the consumers stopped.
func (o *outboxRun) examine() *outboxFigures {
	o.t.Helper()
	f := &outboxFigures{records: o.recordsA(), execs: o.executionsA()}
	f.copies, f.stageBCopies = o.readTap()
	problem := func(format string, args ...any) { f.problems = append(f.problems, fmt.Sprintf(format, args...)) }

	ids := map[string]string{} // MessageId → operation
	for id, op := range o.ops {
		rec, copies := f.records[id], f.copies[id]
		if len(copies) > 1 {
			f.extraCopies += len(copies) - 1
		}
		if rec.State != lock.StateCompleted {
			problem("%s: stage A's record is %q (%s), not completed, and stage B received %d copies of its message",
				id, rec.State, rec.Error, len(copies))
			continue
		}
		msgs, err := amqpidem.StoredOutbox(rec.Value)
		if err != nil || len(msgs) != 1 {
			problem("%s: stage A's record holds %d staged messages (%v), want 1", id, len(msgs), err)
			continue
		}
		m := msgs[0]
		if m.State != amqpidem.OutboxPublished {
			problem("%s: stage A's staged message is %v (tries %d), want published", id, m.State, m.Tries)
		}
		switch want := op.Plan.StageID; {
		case want != "" && m.Msg.MessageId != want:
			problem("%s: staged with MessageId %q, stored with %q", id, want, m.Msg.MessageId)
		case want == "" && !strings.HasPrefix(m.Msg.MessageId, "amqpidem-"):
			problem("%s: staged without a MessageId, stored with %q, not one amqpidem derived", id, m.Msg.MessageId)
		}
		if other, ok := ids[m.Msg.MessageId]; ok {
			problem("%s and %s: the same MessageId %q", id, other, m.Msg.MessageId)
		}
		ids[m.Msg.MessageId] = id
		if len(copies) == 0 {
			problem("%s: stage B received no copy of its staged message", id)
		}
		for i, c := range copies {
			if c.id != m.Msg.MessageId || !bytes.Equal(c.body, m.Msg.Body) {
				problem("%s: stage B's copy %d (MessageId %q, body %s) is not the message stage A's record holds (MessageId %q, body %s)",
					id, i, c.id, c.body, m.Msg.MessageId, m.Msg.Body)
			}
		}
		origin := workload.ParsePlan(m.Msg.Body).Origin
		switch x, ok := f.execs[originExec(origin)]; {
		case origin == nil:
			problem("%s: the stored message names no stage A execution: %s", id, m.Msg.Body)
		case origin.Fence != rec.Fence:
			problem("%s: the published message was staged by %s (fence %d), not by the execution whose outcome is stored (fence %d)",
				id, origin.Exec, origin.Fence, rec.Fence)
		case !ok || x.op != id || x.fence != origin.Fence:
			problem("%s: the published message names execution %s (fence %d), which stage A's ledger does not hold for it (%+v)",
				id, origin.Exec, origin.Fence, x)
		}
	}
	for id := range f.copies {
		if _, ok := o.ops[id]; !ok {
			problem("stage B received %d copies of a message for %q, an operation never published", len(f.copies[id]), id)
		}
	}

	for _, ev := range o.events() {
		switch {
		case strings.HasPrefix(ev.Consumer, o.nameA):
			f.staged += ev.Staged
			f.published += ev.Published
			f.republished += ev.Republished
			f.returned += ev.Returned
		case strings.HasPrefix(ev.Consumer, o.nameB) && ev.Outcome == amqpidem.Duplicate.String():
			f.duplicatesB++
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ra, err := o.ledA.Classify(ctx, "stage-a", nil)
	if err != nil {
		o.t.Fatal(err)
	}
	for _, s := range ra.PerOp {
		if s.Executions > 1 {
			f.reexecutedA++
		}
	}
	f.executionsA, f.afterCompleteA = ra.Executions, ra.AfterComplete
	f.crashesA = o.countA(`SELECT count(*) FROM crashes WHERE win NOT LIKE 'stop-%'`)
	if ra.AfterComplete != 0 {
		problem("stage A: %d executions began after their operation's outcome was stored:%s", ra.AfterComplete,
			ra.Failing(10, func(s ledger.OpStats) bool { return s.AfterComplete > 0 }))
	}
	for _, q := range []string{o.queue + ".dlq", o.queueB + ".dlq"} {
		if n := o.queueMessages(q); n != 0 {
			problem("%d messages dead-lettered to %s; every operation should have gone through", n, q)
		}
	}
	return f
}

// originExec is the execution an Origin names, "" for none.
func originExec(o *workload.Origin) string {
	if o == nil {
		return ""
	}
	return o.Exec
}

// report classifies stage B's ledger (the fenced ledger, or pgstore's
// effect rows, whose records are keyed by the staged messages' ids), prints
// the scenario line with f's figures and extra appended, and fails the test
// on every problem examine found.
func (o *outboxRun) report(name string, f *outboxFigures, extra string) {
	o.t.Helper()
	if o.pg == nil {
		o.reportWith(name, f.line()+extra, nil, false)
	} else {
		o.pg.recordKey = func(op string) string {
			rec := f.records[op]
			msgs, _ := amqpidem.StoredOutbox(rec.Value)
			if len(msgs) == 0 {
				return amqpidem.StoreKey(o.queueB, op)
			}
			return amqpidem.StoreKey(o.queueB, msgs[0].Msg.MessageId)
		}
		o.pg.report(name, f.line()+extra)
	}
	o.t.Logf("%s: %d operations, %d staged with their own MessageId, %d failing after staging; stage A staged %d, published %d, re-published %d, gave up %d; stage B received %d raw copies (%d beyond one per operation), acked %d deliveries as duplicates",
		name, len(o.ops), o.stageWithID, o.failAfterStaging, f.staged, f.published, f.republished, f.returned,
		f.stageBCopies, f.extraCopies, f.duplicatesB)
	if len(f.problems) > 0 {
		sort.Strings(f.problems)
		items := f.problems
		if len(items) > 15 {
			items = append(items[:15:15], fmt.Sprintf("... and %d more", len(f.problems)-15))
		}
		o.t.Errorf("%s: %d problems with the staged messages:\n  %s", name, len(f.problems), strings.Join(items, "\n  "))
	}
}

// checkWindows checks the operations whose stage A execution crashed in a
// window (stage A's crash claims) against the tap and stage A's records,
// and that every window was taken at least once (a kill -9 landing first
// can take one away). It returns how many times each was taken.
func (o *outboxRun) checkWindows(f *outboxFigures, windows []string) map[string]int {
	o.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := o.ledA.Pool().Query(ctx, `SELECT c.op_id, c.win, c.fence, c.at,
		(SELECT count(*) FROM executions x WHERE x.op_id = c.op_id AND x.fence > c.fence)
		FROM crashes c WHERE c.win NOT LIKE 'stop-%' ORDER BY c.win, c.op_id`)
	if err != nil {
		o.t.Fatal(err)
	}
	defer rows.Close()
	// When the deliveries of stage A that re-published a message began
	// (the record is read first thing), by operation.
	republishedAt := map[string][]time.Time{}
	for _, ev := range o.events() {
		if ev.Republished > 0 && strings.HasPrefix(ev.Consumer, o.nameA) {
			republishedAt[ev.Op] = append(republishedAt[ev.Op], ev.Time.Add(-time.Duration(ev.TotalMS)*time.Millisecond))
		}
	}
	taken := map[string]int{}
	copiesBy := map[string][]int{}
	for rows.Next() {
		var op, win string
		var fence int64
		var at time.Time
		var later int
		if err := rows.Scan(&op, &win, &fence, &at, &later); err != nil {
			o.t.Fatal(err)
		}
		taken[win]++
		n, rec := len(f.copies[op]), f.records[op]
		copiesBy[win] = append(copiesBy[win], n)
		// Every window is after the outcome was stored: the crashed
		// execution's is the stored one, and the handler never ran again.
		if rec.Fence != fence || later != 0 {
			o.t.Errorf("%s crashed %s (fence %d): stage A's record has fence %d, later executions %d; want the crashed fence, 0",
				op, win, fence, rec.Fence, later)
		}
		switch win {
		case workload.AfterPublish:
			// Published and confirmed, not recorded: the redelivery must
			// publish it again.
			if n < 2 {
				o.t.Errorf("%s crashed %s: stage B received %d copies; want at least 2 (published, then re-published after the crash)", op, win, n)
			}
		case workload.AfterAmend:
			// Recorded as published: no delivery that began after it
			// publishes it again. (One that began before could have, had
			// the execution taken longer than its claim to publish and
			// record: then n > 1, allowed.)
			for _, t := range republishedAt[op] {
				if t.After(at) {
					o.t.Errorf("%s crashed %s at %v, its message recorded published: re-published by a delivery begun at %v", op, win, at, t)
				}
			}
			if n < 1 {
				o.t.Errorf("%s crashed %s: stage B received no copy", op, win)
			}
		default: // stored, not published: the redelivery publishes it
			if n < 1 {
				o.t.Errorf("%s crashed %s: stage B received no copy", op, win)
			}
		}
	}
	if err := rows.Err(); err != nil {
		o.t.Fatal(err)
	}
	for _, w := range windows {
		if taken[w] == 0 {
			o.t.Errorf("crash window %s was never taken (taken: %v)", w, taken)
		}
	}
	o.t.Logf("stage A crash windows taken %v; raw copies stage B received of their operations: %v", taken, copiesBy)
	return taken
}

// checkFailedAfterStaging checks that the operations planned to fail
// their first execution after staging did so (at least one of them: a
// crash or a kill -9 of its process can come first), and reports how many
// executions failed after staging. examine checks that no copy of their
// messages reached stage B: every copy came from the stored execution.
func (o *outboxRun) checkFailedAfterStaging(f *outboxFigures) {
	o.t.Helper()
	planned, happened, failed := 0, 0, 0
	for id, op := range o.ops {
		if op.Plan.FailUntil < 2 {
			continue
		}
		planned++
		n := 0
		for _, x := range f.execs {
			if x.op == id && strings.Contains(x.result, "after staging") {
				n++
			}
		}
		if n > 0 {
			happened++
		} else {
			o.t.Logf("%s: planned to fail after staging, but no execution of it did (its executions: %v)", id, o.execsOf(f, id))
		}
		failed += n
	}
	if planned > 0 && happened == 0 {
		o.t.Errorf("none of the %d operations planned to fail after staging did", planned)
	}
	o.t.Logf("%d of %d operations failed after staging (%d executions); no copy of their messages reached stage B", happened, planned, failed)
}

// execsOf lists an operation's stage A executions, for a failure message.
func (o *outboxRun) execsOf(f *outboxFigures, op string) []string {
	var out []string
	for id, x := range f.execs {
		if x.op == op {
			out = append(out, fmt.Sprintf("%s fence %d: %s", id, x.fence, x.result))
		}
	}
	sort.Strings(out)
	return out
}

// Scenario 15a, outbox-kill9: two supervised consumers per stage on the
// Redis store; stage A's operations planned to kill their own process in
// each outbox window (stored, not published; published, not recorded;
// recorded, not acked) or to fail once after staging; kill -9 of random
// consumers of both stages at random moments on top.
func TestChaos15OutboxKill9(t *testing.T) {
	o := newOutboxRun(t, false)
	o.kill9("outbox-kill9", []string{workload.AfterComplete, workload.AfterPublish, workload.AfterAmend})
}

// Scenario 15c, outbox-pg-kill9: 15a with pgstore and TxHandler on both
// stages; stage A stages in its transaction, stage B inserts its plain row
// in its own.
func TestChaos15OutboxPGKill9(t *testing.T) {
	o := newOutboxRun(t, true)
	o.kill9("outbox-pg-kill9", []string{workload.AfterCommit, workload.AfterPublish, workload.AfterAmend})
}

// kill9 is scenarios 15a and 15c.
func (o *outboxRun) kill9(name string, windows []string) {
	t := o.t
	nOps, perWindow, failAfter, kills := pick(150, 2000), pick(2, 10), pick(3, 10), pick(4, 15)
	ops := o.outboxOps("op", nOps, 100, windows, perWindow, failAfter)
	supA := o.superviseAs(o.nameA, 2, o.flagsA...)
	supB := o.superviseAs(o.nameB, 2, o.flagsB...)
	o.publish(ops)
	o.logf("published")

	killedA, killedB := 0, 0
	deadline := time.Now().Add(pick(2*time.Minute, 6*time.Minute))
	for killedA+killedB < kills && time.Now().Before(deadline) {
		time.Sleep(time.Duration(300+o.rng.IntN(700)) * time.Millisecond)
		if o.appliedB() >= nOps {
			break
		}
		a, b := supA.live(), supB.live()
		if len(a)+len(b) == 0 {
			continue
		}
		if i := o.rng.IntN(len(a) + len(b)); i < len(a) {
			a[i].kill()
			killedA++
		} else {
			b[i-len(a)].kill()
			killedB++
		}
	}
	o.logf("%d kill -9 done", killedA+killedB)
	o.settle(nOps, pick(4*time.Minute, 8*time.Minute))
	o.logf("settled")
	restartsA, errA := supA.halt()
	restartsB, errB := supB.halt()
	if errA != nil || errB != nil {
		t.Errorf("restarting consumers: %v %v", errA, errB)
	}
	o.terminateAll()
	o.logf("consumers stopped")
	f := o.examine()
	o.logf("examined")
	o.report(name, f, fmt.Sprintf(" kills=%d/%d restarts=%d/%d", killedA, killedB, restartsA, restartsB))
	o.checkWindows(f, windows)
	o.checkFailedAfterStaging(f)
	t.Logf("%s: kill -9 of %d stage A and %d stage B consumers; restarts %d and %d", name, killedA, killedB, restartsA, restartsB)
	if killedA+killedB == 0 {
		t.Errorf("%s: every operation was applied before the first kill -9: the scenario tested nothing", name)
	}
}

// Scenario 15b, outbox-sigstop, on the Redis store (lease 1 s):
//
//   - a stage A consumer takes victims whose handlers stage their message
//     and then stall (ignoring their context), and is stopped for three
//     lease TTLs; stage A's other consumers take the victims over, store
//     and publish them. The stopped consumer is continued: its handlers
//     return success, the store refuses their completion, and their staged
//     messages must never be published;
//   - meanwhile consumers of both stages are stopped at random for half a
//     lease TTL to two and a half;
//   - then, with three fresh stage A consumers of prefetch 1, operations
//     planned to stop their own process (SIGSTOP) in an outbox window:
//     stored, not published; published, not recorded; two at a time. Once
//     one stopped, three more copies of its operation are published, which
//     the third consumer takes (a stopped one holds its prefetch), and the
//     stopped one is continued three lease TTLs after it stopped: the copy
//     found the claim passed and published the message again, and the
//     continued process published it too (stored, not published) or had
//     published it before (published, not recorded). Stage B gets it at
//     least twice, and applies it once.
func TestChaos15OutboxSigstop(t *testing.T) {
	o := newOutboxRun(t, false)
	o.sigstop("outbox-sigstop", []string{workload.AfterComplete, workload.AfterPublish})
}

// Scenario 15d, outbox-pg-sigstop: 15b with pgstore and TxHandler; the
// victims' transactions are open while their consumer is stopped, and
// "stored, not published" is after the commit.
func TestChaos15OutboxPGSigstop(t *testing.T) {
	o := newOutboxRun(t, true)
	o.sigstop("outbox-pg-sigstop", []string{workload.AfterCommit, workload.AfterPublish})
}

// sigstop is scenarios 15b and 15d.
func (o *outboxRun) sigstop(name string, stopWindows []string) {
	t := o.t
	const ttl = outboxLease
	nVictims, nOther, pauses, perStop := pick(3, 10), pick(200, 2000), pick(4, 12), pick(1, 3)

	victims := o.outboxOps("victim", nVictims, 0, nil, 0, 0)
	for i := range victims {
		victims[i].Copies = 1
		victims[i].Plan.Stall, victims[i].Plan.StallMS = true, 120_000
	}
	// The victims' consumer: its prefetch is exactly the victims (a
	// stopped process keeps every delivery pushed to it), and its
	// connection outlives the stop.
	nameV, n := o.nameA+"-victims", fmt.Sprint(nVictims)
	v := o.consumer(nameV, append(append([]string(nil), o.flagsA...), "-prefetch", n, "-concurrency", n, "-heartbeat", "30s")...)
	o.publish(victims)
	o.waitFor("the victims' consumer to stage every victim", time.Minute, func() bool {
		return o.countA(`SELECT count(*) FROM executions WHERE consumer = $1 AND op_id LIKE '%victim%'`, nameV) == nVictims
	}, nil)
	time.Sleep(300 * time.Millisecond) // from starting the handler to staging: its work is none
	v.pause()
	stoppedAt := time.Now()
	o.logf("the victims' consumer stopped")

	var procs []*proc
	for i := range 2 {
		procs = append(procs, o.consumer(fmt.Sprintf("%s-c%d", o.nameB, i), o.flagsB...))
	}
	time.Sleep(3 * ttl)
	var stageA []*proc
	for i := range 2 {
		stageA = append(stageA, o.consumer(fmt.Sprintf("%s-c%d", o.nameA, i), o.flagsA...))
	}
	procs = append(procs, stageA...)
	o.publishCopies(victims) // the copies the others take over with
	others := o.outboxOps("op", nOther, 300, nil, 0, 0)
	o.publish(others)
	total := nVictims + nOther
	o.logf("published")

	paused := 0
	var pausedFor time.Duration
	deadline := time.Now().Add(pick(2*time.Minute, 5*time.Minute))
	for paused < pauses && time.Now().Before(deadline) {
		time.Sleep(time.Duration(100+o.rng.IntN(300)) * time.Millisecond)
		if o.appliedB() >= total {
			break
		}
		p := procs[o.rng.IntN(len(procs))]
		d := ttl/2 + time.Duration(o.rng.Int64N(int64(2*ttl)))
		p.pause()
		time.Sleep(d)
		p.resume()
		paused++
		pausedFor += d
		t.Logf("%s: %s stopped for %v", name, p.name, d.Round(time.Millisecond))
	}
	o.logf("%d pauses done", paused)
	o.waitFor("stage B to apply every victim", 2*time.Minute, func() bool {
		return o.victimsApplied() == nVictims
	}, func() string { return fmt.Sprintf("(%d applied)", o.victimsApplied()) })
	v.resume()
	stopped := time.Since(stoppedAt)
	t.Logf("%s: the victims' consumer (pid %d) stopped for %v", name, v.pid(), stopped.Round(time.Millisecond))
	o.waitFor("the victims' stale handlers to end", 2*time.Minute, func() bool {
		return o.countA(`SELECT count(*) FROM executions WHERE consumer = $1 AND op_id LIKE '%victim%' AND finished_at IS NOT NULL`, nameV) == nVictims
	}, nil)
	o.waitFor(fmt.Sprintf("%d operations applied", total), pick(3*time.Minute, 6*time.Minute),
		func() bool { return o.appliedB() >= total }, nil)
	o.logf("%d operations applied", total)

	// The stop windows, on three fresh stage A consumers of prefetch 1,
	// two operations at a time: each stops one, the third takes the copies.
	var wg sync.WaitGroup
	for _, p := range append(stageA, v) {
		wg.Go(func() {
			if err := p.terminate(45 * time.Second); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	stopFlags := append(append([]string(nil), o.flagsA...), "-prefetch", "1", "-concurrency", "1")
	var stoppers []*proc
	for i := range 3 {
		stoppers = append(stoppers, o.consumer(fmt.Sprintf("%s-s%d", o.nameA, i), stopFlags...))
	}
	stopOps := o.outboxOps("stop", len(stopWindows)*perStop, 50, nil, 0, 0)
	for i := range stopOps {
		stopOps[i].Copies = 1
		stopOps[i].Plan.Stop = stopWindows[i%len(stopWindows)]
	}
	o.logf("stage A's consumers replaced")
	for batch := range slices.Chunk(stopOps, 2) {
		o.publish(batch)
		type stop struct {
			pid int
			at  time.Time
		}
		stops := make([]stop, len(batch))
		for i, op := range batch {
			o.waitFor("a stage A consumer to stop itself in "+op.Plan.Stop, time.Minute, func() bool {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				return o.ledA.Pool().QueryRow(ctx, `SELECT pid, at FROM crashes WHERE op_id = $1`, op.ID).Scan(&stops[i].pid, &stops[i].at) == nil
			}, nil)
			more := op
			more.Copies = 3
			o.publishCopies([]workload.Op{more})
		}
		for i, op := range batch {
			time.Sleep(time.Until(stops[i].at.Add(3 * ttl)))
			for _, p := range stoppers {
				if p.pid() == stops[i].pid {
					p.resume()
					o.logf("%s stopped itself in %s of %s; continued after %v", p.name, op.Plan.Stop, op.ID, time.Since(stops[i].at).Round(time.Millisecond))
				}
			}
		}
	}
	o.settle(total+len(stopOps), time.Minute)
	o.logf("settled")
	o.terminateAll()
	o.logf("consumers stopped")
	f := o.examine()
	o.logf("examined")
	// Refused: by the compare-and-set of a record-row lease, or, for a
	// lease held by pgstore's transaction, because the server ended the
	// stopped holder's idle session (its transaction, lock and staged
	// messages with it).
	staleStaged := 0
	for _, x := range f.execs {
		if x.consumer == nameV && strings.Contains(x.op, "victim") &&
			(strings.HasPrefix(x.result, "staged") || strings.HasPrefix(x.result, "failed after-effect lease-lost") ||
				strings.HasPrefix(x.result, "failed after-effect unavailable") && strings.Contains(x.result, "idle-in-transaction timeout")) {
			staleStaged++
		}
	}
	o.report(name, f, fmt.Sprintf(" stale_staged=%d stops=%d pauses=%d paused_ms=%d victims_stopped_ms=%d",
		staleStaged, len(stopOps), paused, pausedFor.Milliseconds(), stopped.Milliseconds()))

	// The victims: staged by the stopped consumer, whose completion the
	// store refused; their messages came from the executions that took
	// over (examine: from the stored execution), none from the stale one.
	for i := range victims {
		id := victims[i].ID
		for _, c := range f.copies[id] {
			if c.plan.Origin != nil && strings.HasPrefix(c.plan.Origin.Exec, nameV+".") {
				t.Errorf("%s: stage B received a copy staged by the stale consumer's execution %s", id, c.plan.Origin.Exec)
			}
		}
	}
	if staleStaged != nVictims {
		t.Errorf("%s: the stopped consumer's handlers that staged and were refused: got %d, want %d (its executions: %v)",
			name, staleStaged, nVictims, o.victimExecsBy(f, nameV))
	}
	if n := o.countA(`SELECT count(*) FROM completions WHERE consumer = $1 AND op_id LIKE '%victim%'`, nameV); n != 0 {
		t.Errorf("%s: the store accepted %d completions from the stale consumer", name, n)
	}
	for _, ev := range o.events() {
		if ev.Consumer == nameV && strings.Contains(ev.Op, "victim") && (ev.Outcome == "completed" || ev.Published > 0) {
			t.Errorf("%s: the stale consumer settled %s as %s having published %d staged messages", name, ev.Op, ev.Outcome, ev.Published)
		}
	}

	// The stop windows, past the claim with a copy at the other consumer:
	// stopped after its completion (or commit), the execution finds its claim passed
	// when it is continued and publishes nothing, the copy publishes it
	// once; stopped after its publish, the copy publishes it a second
	// time (nothing recorded it), and the continued execution records it.
	copiesBy := map[string][]int{}
	for _, op := range stopOps {
		n := len(f.copies[op.ID])
		copiesBy[op.Plan.Stop] = append(copiesBy[op.Plan.Stop], n)
		want := 2
		if op.Plan.Stop == workload.AfterComplete || op.Plan.Stop == workload.AfterCommit {
			want = 1
		}
		if n != want {
			t.Errorf("%s: stopped in %s past the claim with a copy at the other consumer: stage B received %d copies, want %d",
				op.ID, op.Plan.Stop, n, want)
		}
	}
	t.Logf("%s: raw copies stage B received of the operations stopped in each window: %v", name, copiesBy)
}

// countA runs a query returning one integer on stage A's ledger.
func (o *outboxRun) countA(sql string, args ...any) int {
	o.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var n int
	if err := o.ledA.Pool().QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		o.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// victimsApplied returns how many victims stage B applied.
func (o *outboxRun) victimsApplied() int {
	o.t.Helper()
	if o.pg == nil {
		return o.count(`SELECT count(*) FROM applied WHERE op_id LIKE '%victim%'`)
	}
	return o.pg.storeCount(`SELECT count(DISTINCT op_id) FROM ` + worker.EffectsTable + ` WHERE op_id LIKE '%victim%'`)
}

// victimExecsBy lists a consumer's stage A executions of victims, for a
// failure message.
func (o *outboxRun) victimExecsBy(f *outboxFigures, consumer string) []string {
	var out []string
	for id, x := range f.execs {
		if x.consumer == consumer && strings.Contains(x.op, "victim") {
			out = append(out, fmt.Sprintf("%s (%s, fence %d): %s", id, x.op, x.fence, x.result))
		}
	}
	sort.Strings(out)
	return out
}
