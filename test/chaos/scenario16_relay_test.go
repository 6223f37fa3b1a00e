//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 16, the producer outbox's relay (issue 24): writers in the test
// process insert rows with their outbox messages (pgstore.Outbox.Write) in
// transactions of 1 to 8 rows, a fifth of them rolled back; three relay
// processes (cmd/relay, supervised: restarted when they die) publish them
// to a quorum queue of a private three-node RabbitMQ cluster, through an
// exchange that also routes every copy to a tap queue nobody consumes; two
// consumer processes apply them into the fenced ledger, keyed by the row's
// MessageId (the operation id). Meanwhile relays are killed with kill -9
// and stopped with SIGSTOP (some for longer than their claim, so that the
// others take their rows over), each victim a relay seen holding a claim
// when there is one, and once the broker node every process dials first,
// which leads the queue, is killed (kill -9 of its VM) and restarted.
// README.md, "The producer outbox's relay", has the details.
//
// Every committed row must be applied exactly once (lost=0,
// duplicated=0), and no rolled-back row's message may ever reach the
// broker or a handler (phantom=0): its MessageId is in neither the tap nor
// the ledger's executions. Each committed row ends sent, none dead. The
// copies beyond one per row (extra_publishes, counted in the tap) are the
// relays' re-publishes: a row published and not yet marked sent when its
// relay died or stopped past its claim, or whose confirm the broker's
// restart lost.
//
// The two runs share one cluster (its start is the slowest part): kill9
// kills relays often and stops them briefly; sigstop stops them often,
// most past their claim, and kills a few.
func TestChaos16Relay(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos scenarios are skipped under -short")
	}
	pgDSN(t)
	relayBinary(t)
	consumerBinary(t)
	rabbit := testenv.RabbitCluster(t)
	t.Run("kill9", func(t *testing.T) {
		relayRun(t, rabbit, relayFaults{name: "relay-kill9", kills: pick(4, 12), pauses: pick(2, 4), pauseMin: 0.3, pauseMax: 1.5})
	})
	t.Run("sigstop", func(t *testing.T) {
		relayRun(t, rabbit, relayFaults{name: "relay-sigstop", kills: pick(2, 3), pauses: pick(5, 12), pauseMin: 1.2, pauseMax: 2.5})
	})
}

// relayFaults is what one run of scenario 16 does to its relays: kills
// kill -9 and pauses SIGSTOPs, each pause lasting pauseMin to pauseMax
// claim TTLs.
type relayFaults struct {
	name               string
	kills, pauses      int
	pauseMin, pauseMax float64
}

// relayOrderKeys is how many order keys each writer uses when the relays
// run with -ordered (CHAOS_RELAY_FLAGS).
const relayOrderKeys = 8

// relayClaimTTL is the relays' RelayConfig.ClaimTTL in scenario 16.
const relayClaimTTL = 3 * time.Second

