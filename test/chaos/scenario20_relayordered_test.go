//go:build linux

package chaos_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
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

	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 20, ordered relaying of dependent transactions (issue 34, item
// 5): "ordered" must mean the order in which the database committed a
// key's transactions, also when they wait for each other.
//
// The outbox is on a private PostgreSQL server (startPGServer), which the
// run restarts. Beside it are a table of balances, one row per order key,
// and an audit table. Writers in the test process run transactions that
// each, in turn:
//
//  1. insert an audit row: an unrelated write, so that the transaction
//     takes its transaction id now (pg_current_xact_id(), recorded);
//  2. sleep 0 to 30 ms (another transaction of its key, younger, may
//     take the row first meanwhile);
//  3. UPDATE balances SET v = v + delta, version = version + 1 WHERE k =
//     key RETURNING v, version: the row lock makes the transactions of a
//     key wait for each other, so that each reads what the one before it
//     committed, and their commit order is their version order;
//  4. write one outbox message with OrderKey key and the key, version and
//     value in its body (a plan for the consumers, with more fields);
//  5. sleep 0 to 3 ms (holding the row: others queue behind it), then
//     commit, or roll back (a fifth of them).
//
// With several writers on few keys, a transaction often takes its
// transaction id before another one of its key that takes the row lock
// first and commits first (xid_inversions counts those, in commit order:
// a key's committed transactions whose transaction id is lower than the
// one that committed just before them). Three ordered relay processes
// (cmd/relay -ordered) publish the messages to an exchange that routes
// every copy to the work queue and to a tap queue nobody consumes; two
// consumer processes apply them into the ledger, keyed by MessageId.
// Meanwhile relays are killed with kill -9 and stopped with SIGSTOP (some
// past their claim), as in scenario 16, and the PostgreSQL server is
// stopped, immediately (SIGQUIT: a crash, recovery from the WAL) and fast
// (SIGINT), and started again a second later while the relays' faults go
// on. A commit whose reply the stop cut off is resolved afterwards: it
// committed if its outbox row exists.
//
// Checked, besides scenario 16's checks (every committed message applied
// once: lost=0 duplicated=0; no copy or execution of a rolled-back or
// failed transaction: phantom=0; every committed row sent, none dead):
//
//   - order_violations=0. The tap holds every copy the broker took, in
//     the order it took them: it is the consumer that records every
//     delivery. A message's first delivery is its first copy there; a
//     later copy (a re-publish after a kill, a pause past the claim, a
//     lost confirm: counted in extra_publishes, allowed by design, and
//     absorbed by the consumers, which is what duplicated checks) is no
//     violation wherever it comes. order_violations counts, per order
//     key, the first deliveries whose version is lower than the version
//     of a first delivery of the same key that came before them: a
//     message published after one its transaction committed before.
//   - stale_keys=0: a consumer that sets each key's balance to the value
//     of each first delivery in turn ends with the database's balance
//     (the symptom: it ends at an older value).
//   - the bookkeeping: each key's committed versions are exactly 1 to the
//     row's final version, the value of the last one is the row's, and
//     every delivered body is the one its transaction wrote.
//   - xid_inversions > 0: the workload did interleave dependent
//     transactions, or the run tested nothing.
//
// CHAOS_FULL=1 runs longer storms (more rows, writers, keys, faults and
// restarts); CHAOS_RELAY_FLAGS adds flags to every relay.
func TestChaos20RelayOrderedDependent(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos scenarios are skipped under -short")
	}
	pgDSN(t)
	srv := pgenv.StartServer(t)
	f := relayFaults{name: "relay-ordered-dependent", kills: pick(4, 12), pauses: pick(3, 10), pauseMin: 0.3, pauseMax: 2.0}
	nRows := pick(400, 3000)
	nKeys, nWriters := pick(3, 4), pick(6, 8)
	relayFlags := []string{"-ordered", "-claim-ttl", relayClaimTTL.String(), "-publish-timeout", "2s", "-poll", "200ms",
		"-batch", "16", "-concurrency", "16", "-max-attempts", "2"}
	relayFlags = append(relayFlags, strings.Fields(os.Getenv("CHAOS_RELAY_FLAGS"))...)
	r := newRelayRig(t, relayRigOptions{pg: srv,
		consumerFlags: []string{"-lease", "5s", "-concurrency", "4", "-heartbeat", "2s", "-in-progress-delay", "300ms",
			"-unavailable-delay", "300ms", "-max-attempts", "20", "-delay-in-process"},
		relayFlags: relayFlags})

	ctx := context.Background()
	w := &orderedWriters{ob: r.ob, pool: r.pool, exchange: r.exchange, route: r.queue, keys: nKeys, target: nRows,
		balances: pgx.Identifier{r.schema, "balances"}.Sanitize(), audit: pgx.Identifier{r.schema, "audit"}.Sanitize(),
		txs: map[string]*orderedTx{}}
	if _, err := r.pool.Exec(ctx, `CREATE TABLE `+w.balances+` (k text PRIMARY KEY, v bigint NOT NULL, version bigint NOT NULL);
		CREATE TABLE `+w.audit+` (writer text NOT NULL, tx int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	for k := range nKeys {
		if _, err := r.pool.Exec(ctx, `INSERT INTO `+w.balances+` VALUES ($1, 0, 0)`, orderedKey(k)); err != nil {
			t.Fatal(err)
		}
	}

	seed := r.rng.Uint64()
	var wg sync.WaitGroup
	for i := range nWriters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(ctx, fmt.Sprintf("%s-w%d", r.name, i), seed+uint64(i), pick(250, 120))
		}()
	}
	writersDone := make(chan struct{})
	go func() { wg.Wait(); close(writersDone) }()
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

	// PostgreSQL's stops, at even steps of the committed rows, each
	// followed a second later by a start.
	stops := pick([]syscall.Signal{syscall.SIGQUIT, syscall.SIGINT},
		[]syscall.Signal{syscall.SIGQUIT, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGINT})
	var downAt time.Time
	var downFor time.Duration
	restarts := 0
	storm := r.storm(f, pick(3*time.Minute, 8*time.Minute), writing, stormEvents{
		step: func() bool {
			switch {
			case !downAt.IsZero() && time.Since(downAt) >= time.Second:
				took := srv.Start()
				downFor += time.Since(downAt)
				t.Logf("%s: PostgreSQL accepting connections again, %v after its start, %v after its stop", f.name,
					took.Round(time.Millisecond), time.Since(downAt).Round(time.Millisecond))
				downAt = time.Time{}
				restarts++
				return true
			case downAt.IsZero() && restarts < len(stops) && w.committedRows() >= nRows*(restarts+1)/(len(stops)+1):
				sig := stops[restarts]
				t0 := time.Now()
				srv.Stop(sig)
				downAt = time.Now()
				t.Logf("%s: PostgreSQL stopped (%v) in %v with %d rows committed", f.name, sig,
					downAt.Sub(t0).Round(time.Millisecond), w.committedRows())
				return true
			}
			return false
		},
		done:  func() bool { return restarts == len(stops) },
		under: func() bool { return !downAt.IsZero() },
	})
	if srv.PID() == 0 { // the storm's deadline passed while it was down
		srv.Start()
	}
	<-writersDone
	if err := w.failure(); err != nil {
		t.Fatal(err)
	}
	unknown, unknownCommitted := w.resolve(t, r)
	committed, rolledBack := w.ids()
	res := r.finish(f.name, storm.kills, committed, rolledBack)

	violations, stale, inversions := w.check(t, r, res.order)
	line := fmt.Sprintf(" phantom=%d order_violations=%d stale_keys=%d keys=%d writers=%d rows_committed=%d txs_rolled_back=%d txs_failed=%d commits_unknown=%d commits_unknown_committed=%d xid_inversions=%d relays=3 kills=%d kills_holding_claims=%d pauses=%d pauses_holding_claims=%d paused_ms=%d relay_restarts=%d pg_restarts=%d pg_down_ms=%d tap_copies=%d extra_publishes=%d refused=%d max_attempts=%d dead=%d seconds=%.1f",
		res.phantom, violations, stale, nKeys, nWriters, len(committed), w.count("rolledBack"), w.count("failed"), unknown, unknownCommitted,
		inversions, storm.kills, storm.killsHolding, storm.pauses, storm.pausesHolding, storm.pausedFor.Milliseconds(), res.relayRestarts,
		restarts, downFor.Milliseconds(), res.tapCopies, res.extraPublishes(), res.refused, res.maxAttempts, res.dead, res.elapsed.Seconds())
	r.reportWith(f.name, line, nil, false)

	if violations > 0 {
		t.Errorf("%s: %d messages first reached the broker after a message of their key that committed after them", f.name, violations)
	}
	if stale > 0 {
		t.Errorf("%s: %d keys end, delivery by delivery, at a balance other than the database's", f.name, stale)
	}
	if inversions == 0 {
		t.Errorf("%s: no transaction committed after one of its key with a higher transaction id: the writers did not interleave, the run tested nothing", f.name)
	}
	if restarts != len(stops) {
		t.Errorf("%s: PostgreSQL was restarted %d times, want %d", f.name, restarts, len(stops))
	}
	storm.checkMid(t, f)
	if w.count("rolledBack") == 0 {
		t.Errorf("%s: no transaction was rolled back", f.name)
	}
}

// orderedKey is the name of order key k.
func orderedKey(k int) string { return fmt.Sprintf("k%d", k) }

// orderedBody is the body of scenario 20's messages: a plan for the
// consumers (which read only its fields), with the transaction's balance
// row.
type orderedBody struct {
	workload.Plan
	Key     string `json:"key"`
	Version int64  `json:"version"`
	Value   int64  `json:"value"`
}

// orderedTx is one transaction of scenario 20's writers.
type orderedTx struct {
	id      string // its message's MessageId
	key     string
	xid     uint64 // its transaction id, taken by the audit row
	version int64  // what its UPDATE of the balance returned
	value   int64
	body    []byte
	// outcome is "committed", "rolledBack" (by the writer), "failed"
	// (an error before the commit: nothing committed) or "unknown" (the
	// commit failed: the stop may have cut its reply off), until resolve.
	outcome string
}

// orderedWriters write scenario 20's transactions.
type orderedWriters struct {
	ob              *pgstore.Outbox
	pool            *pgxpool.Pool
	exchange, route string // where the messages go
	keys, target    int
	balances, audit string // the tables, quoted
	// stop ends the writers after their transaction in flight.
	stop atomic.Bool

	mu        sync.Mutex
	txs       map[string]*orderedTx
	committed int
	err       error
	errs      int // transactions that failed (the server down)
}

// run writes transactions as writer name until target transactions are
// committed, sleeping up to maxGapMS between them (after an error: 100 ms
// at least, while the server is down).
func (w *orderedWriters) run(ctx context.Context, name string, seed uint64, maxGapMS int) {
	rng := rand.New(rand.NewPCG(seed, seed>>1|1))
	for i := 0; ; i++ {
		if w.committedRows() >= w.target || w.failure() != nil || w.stop.Load() {
			return
		}
		x := &orderedTx{id: fmt.Sprintf("%s-t%d", name, i), key: orderedKey(rng.IntN(w.keys))}
		commit := rng.IntN(5) != 0
		hold, after := time.Duration(rng.IntN(31))*time.Millisecond, time.Duration(rng.IntN(4))*time.Millisecond
		delta := rng.Int64N(201) - 100
		work := rng.IntN(11)
		x.outcome = func() string {
			ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			tx, err := w.pool.Begin(ctx)
			if err != nil {
				return "failed"
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if err := tx.QueryRow(ctx, `INSERT INTO `+w.audit+` (writer, tx) VALUES ($1, $2) RETURNING pg_current_xact_id()::text::bigint`,
				name, i).Scan(&x.xid); err != nil {
				return "failed"
			}
			time.Sleep(hold)
			if err := tx.QueryRow(ctx, `UPDATE `+w.balances+` SET v = v + $1, version = version + 1 WHERE k = $2 RETURNING v, version`,
				delta, x.key).Scan(&x.value, &x.version); err != nil {
				return "failed"
			}
			x.body, _ = json.Marshal(orderedBody{Plan: workload.Plan{Op: x.id, WorkMS: work}, Key: x.key, Version: x.version, Value: x.value})
			if _, err := w.ob.Write(ctx, tx, pgstore.Message{Exchange: w.exchange, RoutingKey: w.route, OrderKey: x.key,
				Publishing: amqp.Publishing{MessageId: x.id, ContentType: "application/json", Body: x.body}}); err != nil {
				return "failed"
			}
			time.Sleep(after)
			if !commit {
				_ = tx.Rollback(ctx)
				return "rolledBack"
			}
			if err := tx.Commit(ctx); err != nil {
				return "unknown"
			}
			return "committed"
		}()
		w.mu.Lock()
		w.txs[x.id] = x
		gap := time.Duration(rng.IntN(maxGapMS+1)) * time.Millisecond
		switch x.outcome {
		case "committed":
			w.committed++
		case "failed", "unknown":
			w.errs++
			gap = max(gap, 100*time.Millisecond)
		}
		w.mu.Unlock()
		time.Sleep(gap)
	}
}

func (w *orderedWriters) committedRows() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.committed
}

func (w *orderedWriters) failure() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// count returns how many transactions have outcome.
func (w *orderedWriters) count(outcome string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, x := range w.txs {
		if x.outcome == outcome {
			n++
		}
	}
	return n
}

// resolve settles the transactions whose outcome the writers could not
// know, once the writers are done and the server runs: one committed if
// and only if its outbox row exists (a row is deleted only by the
// cleanup, off here). It returns how many commits were unknown and how
// many of them had committed. A transaction that failed before its commit
// must have left no row.
func (w *orderedWriters) resolve(t *testing.T, r *relayRig) (unknown, committed int) {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	var ids []string
	for id, x := range w.txs {
		if x.outcome == "unknown" || x.outcome == "failed" {
			ids = append(ids, id)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := r.pool.Query(ctx, "SELECT message_id FROM "+r.outbox+" WHERE message_id = ANY($1)", ids)
	if err != nil {
		t.Fatal(err)
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	exists := map[string]bool{}
	for _, id := range found {
		exists[id] = true
	}
	for _, id := range ids {
		x := w.txs[id]
		switch {
		case x.outcome == "failed" && exists[id]:
			t.Errorf("transaction %s failed before its commit, and its outbox row exists", id)
			x.outcome = "committed"
		case x.outcome == "unknown":
			unknown++
			x.outcome = "failed"
			if exists[id] {
				x.outcome = "committed"
				committed++
			}
		}
	}
	return unknown, committed
}

// ids returns the MessageIds of the committed transactions, and of those
// that did not commit (rolled back by the writer, or failed): none of
// these may ever be published.
func (w *orderedWriters) ids() (committed, notCommitted []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for id, x := range w.txs {
		if x.outcome == "committed" {
			committed = append(committed, id)
		} else {
			notCommitted = append(notCommitted, id)
		}
	}
	slices.Sort(committed)
	slices.Sort(notCommitted)
	return committed, notCommitted
}

// check checks the committed transactions against the balances table and
// the tap's copies (order, in the order the broker took them), and
// returns the order violations, the stale keys and the transaction id
// inversions (see TestChaos20RelayOrderedDependent).
func (w *orderedWriters) check(t *testing.T, r *relayRig, order []tapCopy) (violations, stale, inversions int) {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type row struct {
		v, version int64
	}
	final := map[string]row{}
	rows, err := r.pool.Query(ctx, "SELECT k, v, version FROM "+w.balances)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		var b row
		if err := rows.Scan(&k, &b.v, &b.version); err != nil {
			t.Fatal(err)
		}
		final[k] = b
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}

	// Each key's committed transactions, in commit order.
	byKey := map[string][]*orderedTx{}
	for _, x := range w.txs {
		if x.outcome == "committed" {
			byKey[x.key] = append(byKey[x.key], x)
		}
	}
	for k, b := range final {
		xs := byKey[k]
		slices.SortFunc(xs, func(a, b *orderedTx) int { return int(a.version - b.version) })
		for i, x := range xs {
			if x.version != int64(i+1) {
				t.Errorf("order key %s: committed versions are not 1 to %d: %s has version %d at place %d", k, b.version, x.id, x.version, i+1)
				break
			}
			if i > 0 && x.xid < xs[i-1].xid {
				inversions++
			}
		}
		if int64(len(xs)) != b.version || len(xs) > 0 && xs[len(xs)-1].value != b.v {
			lastValue := int64(0)
			if len(xs) > 0 {
				lastValue = xs[len(xs)-1].value
			}
			t.Errorf("order key %s: %d committed transactions, the last setting %d; the table holds version %d, value %d",
				k, len(xs), lastValue, b.version, b.v)
		}
	}

	// The first deliveries, per key, in the tap's order; a consumer that
	// sets each key's balance to the value of each first delivery in
	// turn ends with the value of the last one.
	type seen struct {
		version int64
		id      string
	}
	last := map[string]seen{}
	first := map[string]bool{}
	consumer := map[string]int64{}
	for _, c := range order {
		x, ok := w.txs[c.id]
		if !ok {
			t.Errorf("tap: message %q is none of the writers'", c.id)
			continue
		}
		var b orderedBody
		if err := json.Unmarshal(c.body, &b); err != nil || string(c.body) != string(x.body) {
			t.Errorf("tap: the body of %s is %q, its transaction wrote %q (%v)", c.id, c.body, x.body, err)
			continue
		}
		if first[c.id] {
			continue // a copy
		}
		first[c.id] = true
		consumer[b.Key] = b.Value
		if prev, ok := last[b.Key]; ok && b.Version < prev.version {
			violations++
			if violations <= 10 {
				t.Errorf("order key %s: %s (version %d) first reached the broker after %s (version %d)", b.Key, c.id, b.Version, prev.id, prev.version)
			}
			continue
		}
		last[b.Key] = seen{version: b.Version, id: c.id}
	}
	for k, b := range final {
		if consumer[k] != b.v {
			stale++
			t.Errorf("order key %s: a consumer applying the first deliveries in turn ends at %d, the database at %d", k, consumer[k], b.v)
		}
	}
	return violations, stale, inversions
}
