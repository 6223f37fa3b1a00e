//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// The harness of the relay scenarios (16 and 20): an outbox table, relay
// processes (cmd/relay) publishing it through an exchange that routes
// every copy to the work queue and to a tap queue nobody consumes,
// consumer processes applying the work queue into the ledger, and a storm
// of kill -9 and SIGSTOP on the relays beside a scenario's own faults.

// relayClaimTTL is the relays' RelayConfig.ClaimTTL in the relay
// scenarios.
const relayClaimTTL = 3 * time.Second

// relayFaults is what one run of a relay scenario does to its relays:
// kills kill -9 and pauses SIGSTOPs, each pause lasting pauseMin to
// pauseMax claim TTLs.
type relayFaults struct {
	name               string
	kills, pauses      int
	pauseMin, pauseMax float64
}

// relayRigOptions say where a relay rig's pieces are.
type relayRigOptions struct {
	// rabbit is the broker, a cluster whose nodes every process dials in
	// order; nil: the shared broker (testenv.AMQPURL).
	rabbit *testenv.Rabbit
	// queueArgs declare the work queue and the tap.
	queueArgs amqp.Table
	// pg is a private server holding the outbox, in the env's schema;
	// nil: the ledger's database.
	pg *pgenv.Server
	// consumerFlags and relayFlags are the processes' flags besides
	// their broker (-amqp) and, for the relays, their outbox.
	consumerFlags, relayFlags []string
}

// relayRig is a relay scenario's world: an env (work queue, ledger,
// consumer processes) whose outbox table is in the env's schema of the
// ledger's database or of a private server, an exchange of the run that
// routes every copy to the work queue and to the tap, two consumers and
// three supervised relays.
type relayRig struct {
	*env
	urls          []string   // the broker's nodes, in the order processes dial them
	tap, exchange string     // the tap queue and the exchange the messages go to
	tapArgs       amqp.Table // the tap's declaration
	dsn           string     // the outbox's database
	pool          *pgxpool.Pool
	ob            *pgstore.Outbox
	outbox        string // the outbox table, quoted
	relays        *supervisor
	start         time.Time
}

