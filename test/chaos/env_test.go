//go:build linux

package chaos_test

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// full selects the full sizes of `make chaos` (CHAOS_FULL=1); by default
// the scenarios run at the short sizes that `make test` can afford.
var full = os.Getenv("CHAOS_FULL") == "1"

// pick returns short, or long in full mode.
func pick[T any](short, long T) T {
	if full {
		return long
	}
	return short
}

const defaultPGDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

var pgService struct {
	once    sync.Once
	dsn     string
	missing string
}

// pgDSN returns the DSN of the PostgreSQL that holds the ledgers: PG_DSN
// (as for the other tests), else CHAOS_PG_DSN (its older name), else the
// local default. When it does not answer, the test
// fails (skipped under -short without CI=true, as testenv does).
func pgDSN(t *testing.T) string {
	t.Helper()
	pgService.once.Do(func() {
		dsn := cmp.Or(os.Getenv("PG_DSN"), os.Getenv("CHAOS_PG_DSN"), defaultPGDSN)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			pgService.missing = fmt.Sprintf("chaos: no PostgreSQL for the ledger at %s: %v\n"+
				"Start it (pg_ctlcluster 15 main start) or set PG_DSN.", dsn, err)
			return
		}
		_ = conn.Close(ctx)
		pgService.dsn = dsn
	})
	if pgService.dsn == "" {
		if testing.Short() && os.Getenv("CI") != "true" {
			t.Skip(pgService.missing)
		}
		t.Fatal(pgService.missing)
	}
	return pgService.dsn
}

// env is one scenario's world: a unique name for its queue, Redis prefix
// and connections, a throwaway redis-server, a ledger schema, a publisher
// and the consumer processes it starts. Everything is removed in
// t.Cleanup.
type env struct {
	t        *testing.T
	name     string
	dir      string
	amqp     string
	dsn      string
	schema   string
	queue    string
	led      *ledger.Ledger
	redis    *testenv.Server
	sentinel *testenv.Sentinel // with envOptions.sentinel
	rabbit   *testenv.Rabbit   // with envOptions.rabbitCluster
	pub      *workload.Publisher
	rng      *rand.Rand

	mu        sync.Mutex
	history   bool // consumers record their store's history (recordHistory)
	procs     []*proc
	starts    map[string]int
	exchanges []string
	queues    []string
}

type envOptions struct {
	// redisArgs are passed to the throwaway redis-server.
	redisArgs []string
	// queueArgs declare the queue (the consumers declare it alike).
	queueArgs amqp.Table
	// sentinel starts a Redis master with a replica and three Sentinels
	// (env.sentinel) instead of one server; env.redis is its first master.
	sentinel bool
	// rabbitCluster starts a RabbitMQ cluster of three nodes (env.rabbit)
	// for the scenario; env.amqp is then its first node, where the
	// publisher connects and the queue is declared.
	rabbitCluster bool
	// rabbit is a cluster the caller started (testenv.RabbitCluster) for
	// several runs: env.amqp is its first node, as with rabbitCluster, and
	// the run's queues and exchanges are deleted in cleanup.
	rabbit *testenv.Rabbit
}