func relayRun(t *testing.T, rabbit *testenv.Rabbit, f relayFaults) {
	e := newEnv(t, envOptions{rabbit: rabbit, queueArgs: amqp.Table{"x-queue-type": "quorum"}})
	start := time.Now()
	nRows := pick(500, 5000)
	node := rabbit.Nodes[0]
	// A node the run kills is running again when it ends, before the
	// topology is deleted through it (cleanups run last first).
	t.Cleanup(func() {
		if node.Pid() == 0 {
			node.Start()
		}
	})
	urls := make([]string, len(rabbit.Nodes))
	for i, n := range rabbit.Nodes {
		urls[i] = n.AMQPURL
	}

	// The exchange routes each copy to the work queue and to the tap.
	tap := "tap." + e.queue
	exchange := e.name + ".relay"
	ch := e.pub.Channel()
	if _, err := ch.QueueDeclare(tap, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	e.ownQueue(tap)
	if err := ch.ExchangeDeclare(exchange, "direct", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	e.ownExchange(exchange)
	for _, q := range []string{e.queue, tap} {
		if err := ch.QueueBind(q, e.queue, exchange, false, nil); err != nil {
			t.Fatal(err)
		}
	}

	ctx := context.Background()
	pcfg, err := pgxpool.ParseConfig(e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cfg := pgstore.Config{Schema: e.schema, CleanupInterval: -1}
	if err := pgstore.Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	ob, err := pgstore.NewOutbox(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	outbox := pgx.Identifier{e.schema, pgstore.DefaultOutboxTable}.Sanitize()

	for i := range 2 {
		e.consumer(fmt.Sprintf("%s-c%d", e.name, i), "-amqp", strings.Join(urls, ","), "-quorum", "-quorum-dlq",
			"-lease", "5s", "-concurrency", "4", "-heartbeat", "2s", "-in-progress-delay", "300ms",
			"-unavailable-delay", "300ms", "-max-attempts", "20", "-delay-in-process")
	}
	// -max-attempts 2: the queue is always bound, so nothing here may
	// count as a refusal; the nacks of a quorum queue electing a leader
	// after the node kill once did, and turned rows dead.
	relayFlags := []string{"-amqp", strings.Join(urls, ","),
		"-claim-ttl", relayClaimTTL.String(), "-publish-timeout", "2s", "-poll", "200ms", "-batch", "16",
		"-concurrency", "16", "-max-attempts", "2"}
	// CHAOS_RELAY_FLAGS adds flags (cmd/relay's) to every relay, to try
	// other settings: "-ordered".
	relayFlags = append(relayFlags, strings.Fields(os.Getenv("CHAOS_RELAY_FLAGS"))...)
	relays := e.superviseWith(e.name+"-relay", e.startRelay, 3, relayFlags...)
	kills := 0
	// A relay that exits by itself (a refused flag) is restarted every
	// 100 ms by the supervisor: fail rather than spin.
	relaysDying := func() {
		relays.mu.Lock()
		n, last := relays.restarts, relays.slots[0]
		relays.mu.Unlock()
		if n > kills+3 {
			t.Fatalf("%s: relays restarted %d times for %d kills: they exit by themselves; %s:\n%s", f.name, n, kills, last.name, tail(last.output(), 2<<10))
		}
	}

	// The writers: 4 goroutines, transactions of 1 to 8 rows with a pause
	// between them, a fifth rolled back, until nRows rows are committed.
	ordered := slices.Contains(relayFlags, "-ordered")
	w := &relayWriters{ob: ob, pool: pool, exchange: exchange, key: e.queue, target: nRows, ordered: ordered}
	seed := e.rng.Uint64()
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(ctx, fmt.Sprintf("%s-w%d", e.name, i), seed+uint64(i), pick(1200, 300))
		}()
	}
	writersDone := make(chan struct{})
	go func() { wg.Wait(); close(writersDone) }()
	// A run that fails midway stops its writers before their pool closes.
	t.Cleanup(func() {
		w.stop.Store(true)
		<-writersDone
	})
	writing := func() bool {
		select {
		case <-writersDone:
			return false
		default:
			return true
		}
	}
	pending := func() int { return e.count("SELECT count(*)::int FROM " + outbox + " WHERE state = 'p'") }

	// The faults, until each has been done or every row is out.
	type pausedRelay struct {
		p     *proc
		since time.Time
		until time.Time
	}
	var paused []pausedRelay
	var pausedFor time.Duration
	resumeDue := func(all bool) {
		kept := paused[:0]
		for _, pr := range paused {
			if all || time.Now().After(pr.until) {
				pr.p.resume()
				pausedFor += time.Since(pr.since)
				continue
			}
			kept = append(kept, pr)
		}
		paused = kept
	}
	pauses, restarts, midKills, midPauses, killsHolding, pausesHolding := 0, 0, 0, 0, 0, 0
	// claimHolders are the relays whose claim on a pending row runs.
	claimHolders := func() map[string]bool {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		rows, err := pool.Query(ctx, "SELECT DISTINCT claimed_by FROM "+outbox+
			" WHERE state = 'p' AND claimed_by IS NOT NULL AND due_at > clock_timestamp()")
		if err != nil {
			t.Fatal(err)
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]bool{}
		for _, n := range names {
			m[n] = true
		}
		return m
	}
	var downAt time.Time
	var downFor time.Duration
	deadline := time.Now().Add(pick(3*time.Minute, 8*time.Minute))
	next := time.Now().Add(500 * time.Millisecond)
	for (kills < f.kills || pauses < f.pauses || restarts == 0) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		resumeDue(false)
		relaysDying()
		if time.Now().Before(next) {
			continue
		}
		next = time.Now().Add(time.Duration(200+e.rng.IntN(500)) * time.Millisecond)
		if !writing() && pending() == 0 && (downAt.IsZero() || restarts > 0) {
			break // nothing left to disturb
		}
		switch {
		case downAt.IsZero() && w.committedRows() >= nRows/2:
			// The broker node every process dials first, leading the
			// queue: killed, and started again 3 s later (the faults on
			// the relays go on meanwhile).
			node.Kill()
			downAt = time.Now()
			t.Logf("%s: killed RabbitMQ node %s with %d rows committed, %d pending", f.name, node.Name, w.committedRows(), pending())
			continue
		case restarts == 0 && !downAt.IsZero() && time.Since(downAt) >= 3*time.Second:
			node.Start()
			downFor = time.Since(downAt)
			restarts++
			continue
		}
		live := relays.live()
		var running []*proc
		for _, p := range live {
			if !slicesContainsProc(paused, func(pr pausedRelay) *proc { return pr.p }, p) {
				running = append(running, p)
			}
		}
		// The kind of fault further behind its count goes next. A running
		// relay is killed, or a stopped one when only one runs: one relay
		// is always left running.
		doKill := kills < f.kills && (pauses >= f.pauses || kills*f.pauses <= pauses*f.kills)
		candidates := running
		switch {
		case doKill && len(running) < 2: // a stopped one, sparing the one running
			candidates = slices.DeleteFunc(slices.Clone(live), func(p *proc) bool { return slices.Contains(running, p) })
		case doKill:
		case pauses >= f.pauses || len(running) < 2:
			continue
		}
		if len(candidates) == 0 {
			continue
		}
		// The victim is a relay holding a claim when one is seen within
		// 1 s (a round lasts milliseconds: look often), else any.
		victim, holding := candidates[e.rng.IntN(len(candidates))], false
		for look := time.Now(); time.Since(look) < time.Second && !holding; time.Sleep(5 * time.Millisecond) {
			holders := claimHolders()
			for _, p := range candidates {
				if holders[p.name] {
					victim, holding = p, true
					break
				}
			}
		}
		busy := writing() || pending() > 0
		if doKill {
			victim.kill()
			for i, pr := range paused {
				if pr.p == victim {
					pausedFor += time.Since(pr.since)
					paused = slices.Delete(paused, i, i+1)
					break
				}
			}
			kills++
			if busy {
				midKills++
			}
			if holding {
				killsHolding++
			}
			continue
		}
		d := time.Duration((f.pauseMin + e.rng.Float64()*(f.pauseMax-f.pauseMin)) * float64(relayClaimTTL))
		victim.pause()
		paused = append(paused, pausedRelay{p: victim, since: time.Now(), until: time.Now().Add(d)})
		pauses++
		if busy {
			midPauses++
		}
		if holding {
			pausesHolding++
		}
	}
	resumeDue(true)
	<-writersDone
	if err := w.failure(); err != nil {
		t.Fatal(err)
	}
	committed, rolledBack := w.ids()
	ops := make([]workload.Op, len(committed))
	for i, id := range committed {
		ops[i] = workload.Op{ID: id}
	}
	e.addOps(ledger.ExpectApply, ops)

	e.waitFor("every committed row sent", pick(3*time.Minute, 6*time.Minute), func() bool { relaysDying(); return pending() == 0 },
		func() string { return fmt.Sprintf("(%d rows pending)", pending()) })
	// A dead row is never published: wait for the others, and let the
	// report count it lost.
	dead := e.count("SELECT count(*)::int FROM " + outbox + " WHERE state = 'd'")
	e.settle(len(committed)-dead, pick(3*time.Minute, 6*time.Minute), 2*time.Second)
	relayRestarts, err := relays.halt()
	if err != nil {
		t.Errorf("restarting relays: %v", err)
	}
	e.terminateAll()
	elapsed := time.Since(start)

	// The tap: every copy the broker took.
	copies, order := e.drainTap(tap, urls)
	outOfOrder := 0
	if ordered {
		outOfOrder = relayOrderViolations(t, order)
	}
	rolled := make(map[string]bool, len(rolledBack))
	for _, id := range rolledBack {
		rolled[id] = true
	}
	tapCopies, phantom, lostAtBroker := 0, 0, 0
	for id, n := range copies {
		tapCopies += n
		if rolled[id] {
			phantom++
			t.Errorf("%s: the message of rolled-back row %s reached the broker (%d copies)", f.name, id, n)
		}
	}
	for _, id := range committed {
		if copies[id] == 0 {
			lostAtBroker++
		}
	}
	if lostAtBroker > 0 {
		t.Errorf("%s: %d committed rows never reached the broker", f.name, lostAtBroker)
	}
	if n := e.count("SELECT count(*)::int FROM executions WHERE op_id = ANY($1)", rolledBack); n > 0 {
		phantom += n
		t.Errorf("%s: %d executions of rolled-back rows", f.name, n)
	}
	sent := e.count("SELECT count(*)::int FROM " + outbox + " WHERE state = 's'")
	if sent != len(committed) || dead != 0 {
		t.Errorf("%s: outbox rows sent %d, dead %d; want %d and 0", f.name, sent, dead, len(committed))
	}
	if n := e.count("SELECT count(*)::int FROM "+outbox+" WHERE message_id = ANY($1)", rolledBack); n > 0 {
		t.Errorf("%s: %d rows of rolled-back transactions in the outbox", f.name, n)
	}
	refused := e.grepAll("the broker refused a message")
	maxAttempts := e.count("SELECT coalesce(max(attempts), 0)::int FROM " + outbox)

	extra := fmt.Sprintf(" phantom=%d rows_committed=%d rows_rolled_back=%d txs_committed=%d txs_rolled_back=%d relays=3 kills=%d kills_holding_claims=%d pauses=%d pauses_holding_claims=%d paused_ms=%d relay_restarts=%d broker_restarts=%d broker_down_ms=%d tap_copies=%d extra_publishes=%d refused=%d max_attempts=%d dead=%d seconds=%.1f",
		phantom, len(committed), len(rolledBack), w.txs[0], w.txs[1], kills, killsHolding, pauses, pausesHolding, pausedFor.Milliseconds(), relayRestarts,
		restarts, downFor.Milliseconds(), tapCopies, tapCopies-(len(committed)-lostAtBroker), refused, maxAttempts, dead, elapsed.Seconds())
	if ordered {
		extra += fmt.Sprintf(" ordered=1 out_of_order=%d", outOfOrder)
	}
	e.reportWith(f.name, extra, nil, false)

	if restarts != 1 {
		t.Errorf("%s: the broker was restarted %d times, want once", f.name, restarts)
	}
	if midKills < min(2, f.kills) || midPauses < min(2, f.pauses) {
		t.Errorf("%s: %d kills and %d pauses landed while rows were being written or pending, want at least 2 of each", f.name, midKills, midPauses)
	}
	if len(rolledBack) == 0 {
		t.Errorf("%s: no transaction was rolled back", f.name)
	}
}

// slicesContainsProc reports whether p is the proc of one of s.
func slicesContainsProc[T any](s []T, of func(T) *proc, p *proc) bool {
	for _, v := range s {
		if of(v) == p {
			return true
		}
	}
	return false
}

// relayWriters write scenario 16's rows.
type relayWriters struct {
	ob            *pgstore.Outbox
	pool          *pgxpool.Pool
	exchange, key string
	target        int
	// ordered gives each message an OrderKey: its writer and its
	// transaction's number modulo relayOrderKeys.
	ordered bool
	// stop ends the writers after their transaction in flight.
	stop atomic.Bool

	mu         sync.Mutex
	committed  []string
	rolledBack []string
	txs        [2]int // committed, rolled back
	err        error
}

// run writes transactions as writer name until the target is reached,
// sleeping up to maxGapMS between them.
func (w *relayWriters) run(ctx context.Context, name string, seed uint64, maxGapMS int) {
	rng := rand.New(rand.NewPCG(seed, seed>>1|1))
	for i := 0; ; i++ {
		if w.committedRows() >= w.target || w.failure() != nil || w.stop.Load() {
			return
		}
		n := 1 + rng.IntN(8)
		commit := rng.IntN(5) != 0
		ids := make([]string, n)
		err := func() error {
			tx, err := w.pool.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			for j := range ids {
				ids[j] = fmt.Sprintf("%s-t%d-%d", name, i, j)
				body := workload.Plan{Op: ids[j], WorkMS: rng.IntN(21)}.Body()
				m := pgstore.Message{Exchange: w.exchange, RoutingKey: w.key,
					Publishing: amqp.Publishing{MessageId: ids[j], ContentType: "application/json", Body: body}}
				if w.ordered {
					m.OrderKey = fmt.Sprintf("%s-k%d", name, i%relayOrderKeys)
				}
				if _, err := w.ob.Write(ctx, tx, m); err != nil {
					return err
				}
			}
			if !commit {
				return tx.Rollback(ctx)
			}
			return tx.Commit(ctx)
		}()
		w.mu.Lock()
		switch {
		case err != nil:
			w.err = errors.Join(w.err, fmt.Errorf("writer %s, transaction %d: %w", name, i, err))
		case commit:
			w.committed = append(w.committed, ids...)
			w.txs[0]++
		default:
			w.rolledBack = append(w.rolledBack, ids...)
			w.txs[1]++
		}
		w.mu.Unlock()
		time.Sleep(time.Duration(rng.IntN(maxGapMS+1)) * time.Millisecond)
	}
}

func (w *relayWriters) committedRows() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.committed)
}

