//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
)

// effectRun is the part of a scenario's world that is the same whatever
// store keeps the records, when the effects live in a database next to
// them (pgRun: PostgreSQL rows; dynRun: DynamoDB items; a store to come
// adds a sink of its own and reuses the rest). The ledger (executions,
// completions, crashes) stays in PostgreSQL; the sink says what effects
// exist and whether an operation's record is completed. It waits for the
// effects, classifies the run and checks what every such scenario
// promises (report).
type effectRun struct {
	*env
	sink effectSink
	// server, when set, follows the scenario's name in its line:
	// "scenario dynamo-kill9/dynamodb-local ...".
	server string
	// start is when the run was set up, for the timings in the log.
	start time.Time
}

// effectSink is where a run's effects and records live.
type effectSink interface {
	// countApplied returns how many operations have an effect.
	countApplied(ctx context.Context) (int, error)
	// readEffects returns, per operation, the execution ids of its effects
	// (rows or items), in the order they were written where the sink
	// knows it.
	readEffects(ctx context.Context) (map[string][]string, error)
	// readRecords opens the store's records for reading after the consumers
	// stopped: check reports whether the record of operation op is
	// completed, and when it is not, how it stands; done releases what
	// records took.
	readRecords(ctx context.Context) (check func(ctx context.Context, op string) (completed bool, state string, err error), done func(), err error)
	// commitUnknown reports whether an execution's logged end
	// (worker.TxResult) is a commit whose outcome the store could not know:
	// then its effect may or may not exist. Any other failure means
	// nothing was committed.
	commitUnknown(result string) bool
	// words names the store ("pgstore") and one effect ("row") in the
	// messages.
	words() (store, effect string)
}

// logf logs with the time since the run was set up.
func (r *effectRun) logf(format string, args ...any) {
	r.t.Helper()
	r.t.Logf("[%5.1fs] "+format, append([]any{time.Since(r.start).Seconds()}, args...)...)
}

// applied returns how many operations have an effect.
func (r *effectRun) applied() (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return r.sink.countApplied(ctx)
}

// waitApplied waits until want operations have an effect; errors of the
// store's database (down while restarted) count as "not yet".
func (r *effectRun) waitApplied(want int, timeout time.Duration) {
	r.t.Helper()
	var last error
	n := 0
	r.waitFor(fmt.Sprintf("%d operations applied", want), timeout, func() bool {
		n, last = r.applied()
		return last == nil && n >= want
	}, func() string { return fmt.Sprintf("(applied %d, last error %v)", n, last) })
}

// settle waits until want operations are applied and the queues drained.
func (r *effectRun) settle(want int, timeout, quiet time.Duration) {
	r.t.Helper()
	start := time.Now()
	r.waitApplied(want, timeout)
	r.logf("%d operations applied", want)
	r.waitDrained(timeout-time.Since(start), quiet)
	r.logf("queues drained")
}

// effectReport is the classification of an effect run.
type effectReport struct {
	Name                                string
	Ops, Lost, Duplicated, Reexecuted   int
	Executions, Uncommitted             int
	Completions, AfterComplete          int
	NotCompleted, Inconsistent          int
	DeadLetters, Crashes, Unknown       int
	effects                             map[string][]string // op → exec ids of its effects
	results                             map[string]string   // exec id → executions.result
	problems                            []string
	extra                               string
	lostOps, duplicatedOps, notComplete []string
}

// pgReport and dynReport are the reports of the PostgreSQL and DynamoDB
// scenarios: one classification, from rows or items.
type pgReport = effectReport
type dynReport = effectReport

// Line is the scenario's one line.
func (p effectReport) Line() string {
	return fmt.Sprintf("scenario %s ops=%d lost=%d duplicated=%d reexecuted=%d executions=%d uncommitted=%d "+
		"completions=%d after_complete=%d not_completed=%d inconsistent=%d dead_letters=%d crashes=%d unknown=%d%s",
		p.Name, p.Ops, p.Lost, p.Duplicated, p.Reexecuted, p.Executions, p.Uncommitted,
		p.Completions, p.AfterComplete, p.NotCompleted, p.Inconsistent, p.DeadLetters, p.Crashes, p.Unknown, p.extra)
}

