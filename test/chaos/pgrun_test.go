//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
)

// pgRun is the world of a scenario on the PostgreSQL store (issue 11): an
// env (queue, ledger, consumer processes) whose consumers keep their
// records with pgstore and insert their effect, one plain row per
// execution with no unique key (worker.EffectsTable), in pgstore's handler
// transaction. Records and effects live in the scenario's schema of the
// store's database: the shared server (the ledger's database) or, for the
// restart scenario, a private server. The ledger's executions, completions
// and crash claims stay on the shared server, written in autocommit, so
// that executions that rolled back are counted too.
type pgRun struct {
	*env
	storeDSN string
	// app is the application_name of the consumers' store connections
	// (the default of every consumer of the run).
	app  string
	pool *pgxpool.Pool // the test's own connections to the store's database
	cfg  pgstore.Config
	// start is when the run was set up, for the timings in the log.
	start time.Time
	// recordKey, when set, is the key of the record of operation op in
	// cfg's store (default amqpidem.StoreKey(queue, op)): the outbox
	// scenarios' stage B keys its records by the staged messages' ids.
	recordKey func(op string) string
}

// logf logs with the time since the run was set up.
func (r *pgRun) logf(format string, args ...any) {
	r.t.Helper()
	r.t.Logf("[%5.1fs] "+format, append([]any{time.Since(r.start).Seconds()}, args...)...)
}

// newPGRun makes the env, the effects table and the store's table (Migrate)
// in the store's database: the shared one, or with private a private
// server, started here and returned.
func newPGRun(t *testing.T, private bool) (*pgRun, *pgServer) {
	t.Helper()
	start := time.Now()
	e := newEnv(t, envOptions{})
	consumerBinary(t)
	r := &pgRun{env: e, storeDSN: e.dsn, app: e.name + "-store", cfg: worker.StoreConfig(e.name, e.schema, 0), start: start}
	var srv *pgServer
	if private {
		srv = startPGServer(t)
		r.storeDSN = srv.dsn
	}
	pcfg, err := pgxpool.ParseConfig(r.storeDSN)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 4
	pcfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pcfg.ConnConfig.RuntimeParams["search_path"] = e.schema
	pcfg.ConnConfig.RuntimeParams["application_name"] = "amqpidem-chaos"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r.pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.pool.Close)
	if private {
		if _, err := r.pool.Exec(ctx, "CREATE SCHEMA "+e.schema); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := r.pool.Exec(ctx, worker.EffectsDDL); err != nil {
		t.Fatalf("creating the effects table: %v", err)
	}
	if err := pgstore.Migrate(ctx, r.pool, r.cfg); err != nil {
		t.Fatal(err)
	}
	r.logf("set up")
	return r, srv
}

// flags are a consumer's flags for the pg store, then extra.
func (r *pgRun) flags(extra ...string) []string {
	return append([]string{"-store-pg", r.storeDSN, "-store-app", r.app}, extra...)
}

// applied returns how many operations have an effect row.
func (r *pgRun) applied() (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int
	err := r.pool.QueryRow(ctx, `SELECT count(DISTINCT op_id) FROM `+worker.EffectsTable).Scan(&n)
	return n, err
}

// waitApplied waits until want operations have an effect row; errors of
// the store's database (down while restarted) count as "not yet".
func (r *pgRun) waitApplied(want int, timeout time.Duration) {
	r.t.Helper()
	var last error
	n := 0
	r.waitFor(fmt.Sprintf("%d operations applied", want), timeout, func() bool {
		var err error
		n, err = r.applied()
		last = err
		return err == nil && n >= want
	}, func() string { return fmt.Sprintf("(applied %d, last error %v)", n, last) })
}

// settle waits until want operations are applied and the queues drained.
func (r *pgRun) settle(want int, timeout, quiet time.Duration) {
	r.t.Helper()
	start := time.Now()
	r.waitApplied(want, timeout)
	r.logf("%d operations applied", want)
	r.waitDrained(timeout-time.Since(start), quiet)
	r.logf("queues drained")
}