// newRelayRig makes a relay rig: the env, the topology, the outbox table
// (pgstore.Migrate), the consumers and the relays, running.
func newRelayRig(t *testing.T, o relayRigOptions) *relayRig {
	t.Helper()
	relayBinary(t)
	consumerBinary(t)
	e := newEnv(t, envOptions{rabbit: o.rabbit, queueArgs: o.queueArgs})
	r := &relayRig{env: e, start: time.Now(), tap: "tap." + e.queue, exchange: e.name + ".relay", tapArgs: o.queueArgs, dsn: e.dsn}
	if o.rabbit != nil {
		for _, n := range o.rabbit.Nodes {
			r.urls = append(r.urls, n.AMQPURL)
		}
	} else {
		r.urls = []string{e.amqp}
	}

	// The exchange routes each copy to the work queue and to the tap.
	ch := e.pub.Channel()
	if _, err := ch.QueueDeclare(r.tap, true, false, false, false, o.queueArgs); err != nil {
		t.Fatal(err)
	}
	e.ownQueue(r.tap)
	if err := ch.ExchangeDeclare(r.exchange, "direct", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	e.ownExchange(r.exchange)
	for _, q := range []string{e.queue, r.tap} {
		if err := ch.QueueBind(q, e.queue, r.exchange, false, nil); err != nil {
			t.Fatal(err)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if o.pg != nil {
		r.dsn = o.pg.DSN
	}
	pcfg, err := pgxpool.ParseConfig(r.dsn)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 8
	// A private server may be down: fail fast, and try again.
	pcfg.ConnConfig.ConnectTimeout = 2 * time.Second
	r.pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.pool.Close)
	if o.pg != nil {
		if _, err := r.pool.Exec(ctx, "CREATE SCHEMA "+e.schema); err != nil {
			t.Fatal(err)
		}
	}
	cfg := pgstore.Config{Schema: e.schema, CleanupInterval: -1}
	if err := pgstore.Migrate(ctx, r.pool, cfg); err != nil {
		t.Fatal(err)
	}
	if r.ob, err = pgstore.NewOutbox(r.pool, cfg); err != nil {
		t.Fatal(err)
	}
	r.outbox = pgx.Identifier{e.schema, pgstore.DefaultOutboxTable}.Sanitize()

	amqpFlag := []string{"-amqp", strings.Join(r.urls, ",")}
	for i := range 2 {
		e.consumer(fmt.Sprintf("%s-c%d", e.name, i), append(slices.Clone(amqpFlag), o.consumerFlags...)...)
	}
	r.relays = e.superviseWith(e.name+"-relay", r.startRelay, 3, append(amqpFlag, o.relayFlags...)...)
	return r
}

// relayBinary returns the path of cmd/relay, building it on first use.
func relayBinary(t *testing.T) string {
	t.Helper()
	return relayBin.build(t)
}

// startRelay starts a relay process named name on the rig's outbox with
// extra flags, its output in the env's directory like a consumer's. Once
// the binary is built, it may be called from any goroutine (the
// supervisor's).
func (r *relayRig) startRelay(name string, extra ...string) (*proc, error) {
	bin := relayBin.path
	if bin == "" {
		return nil, fmt.Errorf("relay binary not built")
	}
	e := r.env
	e.mu.Lock()
	n := e.starts[name]
	e.starts[name] = n + 1
	e.mu.Unlock()
	base := filepath.Join(e.dir, fmt.Sprintf("%s.%d", name, n))
	args := append([]string{"-name", name, "-pg", r.dsn, "-schema", e.schema}, extra...)
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

// query runs a query returning one integer on the outbox's database.
func (r *relayRig) query(sql string, args ...any) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int
	err := r.pool.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
}

// outboxCount is query, failing the test on an error.
func (r *relayRig) outboxCount(sql string, args ...any) int {
	r.t.Helper()
	n, err := r.query(sql, args...)
	if err != nil {
		r.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// pending returns how many outbox rows are pending, or an error while the
// database cannot be reached.
func (r *relayRig) pending() (int, error) {
	return r.query("SELECT count(*)::int FROM " + r.outbox + " WHERE state = 'p'")
}

// claimHolders returns the relays whose claim on a pending row runs.
func (r *relayRig) claimHolders() (map[string]bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rows, err := r.pool.Query(ctx, "SELECT DISTINCT claimed_by FROM "+r.outbox+
		" WHERE state = 'p' AND claimed_by IS NOT NULL AND due_at > clock_timestamp()")
	if err != nil {
		return nil, err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	m := map[string]bool{}
	for _, n := range names {
		m[n] = true
	}
	return m, nil
}

// relaysDying fails the test when the relays were restarted more often
// than they were killed (and a few more): a relay that exits by itself (a
// refused flag) is restarted every 100 ms by the supervisor, and the test
// would spin.
func (r *relayRig) relaysDying(name string, kills int) {
	r.t.Helper()
	r.relays.mu.Lock()
	n, last := r.relays.restarts, r.relays.slots[0]
	r.relays.mu.Unlock()
	if n > kills+3 {
		r.t.Fatalf("%s: relays restarted %d times for %d kills: they exit by themselves; %s:\n%s", name, n, kills, last.name, tail(last.output(), 2<<10))
	}
}

// stormEvents are a scenario's own faults beside the relays' (a broker
// node killed and restarted, PostgreSQL restarted), stepped by the storm.
type stormEvents struct {
	// step does the next event when it is due and reports whether it did
	// something: the storm's turn ends there.
	step func() bool
	// done reports whether every event happened: the storm goes on until
	// then (or its deadline).
	done func() bool
	// under reports whether an event is under way (a server down): the
	// storm does not end in the middle of one.
	under func() bool
}

// relayStorm is what a storm did.
type relayStorm struct {
	kills, pauses       int
	midKills, midPauses int // while rows were written or pending
	killsHolding        int // of relays holding a claim
	pausesHolding       int
	pausedFor           time.Duration // the pauses added up
	// claimLookups counts the looks for a relay holding a claim,
	// lookFails those the database did not answer.
	claimLookups, lookFails int
}

// storm disturbs the relays until each of f's faults has been done and
// every event of ev happened, or nothing is left to disturb (no writing,
// nothing pending, no event under way), or deadline passes: every 0.2-0.7
// s a relay is killed or paused (whichever kind is further behind its
// count), a relay seen holding a claim if there is one; ev's step comes
// first at each turn. One relay always runs. Paused relays are resumed
// when their pause ends and before storm returns. The outbox's database
// may be unreachable meanwhile (ev restarting it): rows count as pending
// then, and no claim is seen.
func (r *relayRig) storm(f relayFaults, deadline time.Duration, writing func() bool, ev stormEvents) relayStorm {
	r.t.Helper()
	var s relayStorm
	type pausedRelay struct {
		p     *proc
		since time.Time
		until time.Time
	}
	var paused []pausedRelay
	resumeDue := func(all bool) {
		kept := paused[:0]
		for _, pr := range paused {
			if all || time.Now().After(pr.until) {
				pr.p.resume()
				s.pausedFor += time.Since(pr.since)
				continue
			}
			kept = append(kept, pr)
		}
		paused = kept
	}
	busy := func() bool {
		if writing() {
			return true
		}
		n, err := r.pending()
		return err != nil || n > 0
	}
	end := time.Now().Add(deadline)
	next := time.Now().Add(500 * time.Millisecond)
	for (s.kills < f.kills || s.pauses < f.pauses || !ev.done()) && time.Now().Before(end) {
		time.Sleep(50 * time.Millisecond)
		resumeDue(false)
		r.relaysDying(f.name, s.kills)
		if time.Now().Before(next) {
			continue
		}
		next = time.Now().Add(time.Duration(200+r.rng.IntN(500)) * time.Millisecond)
		if !busy() && !ev.under() {
			break // nothing left to disturb
		}
		if ev.step() {
			continue
		}
		live := r.relays.live()
		var running []*proc
		for _, p := range live {
			if !slices.ContainsFunc(paused, func(pr pausedRelay) bool { return pr.p == p }) {
				running = append(running, p)
			}
		}
		// The kind of fault further behind its count goes next. A running
		// relay is killed, or a stopped one when only one runs: one relay
		// is always left running.
		doKill := s.kills < f.kills && (s.pauses >= f.pauses || s.kills*f.pauses <= s.pauses*f.kills)
		candidates := running
		switch {
		case doKill && len(running) < 2: // a stopped one, sparing the one running
			candidates = slices.DeleteFunc(slices.Clone(live), func(p *proc) bool { return slices.Contains(running, p) })
		case doKill:
		case s.pauses >= f.pauses || len(running) < 2:
			continue
		}
		if len(candidates) == 0 {
			continue
		}
		// The victim is a relay holding a claim when one is seen within
		// 1 s (a round lasts milliseconds: look often), else any.
		victim, holding := candidates[r.rng.IntN(len(candidates))], false
		for look := time.Now(); time.Since(look) < time.Second && !holding; time.Sleep(5 * time.Millisecond) {
			holders, err := r.claimHolders()
			s.claimLookups++
			if err != nil {
				s.lookFails++
				continue
			}
			for _, p := range candidates {
				if holders[p.name] {
					victim, holding = p, true
					break
				}
			}
		}
		mid := busy()
		if doKill {
			victim.kill()
			for i, pr := range paused {
				if pr.p == victim {
					s.pausedFor += time.Since(pr.since)
					paused = slices.Delete(paused, i, i+1)
					break
				}
			}
			s.kills++
			if mid {
				s.midKills++
			}
			if holding {
				s.killsHolding++
			}
			continue
		}
		d := time.Duration((f.pauseMin + r.rng.Float64()*(f.pauseMax-f.pauseMin)) * float64(relayClaimTTL))
		victim.pause()
		paused = append(paused, pausedRelay{p: victim, since: time.Now(), until: time.Now().Add(d)})
		s.pauses++
		if mid {
			s.midPauses++
		}
		if holding {
			s.pausesHolding++
		}
	}
	resumeDue(true)
	return s
}

// checkMid fails the test unless at least two kills and two pauses (or
// as many as f asked for) landed while rows were written or pending.
func (s relayStorm) checkMid(t *testing.T, f relayFaults) {
	t.Helper()
	if s.midKills < min(2, f.kills) || s.midPauses < min(2, f.pauses) {
		t.Errorf("%s: %d kills and %d pauses landed while rows were being written or pending, want at least 2 of each", f.name, s.midKills, s.midPauses)
	}
}

// relayResult is what the end of a relay scenario found.
type relayResult struct {
	committed, rolledBack []string
	// copies counts the tap's copies per MessageId; order is the tap's
	// copies in the order the broker took them.
	copies map[string]int
	order  []tapCopy
	// tapCopies adds up copies; phantom counts copies in the tap and
	// executions in the ledger of rolled-back rows; lostAtBroker the
	// committed rows with no copy in the tap.
	tapCopies, phantom, lostAtBroker int
	// sent and dead count the outbox's rows in those states at the end.
	sent, dead int
	// refused counts the relays' log lines "the broker refused a
	// message", maxAttempts is the highest attempts of a row.
	refused, maxAttempts int
	relayRestarts        int
	elapsed              time.Duration
}

// extraPublishes is the copies beyond one per row that reached the broker:
// the relays' re-publishes.
func (res relayResult) extraPublishes() int {
	return res.tapCopies - (len(res.committed) - res.lostAtBroker)
}

// finish ends a relay scenario once its writers are done: it records the
// committed rows in the ledger (expected applied), waits until every row
// is sent and every committed row applied and the queues drained, stops
// the relays and consumers gracefully (SIGTERM), drains the tap, and
// checks: no copy in the tap or execution in the ledger of a rolled-back
// row (phantom), a copy in the tap of every committed row, every committed
// row sent and none dead, and no row of a rolled-back transaction in the
// outbox. The scenario then prints its line (reportWith) and checks the
// ledger's classification there.
func (r *relayRig) finish(name string, kills int, committed, rolledBack []string) relayResult {
	r.t.Helper()
	t := r.t
	res := relayResult{committed: committed, rolledBack: rolledBack}
	ops := make([]workload.Op, len(committed))
	for i, id := range committed {
		ops[i] = workload.Op{ID: id}
	}
	r.addOps(ledger.ExpectApply, ops)

	pendingNow := func() int {
		n, err := r.pending()
		if err != nil {
			return -1
		}
		return n
	}
	r.waitFor("every committed row sent", pick(3*time.Minute, 6*time.Minute),
		func() bool { r.relaysDying(name, kills); return pendingNow() == 0 },
		func() string { return fmt.Sprintf("(%d rows pending)", pendingNow()) })
	// A dead row is never published: wait for the others, and let the
	// report count it lost.
	res.dead = r.outboxCount("SELECT count(*)::int FROM " + r.outbox + " WHERE state = 'd'")
	r.settle(len(committed)-res.dead, pick(3*time.Minute, 6*time.Minute), 2*time.Second)
	var err error
	res.relayRestarts, err = r.relays.halt()
	if err != nil {
		t.Errorf("restarting relays: %v", err)
	}
	r.terminateAll()
	res.elapsed = time.Since(r.start)

	// The tap: every copy the broker took.
	res.copies, res.order = r.drainTap()
	rolled := make(map[string]bool, len(rolledBack))
	for _, id := range rolledBack {
		rolled[id] = true
	}
	for id, n := range res.copies {
		res.tapCopies += n
		if rolled[id] {
			res.phantom++
			t.Errorf("%s: the message of rolled-back row %s reached the broker (%d copies)", name, id, n)
		}
	}
	for _, id := range committed {
		if res.copies[id] == 0 {
			res.lostAtBroker++
		}
	}
	if res.lostAtBroker > 0 {
		t.Errorf("%s: %d committed rows never reached the broker", name, res.lostAtBroker)
	}
	if n := r.count("SELECT count(*)::int FROM executions WHERE op_id = ANY($1)", rolledBack); n > 0 {
		res.phantom += n
		t.Errorf("%s: %d executions of rolled-back rows", name, n)
	}
	res.sent = r.outboxCount("SELECT count(*)::int FROM " + r.outbox + " WHERE state = 's'")
	if res.sent != len(committed) || res.dead != 0 {
		t.Errorf("%s: outbox rows sent %d, dead %d; want %d and 0", name, res.sent, res.dead, len(committed))
	}
	if n := r.outboxCount("SELECT count(*)::int FROM "+r.outbox+" WHERE message_id = ANY($1)", rolledBack); n > 0 {
		t.Errorf("%s: %d rows of rolled-back transactions in the outbox", name, n)
	}
	res.refused = r.grepAll("the broker refused a message")
	res.maxAttempts = r.outboxCount("SELECT coalesce(max(attempts), 0)::int FROM " + r.outbox)
	return res
}

// drainTap takes every message of the tap queue through a running node and
// returns the copies per MessageId, and every copy in the queue's order.
func (r *relayRig) drainTap() (copies map[string]int, order []tapCopy) {
	r.t.Helper()
	t := r.t
	var conn *amqp.Connection
	var err error
	for _, u := range r.urls {
		if conn, err = amqp.Dial(u); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclarePassive(r.tap, true, false, false, false, r.tapArgs)
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Qos(500, 0, false); err != nil {
		t.Fatal(err)
	}
	ds, err := ch.Consume(r.tap, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	copies = map[string]int{}
	got := 0
	idle := time.NewTimer(5 * time.Second)
	defer idle.Stop()
	for got < q.Messages {
		select {
		case d, ok := <-ds:
			if !ok {
				t.Fatalf("tap %s: the consumer ended after %d of %d messages", r.tap, got, q.Messages)
			}
			copies[d.MessageId]++
			order = append(order, tapCopy{id: d.MessageId, body: d.Body})
			got++
			idle.Reset(5 * time.Second)
		case <-idle.C:
			t.Fatalf("tap %s: %d of %d messages after 5 s without one", r.tap, got, q.Messages)
		}
	}
	return copies, order
}