// classify counts, per published operation, its effects (the sink), its
// executions and completions (ledger), and checks every effect against
// the execution that wrote it:
//
//   - lost: no effect; duplicated: more than one; reexecuted: the handler
//     started more than once, exactly one effect;
//   - uncommitted: executions that left no effect (crashed, killed,
//     failed, rolled back);
//   - inconsistent: an effect of an execution that the store said was not
//     committed (lease lost, cancelled, an error: anything but a commit of
//     unknown outcome), or of no logged execution, or an execution the
//     store said was committed without its effect;
//   - not_completed: applied operations whose record is not completed
//     (read through the store, after the consumers stopped);
//   - after_complete: executions that began after their operation had
//     committed (as scenario 2 defines it);
//   - dead_letters: messages in the dead-letter queue (every operation
//     here must be applied, none dead-lettered).
func (r *effectRun) classify(name string) effectReport {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	storeName, effect := r.sink.words()
	p := effectReport{Name: name, results: map[string]string{}}
	led := r.led.Pool()

	var err error
	if p.effects, err = r.sink.readEffects(ctx); err != nil {
		r.t.Fatalf("reading the effects: %v", err)
	}

	// Executions and how they ended.
	var exec, result, op string
	rows, err := led.Query(ctx, `SELECT exec_id, coalesce(result, '') FROM executions`)
	if err != nil {
		r.t.Fatal(err)
	}
	if _, err := pgx.ForEachRow(rows, []any{&exec, &result}, func() error {
		p.results[exec] = result
		return nil
	}); err != nil {
		r.t.Fatal(err)
	}

	// Per operation: expectation, executions, completions, executions
	// after completion.
	type opRow struct {
		expect                      string
		executions, completions, ac int
	}
	ops := map[string]opRow{}
	rows, err = led.Query(ctx, `
WITH e AS (SELECT op_id, count(*) AS n FROM executions GROUP BY op_id),
     c AS (SELECT op_id, count(*) AS n, min(at) AS first_at, max(fence) AS max_fence
             FROM completions GROUP BY op_id),
     ac AS (SELECT x.op_id, count(*) AS n FROM executions x JOIN c ON c.op_id = x.op_id
             WHERE x.acquired_at > c.first_at OR x.fence > c.max_fence GROUP BY x.op_id)
SELECT o.op_id, o.expect, coalesce(e.n, 0), coalesce(c.n, 0), coalesce(ac.n, 0)
  FROM ops o LEFT JOIN e USING (op_id) LEFT JOIN c USING (op_id) LEFT JOIN ac USING (op_id)`)
	if err != nil {
		r.t.Fatal(err)
	}
	var o opRow
	if _, err := pgx.ForEachRow(rows, []any{&op, &o.expect, &o.executions, &o.completions, &o.ac}, func() error {
		ops[op] = o
		return nil
	}); err != nil {
		r.t.Fatal(err)
	}
	if err := led.QueryRow(ctx, `SELECT (SELECT count(*) FROM crashes),
		(SELECT count(*) FROM executions x WHERE NOT EXISTS (SELECT 1 FROM ops o WHERE o.op_id = x.op_id))`).
		Scan(&p.Crashes, &p.Unknown); err != nil {
		r.t.Fatal(err)
	}

	// The records, through the store: every applied operation's must be
	// completed. The consumers have stopped: a read that takes a lease
	// (the record was not completed) disturbs nobody.
	check, done, err := r.sink.readRecords(ctx)
	if err != nil {
		r.t.Fatal(err)
	}
	defer done()
	for id, s := range ops {
		p.Ops++
		n := len(p.effects[id])
		p.Executions += s.executions
		p.Completions += s.completions
		p.AfterComplete += s.ac
		if s.expect != "apply" {
			p.problems = append(p.problems, fmt.Sprintf("%s: expectation %q: the %s scenarios expect every operation applied", id, s.expect, storeName))
		}
		switch {
		case n == 0:
			p.Lost++
			p.lostOps = append(p.lostOps, fmt.Sprintf("%s (executions %d: %s)", id, s.executions, r.execResults(ctx, id)))
		case n > 1:
			p.Duplicated++
			p.duplicatedOps = append(p.duplicatedOps, fmt.Sprintf("%s (effect %ss of %v; executions %d: %s)", id, effect, p.effects[id], s.executions, r.execResults(ctx, id)))
		case s.executions > 1:
			p.Reexecuted++
		}
		if n == 0 {
			continue
		}
		completed, state, err := check(ctx, id)
		if err != nil {
			r.t.Fatalf("reading the record of %s: %v", id, err)
		}
		if !completed {
			p.NotCompleted++
			p.notComplete = append(p.notComplete, fmt.Sprintf("%s: %s", id, state))
		}
	}
	withEffect := map[string]bool{}
	for id, execs := range p.effects {
		if _, ok := ops[id]; !ok {
			p.Unknown += len(execs)
		}
		for _, x := range execs {
			withEffect[x] = true
			res, ok := p.results[x]
			switch {
			case !ok:
				p.Inconsistent++
				p.problems = append(p.problems, fmt.Sprintf("%s: effect %s of execution %s, which the ledger never saw start", id, effect, x))
			case strings.HasPrefix(res, "failed") && !r.sink.commitUnknown(res):
				p.Inconsistent++
				p.problems = append(p.problems, fmt.Sprintf("%s: effect %s of execution %s, which %s reported not committed: %s", id, effect, x, storeName, res))
			}
		}
	}
	for x, res := range p.results {
		if !withEffect[x] {
			p.Uncommitted++
			if res == "committed" {
				p.Inconsistent++
				p.problems = append(p.problems, fmt.Sprintf("execution %s: %s reported it committed, but it has no effect %s", x, storeName, effect))
			}
		}
	}
	p.DeadLetters = r.queueMessages(r.queue + ".dlq")
	sort.Strings(p.lostOps)
	sort.Strings(p.duplicatedOps)
	sort.Strings(p.notComplete)
	sort.Strings(p.problems)
	return p
}

