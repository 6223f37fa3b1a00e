//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
)

// dynRun is a scenario on the DynamoDB store (dynamostore, issue 25): the
// env, plus a records table and an effects table of its own on one of the
// tests' DynamoDB servers (testenv.EachDynamo: minidyn or DynamoDB Local),
// both deleted in t.Cleanup. The ledger (executions, completions, crashes) stays in
// PostgreSQL; the effects are items in the effects table, one per
// execution whose transaction committed (worker.DynamoEffectKey).
type dynRun struct {
	*env
	server         string // testenv.DynamoServer.Name, in the scenario lines
	endpoint       string
	table, effects string
	client         *dynamodb.Client
	cfg            dynamostore.Config
	start          time.Time
}

// logf logs with the time since the run was set up.
func (r *dynRun) logf(format string, args ...any) {
	r.t.Helper()
	r.t.Logf("[%5.1fs] "+format, append([]any{time.Since(r.start).Seconds()}, args...)...)
}

// newDynRun makes the env and the run's two tables on srv: the records
// table with dynamostore.CreateTable, the effects table as
// worker.DynamoEffectsInput defines it. The test, its consumers and the
// tables all sign with worker.DynamoClient's credentials: DynamoDB Local
// keeps a database per access key.
func newDynRun(t *testing.T, srv testenv.DynamoServer) *dynRun {
	t.Helper()
	start := time.Now()
	e := newEnv(t, envOptions{})
	endpoint := srv.Endpoint
	consumerBinary(t)
	r := &dynRun{env: e, server: srv.Name, endpoint: endpoint, table: e.name + "-records", effects: e.name + "-effects",
		client: worker.DynamoClient(endpoint, 30*time.Second), start: start}
	r.cfg = worker.DynamoStoreConfig(e.name, r.table, 0)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	t.Cleanup(func() { r.deleteTables() })
	if err := dynamostore.CreateTable(ctx, r.client, r.cfg); err != nil {
		t.Fatalf("creating the records table: %v", err)
	}
	if _, err := r.client.CreateTable(ctx, worker.DynamoEffectsInput(r.effects)); err != nil {
		t.Fatalf("creating the effects table: %v", err)
	}
	r.logf("set up (DynamoDB %s at %s, tables %s and %s)", srv.Name, endpoint, r.table, r.effects)
	return r
}