// storeCount runs a query returning one integer on the store's database.
func (r *pgRun) storeCount(sql string, args ...any) int {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var n int
	if err := r.pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		r.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// pgReport is the classification of a pg run.
type pgReport struct {
	Name                                string
	Ops, Lost, Duplicated, Reexecuted   int
	Executions, Uncommitted             int
	Completions, AfterComplete          int
	NotCompleted, Inconsistent          int
	DeadLetters, Crashes, Unknown       int
	effects                             map[string][]string // op → exec ids of its effect rows
	results                             map[string]string   // exec id → executions.result
	problems                            []string
	extra                               string
	lostOps, duplicatedOps, notComplete []string
}

// Line is the scenario's one line.
func (p pgReport) Line() string {
	return fmt.Sprintf("scenario %s ops=%d lost=%d duplicated=%d reexecuted=%d executions=%d uncommitted=%d "+
		"completions=%d after_complete=%d not_completed=%d inconsistent=%d dead_letters=%d crashes=%d unknown=%d%s",
		p.Name, p.Ops, p.Lost, p.Duplicated, p.Reexecuted, p.Executions, p.Uncommitted,
		p.Completions, p.AfterComplete, p.NotCompleted, p.Inconsistent, p.DeadLetters, p.Crashes, p.Unknown, p.extra)
}

// classify counts, per published operation, its effect rows (store's
// database), its executions and completions (ledger), and checks every
// effect row against the execution that wrote it:
//
//   - lost: no effect row; duplicated: more than one; reexecuted: the
//     handler started more than once, exactly one effect row;
//   - uncommitted: executions that left no effect row (crashed, killed,
//     failed, rolled back);
//   - inconsistent: an effect row of an execution that pgstore said was
//     not committed (lease lost, cancelled, an error: anything but a
//     COMMIT of unknown outcome), or of no logged execution, or an
//     execution pgstore said was committed without its effect row;
//   - not_completed: applied operations whose record is not completed
//     (read through pgstore's Acquire, after the consumers stopped);
//   - after_complete: executions that began after their operation had
//     committed (as scenario 2 defines it);
//   - dead_letters: messages in the dead-letter queue (every operation
//     here must be applied, none dead-lettered).
func (r *pgRun) classify(name string) pgReport {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := pgReport{Name: name, effects: map[string][]string{}, results: map[string]string{}}
	led := r.led.Pool()

	// Effect rows.
	rows, err := r.pool.Query(ctx, `SELECT op_id, exec_id FROM `+worker.EffectsTable+` ORDER BY seq`)
	if err != nil {
		r.t.Fatal(err)
	}
	var op, exec string
	if _, err := pgx.ForEachRow(rows, []any{&op, &exec}, func() error {
		p.effects[op] = append(p.effects[op], exec)
		return nil
	}); err != nil {
		r.t.Fatal(err)
	}

	// Executions and how they ended.
	var result string
	rows, err = led.Query(ctx, `SELECT exec_id, coalesce(result, '') FROM executions`)
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
	// completed. The consumers have stopped: an Acquire that takes a lease
	// (the record was not completed) disturbs nobody.
	store, err := pgstore.New(r.pool, r.cfg)
	if err != nil {
		r.t.Fatal(err)
	}
	defer store.Close()

	for id, s := range ops {
		p.Ops++
		n := len(p.effects[id])
		p.Executions += s.executions
		p.Completions += s.completions
		p.AfterComplete += s.ac
		if s.expect != "apply" {
			p.problems = append(p.problems, fmt.Sprintf("%s: expectation %q: the pg scenarios expect every operation applied", id, s.expect))
		}
		switch {
		case n == 0:
			p.Lost++
			p.lostOps = append(p.lostOps, fmt.Sprintf("%s (executions %d: %s)", id, s.executions, r.execResults(ctx, id)))
		case n > 1:
			p.Duplicated++
			p.duplicatedOps = append(p.duplicatedOps, fmt.Sprintf("%s (effect rows of %v; executions %d: %s)", id, p.effects[id], s.executions, r.execResults(ctx, id)))
		case s.executions > 1:
			p.Reexecuted++
		}
		if n == 0 {
			continue
		}
		key := amqpidem.StoreKey(r.queue, id)
		if r.recordKey != nil {
			key = r.recordKey(id)
		}
		res, err := store.Acquire(ctx, lock.Request{Key: key})
		if err != nil {
			r.t.Fatalf("reading the record of %s: %v", id, err)
		}
		if res.Status != lock.Completed {
			p.NotCompleted++
			p.notComplete = append(p.notComplete, fmt.Sprintf("%s: %v (attempts %d, fence %d)", id, res.Status, res.Attempts, res.Fence))
		}
	}
	for id, execs := range p.effects {
		if _, ok := ops[id]; !ok {
			p.Unknown += len(execs)
		}
		for _, x := range execs {
			res, ok := p.results[x]
			switch {
			case !ok:
				p.Inconsistent++
				p.problems = append(p.problems, fmt.Sprintf("%s: effect row of execution %s, which the ledger never saw start", id, x))
			case strings.HasPrefix(res, "failed") && !commitUnknown(res):
				p.Inconsistent++
				p.problems = append(p.problems, fmt.Sprintf("%s: effect row of execution %s, which pgstore reported not committed: %s", id, x, res))
			}
		}
	}
	withEffect := map[string]bool{}
	for _, execs := range p.effects {
		for _, x := range execs {
			withEffect[x] = true
		}
	}
	for x, res := range p.results {
		if !withEffect[x] {
			p.Uncommitted++
			if res == "committed" {
				p.Inconsistent++
				p.problems = append(p.problems, fmt.Sprintf("execution %s: pgstore reported it committed, but it has no effect row", x))
			}
		}
	}
	p.DeadLetters = r.deadLetters()
	sort.Strings(p.lostOps)
	sort.Strings(p.duplicatedOps)
	sort.Strings(p.notComplete)
	sort.Strings(p.problems)
	return p
}

// commitUnknown reports whether an execution's logged end (worker.TxResult)
// is a commit whose outcome pgstore could not know (the connection broke
// during COMMIT): then its effect row may or may not exist. Any other
// failure means nothing was committed.
func commitUnknown(result string) bool {
	return strings.HasPrefix(result, "failed after-effect unavailable: ") && strings.Contains(result, "pgstore: commit")
}

// deadLetters returns how many messages wait in the dead-letter queue
// (which has no consumer), 0 if it was never declared.
func (r *pgRun) deadLetters() int {
	r.t.Helper()
	return r.queueMessages(r.queue + ".dlq")
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

// execResults lists how an operation's executions ended, for a failure
// message.
func (r *pgRun) execResults(ctx context.Context, op string) string {
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
// CHAOS_RESULTS) with extra appended, and checks what every pg scenario
// promises: nothing lost, nothing duplicated, nothing dead-lettered, every
// effect row from an execution that committed, every applied operation's
// record completed, no execution after a commit, nothing unknown.
func (r *pgRun) report(name, extra string) pgReport {
	r.t.Helper()
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
		r.t.Errorf("%s: %d operations lost (no effect row):%s", name, p.Lost, list(p.lostOps))
	}
	if p.Duplicated != 0 {
		r.t.Errorf("%s: %d operations duplicated (more than one effect row):%s", name, p.Duplicated, list(p.duplicatedOps))
	}
	if p.NotCompleted != 0 {
		r.t.Errorf("%s: %d applied operations whose record is not completed:%s", name, p.NotCompleted, list(p.notComplete))
	}
	if p.Inconsistent != 0 || len(p.problems) != 0 {
		r.t.Errorf("%s: %d effect rows disagree with what pgstore reported:%s", name, p.Inconsistent, list(p.problems))
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

// pgFlags are the consumer flags the pg scenarios share: a 2 s lease, short
// waits, and attempts enough for the faults (every execution a crash or a
// kill interrupted counts as an attempt).
var pgFlags = []string{"-lease", "2s", "-in-progress-delay", "300ms", "-unavailable-delay", "300ms",
	"-backoff", "100ms", "-max-attempts", "20"}