// execResults lists how an operation's executions ended, for a failure
// message.
func (r *effectRun) execResults(ctx context.Context, op string) string {
	rows, err := r.led.Pool().Query(ctx, `SELECT consumer || ' fence ' || fence || ': ' || coalesce(result, '(no end logged)')
		FROM executions WHERE op_id = $1 ORDER BY seq`, op)
	if err != nil {
		return err.Error()
	}
	var out []string
	var s string
	_, _ = pgx.ForEachRow(rows, []any{&s}, func() error {
		out = append(out, s)
		return nil
	})
	return strings.Join(out, "; ")
}

// report classifies the run, prints its line (stdout, the test log and
// CHAOS_RESULTS) with extra appended, and checks what every such scenario
// promises: nothing lost, nothing duplicated, nothing dead-lettered, every
// effect from an execution that committed, every applied operation's
// record completed, no execution after a commit, nothing unknown.
func (r *effectRun) report(name, extra string) effectReport {
	r.t.Helper()
	if r.server != "" {
		name += "/" + r.server
	}
	storeName, effect := r.sink.words()
	r.logf("consumers stopped")
	p := r.classify(name)
	r.logf("classified")
	p.extra = extra
	printFigures(r.t, p.Line())
	outcomes := map[string]int{}
	for _, ev := range r.events() {
		outcomes[strings.TrimSpace(ev.Outcome+" "+ev.Reason)]++
	}
	r.t.Logf("%s: outcomes reported by the consumers: %v", name, outcomes)
	list := func(items []string) string {
		if len(items) > 10 {
			items = append(items[:10:10], fmt.Sprintf("... and %d more", len(items)-10))
		}
		return "\n  " + strings.Join(items, "\n  ")
	}
	if p.Lost != 0 {
		r.t.Errorf("%s: %d operations lost (no effect %s):%s", name, p.Lost, effect, list(p.lostOps))
	}
	if p.Duplicated != 0 {
		r.t.Errorf("%s: %d operations duplicated (more than one effect %s):%s", name, p.Duplicated, effect, list(p.duplicatedOps))
	}
	if p.NotCompleted != 0 {
		r.t.Errorf("%s: %d applied operations whose record is not completed:%s", name, p.NotCompleted, list(p.notComplete))
	}
	if p.Inconsistent != 0 || len(p.problems) != 0 {
		r.t.Errorf("%s: %d effect %ss disagree with what %s reported:%s", name, p.Inconsistent, effect, storeName, list(p.problems))
	}
	if p.AfterComplete != 0 {
		r.t.Errorf("%s: %d executions began after their operation had committed", name, p.AfterComplete)
	}
	if p.DeadLetters != 0 {
		r.t.Errorf("%s: %d messages dead-lettered; every operation should have been applied", name, p.DeadLetters)
	}
	if p.Unknown != 0 {
		r.t.Errorf("%s: %d executions or effects of operations never published", name, p.Unknown)
	}
	return p
}

// queueMessages returns how many messages wait in queue (ready ones: the
// queue's consumers are expected to be gone), 0 if it was never declared:
// a passive declare on a connection of its own, cheaper than rabbitmqctl.
func (e *env) queueMessages(queue string) int {
	e.t.Helper()
	conn, err := amqp.DialConfig(e.amqp, amqp.Config{Properties: amqp.Table{"connection_name": e.name + "-depth-check"}})
	if err != nil {
		e.t.Fatalf("counting the messages of %s: %v", queue, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		e.t.Fatalf("counting the messages of %s: %v", queue, err)
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return 0
	}
	if err != nil {
		e.t.Fatalf("counting the messages of %s: %v", queue, err)
	}
	return q.Messages
}
