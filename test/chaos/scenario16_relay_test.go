//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/pgstore"
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

// relayOrderKeys is how many order keys each writer uses when the relays
// run with -ordered (CHAOS_RELAY_FLAGS).
const relayOrderKeys = 8

func relayRun(t *testing.T, rabbit *testenv.Rabbit, f relayFaults) {
	nRows := pick(500, 5000)
	// -max-attempts 2: the queue is always bound, so nothing here may
	// count as a refusal; the nacks of a quorum queue electing a leader
	// after the node kill once did, and turned rows dead.
	relayFlags := []string{"-claim-ttl", relayClaimTTL.String(), "-publish-timeout", "2s", "-poll", "200ms", "-batch", "16",
		"-concurrency", "16", "-max-attempts", "2"}
	// CHAOS_RELAY_FLAGS adds flags (cmd/relay's) to every relay, to try
	// other settings: "-ordered".
	relayFlags = append(relayFlags, strings.Fields(os.Getenv("CHAOS_RELAY_FLAGS"))...)
	r := newRelayRig(t, relayRigOptions{rabbit: rabbit, queueArgs: amqp.Table{"x-queue-type": "quorum"},
		consumerFlags: []string{"-quorum", "-quorum-dlq",
			"-lease", "5s", "-concurrency", "4", "-heartbeat", "2s", "-in-progress-delay", "300ms",
			"-unavailable-delay", "300ms", "-max-attempts", "20", "-delay-in-process"},
		relayFlags: relayFlags})
	node := rabbit.Nodes[0]
	// A node the run kills is running again when it ends, before the
	// topology is deleted through it (cleanups run last first).
	t.Cleanup(func() {
		if node.Pid() == 0 {
			node.Start()
		}
	})

	// The writers: 4 goroutines, transactions of 1 to 8 rows with a pause
	// between them, a fifth rolled back, until nRows rows are committed.
	ctx := context.Background()
	ordered := slices.Contains(relayFlags, "-ordered")
	w := &relayWriters{ob: r.ob, pool: r.pool, exchange: r.exchange, key: r.queue, target: nRows, ordered: ordered}
	seed := r.rng.Uint64()
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(ctx, fmt.Sprintf("%s-w%d", r.name, i), seed+uint64(i), pick(1200, 300))
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

	// The faults, until each has been done or every row is out. When
	// half the rows are committed, the broker node every process dials
	// first, leading the queue, is killed, and started again 3 s later
	// (the faults on the relays go on meanwhile).
	var downAt time.Time
	var downFor time.Duration
	restarts := 0
	storm := r.storm(f, pick(3*time.Minute, 8*time.Minute), writing, stormEvents{
		step: func() bool {
			switch {
			case downAt.IsZero() && w.committedRows() >= nRows/2:
				node.Kill()
				downAt = time.Now()
				n, _ := r.pending()
				t.Logf("%s: killed RabbitMQ node %s with %d rows committed, %d pending", f.name, node.Name, w.committedRows(), n)
				return true
			case restarts == 0 && !downAt.IsZero() && time.Since(downAt) >= 3*time.Second:
				node.Start()
				downFor = time.Since(downAt)
				restarts++
				return true
			}
			return false
		},
		done:  func() bool { return restarts > 0 },
		under: func() bool { return !downAt.IsZero() && restarts == 0 },
	})
	<-writersDone
	if err := w.failure(); err != nil {
		t.Fatal(err)
	}
	committed, rolledBack := w.ids()
	res := r.finish(f.name, storm.kills, committed, rolledBack)
	outOfOrder := 0
	if ordered {
		ids := make([]string, len(res.order))
		for i, c := range res.order {
			ids[i] = c.id
		}
		outOfOrder = relayOrderViolations(t, ids)
	}

	extra := fmt.Sprintf(" phantom=%d rows_committed=%d rows_rolled_back=%d txs_committed=%d txs_rolled_back=%d relays=3 kills=%d kills_holding_claims=%d pauses=%d pauses_holding_claims=%d paused_ms=%d relay_restarts=%d broker_restarts=%d broker_down_ms=%d tap_copies=%d extra_publishes=%d refused=%d max_attempts=%d dead=%d seconds=%.1f",
		res.phantom, len(committed), len(rolledBack), w.txs[0], w.txs[1], storm.kills, storm.killsHolding, storm.pauses, storm.pausesHolding,
		storm.pausedFor.Milliseconds(), res.relayRestarts, restarts, downFor.Milliseconds(), res.tapCopies, res.extraPublishes(),
		res.refused, res.maxAttempts, res.dead, res.elapsed.Seconds())
	if ordered {
		extra += fmt.Sprintf(" ordered=1 out_of_order=%d", outOfOrder)
	}
	r.reportWith(f.name, extra, nil, false)

	if restarts != 1 {
		t.Errorf("%s: the broker was restarted %d times, want once", f.name, restarts)
	}
	storm.checkMid(t, f)
	if len(rolledBack) == 0 {
		t.Errorf("%s: no transaction was rolled back", f.name)
	}
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