func newEnv(t *testing.T, o envOptions) *env {
	t.Helper()
	if testing.Short() {
		t.Skip("chaos scenarios are skipped under -short")
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		msg := fmt.Sprintf("chaos: the scenarios need rabbitmqctl on PATH to watch queues and close connections: %v", err)
		if os.Getenv("CI") != "true" && os.Getenv("AMQP_URL") != "" {
			t.Skip(msg + " (skipped: AMQP_URL points elsewhere)")
		}
		t.Fatal(msg)
	}
	e := &env{
		t:      t,
		name:   testenv.Name(t),
		dir:    t.TempDir(), // CHAOS_KEEP=1: a directory that is kept
		dsn:    pgDSN(t),
		starts: map[string]int{},
	}
	if o.rabbitCluster {
		// Its nodes are killed in cleanup, after everything below.
		e.rabbit = testenv.RabbitCluster(t)
		e.amqp = e.rabbit.Nodes[0].AMQPURL
	} else if o.rabbit != nil {
		e.rabbit = o.rabbit
		e.amqp = e.rabbit.Nodes[0].AMQPURL
	} else {
		e.amqp = testenv.AMQPURL(t)
	}
	e.queue = e.name
	if os.Getenv("CHAOS_KEEP") == "1" {
		dir, err := os.MkdirTemp("", e.name+"-")
		if err != nil {
			t.Fatal(err)
		}
		e.dir = dir
		t.Logf("chaos: CHAOS_KEEP=1: consumer logs and events kept in %s", dir)
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("CHAOS_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	e.rng = rand.New(rand.NewPCG(seed, seed>>1|1))
	t.Logf("chaos: %s seed %d (CHAOS_SEED reproduces the workload)", e.name, seed)

	e.schema = schemaFor(e.name)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ledger.Create(ctx, e.dsn, e.schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if os.Getenv("CHAOS_KEEP") == "1" {
			t.Logf("chaos: CHAOS_KEEP=1: ledger schema %s kept", e.schema)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := ledger.Drop(ctx, e.dsn, e.schema); err != nil {
			t.Errorf("dropping the ledger: %v", err)
		}
	})
	led, err := ledger.Open(ctx, e.dsn, e.schema, 4)
	if err != nil {
		t.Fatal(err)
	}
	e.led = led
	t.Cleanup(led.Close)

	if o.sentinel {
		e.sentinel = testenv.RedisSentinel(t)
		e.redis = e.sentinel.Master
	} else {
		e.redis = testenv.RedisServer(t, o.redisArgs...)
	}

	e.pub, err = workload.Dial(e.amqp, e.name+"-publisher")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.pub.Close() })
	if _, err := e.pub.Channel().QueueDeclare(e.queue, true, false, false, false, o.queueArgs); err != nil {
		t.Fatalf("declare %s: %v", e.queue, err)
	}
	if e.rabbit == nil || o.rabbit != nil { // a cluster of its own goes with its queues
		t.Cleanup(e.deleteTopology)
	}
	t.Cleanup(e.stopProcs)
	return e
}