// deleteTables deletes the run's tables (kept with CHAOS_KEEP=1); a table
// that was never made is no error.
func (r *dynRun) deleteTables() {
	if os.Getenv("CHAOS_KEEP") == "1" {
		r.t.Logf("chaos: CHAOS_KEEP=1: DynamoDB tables %s and %s kept at %s", r.table, r.effects, r.endpoint)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, name := range []string{r.table, r.effects} {
		_, err := r.client.DeleteTable(ctx, &dynamodb.DeleteTableInput{TableName: aws.String(name)})
		var missing *types.ResourceNotFoundException
		if err != nil && !errors.As(err, &missing) {
			r.t.Errorf("deleting the DynamoDB table %s: %v", name, err)
		}
	}
}

// flags are a consumer's flags for the DynamoDB store, then extra.
func (r *dynRun) flags(extra ...string) []string {
	return append([]string{"-store-dynamo", r.endpoint, "-dynamo-table", r.table, "-dynamo-effects", r.effects}, extra...)
}

// dynEffect is one item of the effects table.
type dynEffect struct {
	exec, op, consumer string
	fence              int64
}

// scanEffects reads the whole effects table (strongly consistent).
func (r *dynRun) scanEffects(ctx context.Context) ([]dynEffect, error) {
	var out []dynEffect
	pages := dynamodb.NewScanPaginator(r.client, &dynamodb.ScanInput{TableName: aws.String(r.effects), ConsistentRead: aws.Bool(true)})
	for pages.HasMorePages() {
		page, err := pages.NextPage(ctx)
		if err != nil {
			return nil, err
		}
		for _, it := range page.Items {
			var e dynEffect
			e.exec = attrS(it[worker.DynamoEffectKey])
			e.op = attrS(it[worker.DynamoEffectOp])
			e.consumer = attrS(it[worker.DynamoEffectConsumer])
			if n, ok := it[worker.DynamoEffectFence].(*types.AttributeValueMemberN); ok {
				e.fence, _ = strconv.ParseInt(n.Value, 10, 64)
			}
			out = append(out, e)
		}
	}
	return out, nil
}

func attrS(v types.AttributeValue) string {
	if s, ok := v.(*types.AttributeValueMemberS); ok {
		return s.Value
	}
	return ""
}

// applied returns how many operations have an effect item.
func (r *dynRun) applied() (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	effects, err := r.scanEffects(ctx)
	if err != nil {
		return 0, err
	}
	ops := map[string]bool{}
	for _, e := range effects {
		ops[e.op] = true
	}
	return len(ops), nil
}

// settle waits until want operations are applied and the queues drained.
func (r *dynRun) settle(want int, timeout, quiet time.Duration) {
	r.t.Helper()
	start := time.Now()
	n := 0
	var last error
	r.waitFor(fmt.Sprintf("%d operations applied", want), timeout, func() bool {
		n, last = r.applied()
		return last == nil && n >= want
	}, func() string { return fmt.Sprintf("(applied %d, last error %v)", n, last) })
	r.logf("%d operations applied", want)
	r.waitDrained(timeout-time.Since(start), quiet)
	r.logf("queues drained")
}

// dynReport is the classification of a dynamo run: the pg scenarios'
// figures (pgReport), from effect items instead of rows.
type dynReport = pgReport

// classify counts, per published operation, its effect items, its
// executions and completions (ledger), and checks every effect item
// against the execution that put it, as pgRun.classify does: lost (no
// item), duplicated (more than one), reexecuted, uncommitted (executions
// that left no item), inconsistent (an item of an execution dynamostore
// reported not committed, other than a transaction whose answer never
// came; of no logged execution; or an execution reported committed with
// no item), not_completed (an applied operation whose record, read with
// lock.Admin's Inspect after the consumers stopped, is not completed),
// after_complete, dead_letters, unknown.
func (r *dynRun) classify(name string) dynReport {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := dynReport{Name: name, effects: map[string][]string{}, results: map[string]string{}}
	led := r.led.Pool()

	items, err := r.scanEffects(ctx)
	if err != nil {
		r.t.Fatalf("reading the effects table: %v", err)
	}
	for _, e := range items {
		p.effects[e.op] = append(p.effects[e.op], e.exec)
	}

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

	store, err := dynamostore.New(r.client, r.cfg)
	if err != nil {
		r.t.Fatal(err)
	}
	for id, s := range ops {
		p.Ops++
		n := len(p.effects[id])
		p.Executions += s.executions
		p.Completions += s.completions
		p.AfterComplete += s.ac
		if s.expect != "apply" {
			p.problems = append(p.problems, fmt.Sprintf("%s: expectation %q: the dynamo scenarios expect every operation applied", id, s.expect))
		}
		switch {
		case n == 0:
			p.Lost++
			p.lostOps = append(p.lostOps, fmt.Sprintf("%s (executions %d: %s)", id, s.executions, r.execResults(ctx, id)))
		case n > 1:
			p.Duplicated++
			p.duplicatedOps = append(p.duplicatedOps, fmt.Sprintf("%s (effect items of %v; executions %d: %s)", id, p.effects[id], s.executions, r.execResults(ctx, id)))
		case s.executions > 1:
			p.Reexecuted++
		}
		if n == 0 {
			continue
		}
		rec, err := store.Inspect(ctx, amqpidem.StoreKey(r.queue, id))
		if err != nil {
			r.t.Fatalf("reading the record of %s: %v", id, err)
		}
		if rec.State != lock.StateCompleted {
			p.NotCompleted++
			p.notComplete = append(p.notComplete, fmt.Sprintf("%s: %v (attempts %d, fence %d)", id, rec.State, rec.Attempts, rec.Fence))
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
				p.problems = append(p.problems, fmt.Sprintf("%s: effect item of execution %s, which the ledger never saw start", id, x))
			case strings.HasPrefix(res, "failed") && !dynCommitUnknown(res):
				p.Inconsistent++
				p.problems = append(p.problems, fmt.Sprintf("%s: effect item of execution %s, which dynamostore reported not committed: %s", id, x, res))
			}
		}
	}
	for x, res := range p.results {
		if !withEffect[x] {
			p.Uncommitted++
			if res == "committed" {
				p.Inconsistent++
				p.problems = append(p.problems, fmt.Sprintf("execution %s: dynamostore reported it committed, but it has no effect item", x))
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

// dynCommitUnknown reports whether an execution's logged end
// (worker.TxResult) is a TransactWriteItems whose answer never came
// (dynamostore says its outcome may be unknown): its effect item may or
// may not exist. A cancelled transaction wrote nothing.
func dynCommitUnknown(result string) bool {
	return strings.HasPrefix(result, "failed after-effect unavailable: ") && strings.Contains(result, "outcome may be unknown")
}

// execResults lists how an operation's executions ended, for a failure
// message.
func (r *dynRun) execResults(ctx context.Context, op string) string {
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
// CHAOS_RESULTS) with extra appended, and checks what the pg scenarios
// check (pgRun.report), on the effect items. The line names the scenario
// and the server: "scenario dynamo-kill9/dynamodb-local ...".
func (r *dynRun) report(name, extra string) dynReport {
	r.t.Helper()
	name += "/" + r.server
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
		r.t.Errorf("%s: %d operations lost (no effect item):%s", name, p.Lost, list(p.lostOps))
	}
	if p.Duplicated != 0 {
		r.t.Errorf("%s: %d operations duplicated (more than one effect item):%s", name, p.Duplicated, list(p.duplicatedOps))
	}
	if p.NotCompleted != 0 {
		r.t.Errorf("%s: %d applied operations whose record is not completed:%s", name, p.NotCompleted, list(p.notComplete))
	}
	if p.Inconsistent != 0 || len(p.problems) != 0 {
		r.t.Errorf("%s: %d effect items disagree with what dynamostore reported:%s", name, p.Inconsistent, list(p.problems))
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

// dynFlags are the consumer flags the dynamo scenarios share: pgFlags (a
// 2 s lease, short waits, attempts enough for the faults).
var dynFlags = pgFlags