func (w *relayWriters) failure() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

func (w *relayWriters) ids() (committed, rolledBack []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.committed...), append([]string(nil), w.rolledBack...)
}

// drainTap takes every message of the tap queue through a running node and
// returns the copies per MessageId.
func (e *env) drainTap(tap string, urls []string) (copies map[string]int, order []string) {
	e.t.Helper()
	var conn *amqp.Connection
	var err error
	for _, u := range urls {
		if conn, err = amqp.Dial(u); err == nil {
			break
		}
	}
	if err != nil {
		e.t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	q, err := ch.QueueDeclarePassive(tap, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	if err != nil {
		e.t.Fatal(err)
	}
	if err := ch.Qos(500, 0, false); err != nil {
		e.t.Fatal(err)
	}
	ds, err := ch.Consume(tap, "", true, false, false, false, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	copies = map[string]int{}
	got := 0
	idle := time.NewTimer(5 * time.Second)
	defer idle.Stop()
	for got < q.Messages {
		select {
		case d, ok := <-ds:
			if !ok {
				e.t.Fatalf("tap %s: the consumer ended after %d of %d messages", tap, got, q.Messages)
			}
			copies[d.MessageId]++
			order = append(order, d.MessageId)
			got++
			idle.Reset(5 * time.Second)
		case <-idle.C:
			e.t.Fatalf("tap %s: %d of %d messages after 5 s without one", tap, got, q.Messages)
		}
	}
	return copies, order
}

// relayBinary returns the path of cmd/relay, building it on first use.
func relayBinary(t *testing.T) string {
	t.Helper()
	return relayBin.build(t)
}

// startRelay starts a relay process named name on the env's outbox (its
// schema) with extra flags, its output in the env's directory like a
// consumer's. Once the binary is built, it may be called from any
// goroutine (the supervisor's).
func (e *env) startRelay(name string, extra ...string) (*proc, error) {
	bin := relayBin.path
	if bin == "" {
		return nil, fmt.Errorf("relay binary not built")
	}
	e.mu.Lock()
	n := e.starts[name]
	e.starts[name] = n + 1
	e.mu.Unlock()
	base := filepath.Join(e.dir, fmt.Sprintf("%s.%d", name, n))
	args := append([]string{"-name", name, "-pg", e.dsn, "-schema", e.schema}, extra...)
	cmd := exec.Command(bin, args...)
	stdout, err := os.Create(base + ".stdout")
	if err != nil {
		return nil, err
	}
	cmd.Stdout = stdout
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if buildRace() {
		cmd.Env = append(os.Environ(), "GORACE=halt_on_error=0")
	}
	process, err := testenv.StartProcess(cmd, base+".stderr", "")
	stdout.Close()
	if err != nil {
		return nil, fmt.Errorf("starting relay %s: %w", name, err)
	}
	p := &proc{name: name, process: process}
	e.mu.Lock()
	e.procs = append(e.procs, p)
	e.mu.Unlock()
	return p, nil
}

// relayOrderViolations checks the order of the tap's first copies under
// -ordered: within an order key (writer w, transactions t with the same t
// modulo relayOrderKeys) a writer's transactions commit one after the
// other, so their messages must first reach the broker in (t, row) order.
// A later copy (a re-publish) may come anywhere. It reports each message
// whose first copy came after one of a later transaction or row of its key,
// and returns how many.
func relayOrderViolations(t *testing.T, order []string) int {
	t.Helper()
	type pos struct{ tx, row int }
	last := map[string]pos{}
	seen := map[string]bool{}
	bad := 0
	for _, id := range order {
		if seen[id] {
			continue
		}
		seen[id] = true
		// <name>-w<w>-t<tx>-<row>
		i := strings.LastIndex(id, "-w")
		var w, tx, row int
		if i < 0 {
			t.Errorf("tap: message id %q is none of the writers'", id)
			continue
		}
		if _, err := fmt.Sscanf(id[i:], "-w%d-t%d-%d", &w, &tx, &row); err != nil {
			t.Errorf("tap: message id %q: %v", id, err)
			continue
		}
		key := fmt.Sprintf("w%d-k%d", w, tx%relayOrderKeys)
		p := pos{tx, row}
		if prev, ok := last[key]; ok && (p.tx < prev.tx || p.tx == prev.tx && p.row < prev.row) {
			bad++
			if bad <= 10 {
				t.Errorf("order key %s: %s reached the broker after transaction %d row %d", key, id, prev.tx, prev.row)
			}
			continue
		}
		last[key] = p
	}
	return bad
}