// schemaFor makes a PostgreSQL schema name from a test name.
func schemaFor(name string) string {
	var b strings.Builder
	b.WriteString("chaos_")
	for _, r := range strings.ToLower(name) {
		switch {
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	s := b.String()
	if len(s) > 63 {
		s = s[:54] + s[len(s)-9:] // keep the random suffix
	}
	return s
}

// deleteTopology deletes the run's queues (the queue, its delay and
// dead-letter queues, and any other declared) and exchanges.
func (e *env) deleteTopology() {
	conn, err := amqp.Dial(e.amqp)
	if err != nil {
		e.t.Errorf("cleanup: dial: %v", err)
		return
	}
	defer conn.Close()
	names, err := e.listQueues()
	if err != nil {
		e.t.Logf("cleanup: listing queues: %v", err)
	}
	seen := map[string]bool{}
	e.mu.Lock()
	extra := append([]string(nil), e.queues...)
	exchanges := append([]string(nil), e.exchanges...)
	e.mu.Unlock()
	for _, q := range append(append([]string{e.queue, e.queue + ".dlq"}, extra...), keys(names)...) {
		if seen[q] {
			continue
		}
		seen[q] = true
		ch, err := conn.Channel()
		if err != nil {
			e.t.Errorf("cleanup: channel: %v", err)
			return
		}
		_, _ = ch.QueueDelete(q, false, false, false)
		_ = ch.Close()
	}
	for _, x := range exchanges {
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		_ = ch.ExchangeDelete(x, false, false)
		_ = ch.Close()
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// own records a queue or exchange the scenario declared, for cleanup.
func (e *env) ownQueue(name string) {
	e.mu.Lock()
	e.queues = append(e.queues, name)
	e.mu.Unlock()
}

func (e *env) ownExchange(name string) {
	e.mu.Lock()
	e.exchanges = append(e.exchanges, name)
	e.mu.Unlock()
}

// addOps records ops in the ledger with the same expectation.
func (e *env) addOps(expect string, ops []workload.Op) {
	e.t.Helper()
	recs := make([]ledger.Op, len(ops))
	for i, o := range ops {
		recs[i] = ledger.Op{ID: ledger.OpID(o.ID), Expect: expect}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := e.led.AddOps(ctx, recs); err != nil {
		e.t.Fatal(err)
	}
}

// publish records ops (expecting them applied) and publishes their copies,
// shuffled. It returns the number of messages.
func (e *env) publish(ops []workload.Op) int {
	e.t.Helper()
	e.addOps(ledger.ExpectApply, ops)
	return e.publishCopies(ops)
}

// publishCopies publishes ops' copies without recording them.
func (e *env) publishCopies(ops []workload.Op) int {
	e.t.Helper()
	msgs := workload.Messages(ops, e.rng)
	e.publishMessages(msgs)
	return len(msgs)
}

func (e *env) publishMessages(msgs []workload.Message) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := e.pub.Publish(ctx, e.queue, msgs); err != nil {
		e.t.Fatal(err)
	}
}

// applied returns how many operations the ledger has applied.
func (e *env) applied() int {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n, err := e.led.AppliedCount(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	return n
}

// count runs a query on the ledger that returns one integer.
func (e *env) count(sql string, args ...any) int {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var n int
	if err := e.led.Pool().QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// waitFor polls cond every 200 ms until it holds, failing the test after
// timeout with what status says.
func (e *env) waitFor(what string, timeout time.Duration, cond func() bool, status func() string) {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			msg := ""
			if status != nil {
				msg = status()
			}
			e.t.Fatalf("timed out after %v waiting for %s %s", timeout, what, msg)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// settle waits until want operations are applied and the queue and its
// delay queues have been empty, nothing unacknowledged, on two checks in a
// row at least quiet apart. Dead-letter queues are not waited for.
func (e *env) settle(want int, timeout, quiet time.Duration) {
	e.t.Helper()
	start := time.Now()
	e.waitFor(fmt.Sprintf("%d operations applied", want), timeout,
		func() bool { return e.applied() >= want },
		func() string { return fmt.Sprintf("(applied %d)", e.applied()) })
	e.waitDrained(timeout-time.Since(start), quiet)
}

// waitDrained waits until the queue and its delay queues hold no message,
// ready or unacknowledged, on two checks at least quiet apart.
func (e *env) waitDrained(timeout, quiet time.Duration) {
	e.t.Helper()
	timeout = max(timeout, time.Minute)
	var last map[string][2]int
	emptySince := time.Time{}
	e.waitFor("the queues to drain", timeout, func() bool {
		depths, err := e.listQueues()
		if err != nil {
			e.t.Logf("list queues: %v", err)
			return false
		}
		last = depths
		for q, d := range depths {
			if strings.HasSuffix(q, ".dlq") || !strings.HasPrefix(q, e.queue) {
				continue
			}
			if d[0] != 0 || d[1] != 0 {
				emptySince = time.Time{}
				return false
			}
		}
		if emptySince.IsZero() {
			emptySince = time.Now()
			return false
		}
		return time.Since(emptySince) >= quiet
	}, func() string { return fmt.Sprintf("(queues: %v)", last) })
}

// report classifies the ledger, prints the scenario line and its detail,
// and checks what every scenario promises: nothing lost, nothing
// duplicated, no execution of unknown operations, and (unless the store
// lost data) no execution after an operation completed.
func (e *env) report(name string, deadLetters map[string]int, storeLostData bool) ledger.Report {
	e.t.Helper()
	return e.reportWith(name, "", deadLetters, storeLostData)
}

// reportWith is report with extra appended to the scenario line.
func (e *env) reportWith(name, extra string, deadLetters map[string]int, storeLostData bool) ledger.Report {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := e.led.Classify(ctx, name, deadLetters)
	if err != nil {
		e.t.Fatal(err)
	}
	printFigures(e.t, r.Line()+extra, r.Detail())
	if r.Lost != 0 {
		e.t.Errorf("%s: %d operations lost:%s", name, r.Lost, r.Failing(10, ledger.OpStats.Lost))
	}
	if r.Duplicated != 0 {
		e.t.Errorf("%s: %d operations duplicated:%s", name, r.Duplicated, r.Failing(10, ledger.OpStats.Duplicated))
	}
	if r.Unknown != 0 {
		e.t.Errorf("%s: %d executions or dead letters of operations never published", name, r.Unknown)
	}
	if !storeLostData && r.AfterComplete != 0 {
		e.t.Errorf("%s: %d executions began after their operation had completed:%s", name, r.AfterComplete,
			r.Failing(10, func(s ledger.OpStats) bool { return s.AfterComplete > 0 }))
	}
	return r
}

// figures prints a scenario's line of figures (printFigures).
func (e *env) figures(line string) { printFigures(e.t, line) }

// printFigures prints lines of a scenario's figures on stdout, logs them,
// and appends them to the file CHAOS_RESULTS names, if any.
func printFigures(t *testing.T, lines ...string) {
	t.Helper()
	for _, l := range lines {
		fmt.Println(l)
		t.Log(l)
	}
	if path := os.Getenv("CHAOS_RESULTS"); path != "" {
		if f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
			for _, l := range lines {
				fmt.Fprintln(f, l)
			}
			f.Close()
		}
	}
}

// events reads the event logs of every consumer the scenario started.
func (e *env) events() []worker.EventRecord {
	e.t.Helper()
	paths, _ := filepath.Glob(filepath.Join(e.dir, "*.events"))
	evs, err := worker.ReadEvents(paths...)
	if err != nil {
		e.t.Fatal(err)
	}
	return evs
}

// ledgerStats is short for the ledger's per-operation statistics.
type ledgerStats = ledger.OpStats
