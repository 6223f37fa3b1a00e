//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// Scenario 23, pg-batch-sigstop (issue 39): batch consumers on pgstore
// (NewBatchConsumer, BatchTxHandler, batches of up to 20) in child
// processes of this test binary. At random moments one is stopped
// (SIGSTOP) while a batch of it is open in its transaction (its effect
// rows written, not committed), for longer than its leases' TTL: copies
// of that batch's messages are published (as a publisher's retry would),
// the other consumers take the expired leases over with higher fences and
// commit the effects. The stopped one is then continued (SIGCONT), its
// late commit to be refused by the records' compare-and-set on owner and
// fence (nothing of its batch commits), or killed with kill -9 while
// stopped; other kills land at random moments too. Poison messages are
// mixed in (a batch error: split down to the poison, dead-lettered). The
// effect is one plain row per op per committed batch, with no unique key
// on the op: lost=0 and duplicated=0 hold only if a stale batch never
// commits.
//
// The children log, outside their transactions, each batch they start
// (batch_started) and what each batch completion came to
// (batch_outcomes), which tell where a stop landed and whether the late
// commit was refused.

// Environment of a scenario 23 child.
const (
	envSigstopChild = "CHAOS_BATCHSTOP_CHILD_SCHEMA"
	envSigstopQueue = "CHAOS_BATCHSTOP_CHILD_QUEUE"
	stopLeaseTTL    = 2 * time.Second
)

// TestChaos23PGBatchSigstopChild is the consumer TestChaos23PGBatchSigstop
// runs in a child process: it consumes until killed or stopped.
func TestChaos23PGBatchSigstopChild(t *testing.T) {
	schema, queue := os.Getenv(envSigstopChild), os.Getenv(envSigstopQueue)
	if schema == "" {
		t.Skip("run by TestChaos23PGBatchSigstop")
	}
	pool := pgenv.Pool(t, 8)
	ps, err := pgstore.New(pool, pgstore.Config{Config: lock.Config{LeaseTTL: stopLeaseTTL}, Schema: schema, CleanupInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, batchEffectsTB}.Sanitize()
	started := pgx.Identifier{schema, "batch_started"}.Sanitize()
	pid := os.Getpid()
	h := ps.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		ops := make([]string, len(ds))
		for i, d := range ds {
			if strings.HasPrefix(d.MessageId, "poison") {
				return nil, fmt.Errorf("poison %s", d.MessageId) // the batch's error: split
			}
			ops[i] = d.MessageId
		}
		// Outside the transaction: the test reads it while the batch is open.
		if _, err := pool.Exec(ctx, "INSERT INTO "+started+" (pid, ops) VALUES ($1, $2)", pid, ops); err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+effects+" (op, pid) SELECT unnest($1::text[]), $2", ops, pid); err != nil {
			return nil, err
		}
		// The window a stop is to land in: the effects written, not
		// committed. The sleep ignores ctx, as a stalled handler would.
		time.Sleep(150 * time.Millisecond)
		return nil, nil
	})
	bc, ok := h.(amqpidem.BatchCompleter)
	if !ok {
		t.Fatal("BatchTxHandler is not an amqpidem.BatchCompleter")
	}
	logged := outcomeLogger{BatchCompleter: bc, pool: pool, table: pgx.Identifier{schema, "batch_outcomes"}.Sanitize(), pid: pid}
	runBatchChild(t, ps, logged, queue, 20, 40, func(c *amqpidem.Config) {
		c.LeaseTTL = stopLeaseTTL
		c.InProgressDelay = 300 * time.Millisecond
	})
}

// outcomeLogger is a BatchCompleter that logs what each batch completion
// came to: the batch's ops, and whether its records refused it for a
// lease lost.
type outcomeLogger struct {
	amqpidem.BatchCompleter
	pool  *pgxpool.Pool
	table string
	pid   int
}

func (o outcomeLogger) HandleBatchComplete(ctx context.Context, items []amqpidem.BatchItem, value func(int, []byte) ([]byte, error)) ([]amqpidem.BatchResult, error) {
	rs, err := o.BatchCompleter.HandleBatchComplete(ctx, items, value)
	ops := make([]string, len(items))
	for i, it := range items {
		ops[i] = it.Delivery.MessageId
	}
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	lctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = o.pool.Exec(lctx, "INSERT INTO "+o.table+" (pid, ops, lease_lost, err) VALUES ($1, $2, $3, $4)",
		o.pid, ops, errors.Is(err, lock.ErrLeaseLost), msg)
	return rs, err
}

// TestChaos23PGBatchSigstop: three batch consumer processes on pgstore;
// a random one SIGSTOPped in its batch's transaction past its leases'
// TTL, its batch taken over, then continued or killed; kill -9 of random
// ones between stops; poison messages mixed in. Each good op's effect row
// once, each poison op's never, and no good op dead-lettered.
func TestChaos23PGBatchSigstop(t *testing.T) {
	if os.Getenv(envSigstopChild) != "" {
		t.Skip("a child")
	}
	url := testenv.AMQPURL(t)
	name := testenv.Name(t)
	pool := pgenv.Pool(t, 4)
	ctx, cancel := context.WithTimeout(context.Background(), pick(3*time.Minute, 10*time.Minute))
	defer cancel()
	schema, scfg := batchSchema(ctx, t, pool)
	effects := pgx.Identifier{schema, batchEffectsTB}.Sanitize()
	started := pgx.Identifier{schema, "batch_started"}.Sanitize()
	outcomes := pgx.Identifier{schema, "batch_outcomes"}.Sanitize()
	// No unique key on op: a second commit of an op's effect is a second row.
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (seq bigserial PRIMARY KEY, op text NOT NULL, pid int NOT NULL);"+
		"CREATE TABLE "+started+" (seq bigserial PRIMARY KEY, pid int NOT NULL, ops text[] NOT NULL);"+
		"CREATE TABLE "+outcomes+" (seq bigserial PRIMARY KEY, pid int NOT NULL, ops text[] NOT NULL, lease_lost bool NOT NULL, err text NOT NULL)"); err != nil {
		t.Fatal(err)
	}

	nGood, nPoison := pick(1500, 10000), pick(6, 20)
	stopsWanted, kills := pick(4, 15), pick(3, 15)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 23))
	ops, poison := batchOps(nGood, nPoison)
	ch := batchQueue(t, url, name)
	publish := func(ids []string) { t.Helper(); publishOps(ctx, t, ch, name, ids) }
	// The ops are fed in bursts of 20 over the time the stops and kills
	// are planned to take, so that the consumers are busy at every stop.
	planned := time.Duration(stopsWanted)*8*time.Second + time.Duration(kills)*time.Second
	began, fed := time.Now(), 0
	feed := func(all bool) {
		t.Helper()
		due := min(len(ops), int(float64(len(ops))*float64(time.Since(began))/float64(planned)))
		if all {
			due = len(ops)
		}
		if due-fed >= 20 || (due == len(ops) && due > fed) {
			publish(ops[fed:due])
			fed = due
		}
	}
	feed(false)

	children := startBatchChildren(t, 3, "TestChaos23PGBatchSigstopChild", envSigstopChild+"="+schema, envSigstopQueue+"="+name)
	count := func(sql string, args ...any) int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	applied := func() int { return count("SELECT count(DISTINCT op) FROM " + effects) }

	// A stop that landed in a batch's transaction: the stopped child, the
	// batch's ops, and whether it was continued (else killed).
	type stop struct {
		pid       int
		ops       []string
		continued bool
	}
	var stops []stop
	killed, tries, takenOver := 0, 0, 0
	lastSeq := map[int]int64{} // the last batch of each child a stop landed in
	for (len(stops) < stopsWanted || killed < kills) && ctx.Err() == nil {
		for range 1 + rng.IntN(4) {
			time.Sleep(100 * time.Millisecond)
			feed(false)
		}
		i := rng.IntN(len(children.list))
		if len(stops) >= stopsWanted || (killed < kills && rng.IntN(3) == 0) {
			children.kill9(i)
			killed++
			continue
		}
		tries++
		pid := children.list[i].cmd.Process.Pid
		children.signal(i, syscall.SIGSTOP)
		time.Sleep(200 * time.Millisecond) // a COMMIT already sent lands meanwhile
		// Its last batch started: open in its transaction if none of its
		// effect rows committed.
		var batch []string
		var seq int64
		err := pool.QueryRow(ctx, "SELECT s.seq, s.ops FROM "+started+" s WHERE s.pid = $1 AND s.seq > $2 AND NOT EXISTS (SELECT 1 FROM "+effects+
			" e WHERE e.pid = $1 AND e.op = ANY(s.ops)) AND s.seq = (SELECT max(seq) FROM "+started+" WHERE pid = $1)", pid, lastSeq[pid]).Scan(&seq, &batch)
		if errors.Is(err, pgx.ErrNoRows) {
			children.signal(i, syscall.SIGCONT) // between batches: try again
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		lastSeq[pid] = seq
		// Copies of its batch (as a publisher's retry would send): the
		// others take them over once the stopped leases expire. The
		// broker pushes some copies to the stopped child too, while its
		// prefetch has room, where they wait: those not taken over are
		// published again every second.
		stopped := time.Now()
		deadline := stopped.Add(30 * time.Second)
		for time.Now().Before(deadline) {
			var missing []string
			if err := pool.QueryRow(ctx, "SELECT coalesce(array_agg(o), '{}') FROM unnest($2::text[]) AS o WHERE NOT EXISTS (SELECT 1 FROM "+effects+
				" e WHERE e.pid <> $1 AND e.op = o)", pid, batch).Scan(&missing); err != nil {
				t.Fatal(err)
			}
			if len(missing) == 0 {
				break
			}
			publish(missing)
			for range 10 {
				time.Sleep(100 * time.Millisecond)
				feed(false)
			}
		}
		if n := count("SELECT count(DISTINCT op) FROM "+effects+" WHERE pid <> $1 AND op = ANY($2)", pid, batch); n == len(batch) {
			takenOver++
		} else {
			t.Logf("pg-batch-sigstop: pid %d: %d of %d ops of its stopped batch taken over in %v", pid, n, len(batch), time.Since(stopped).Round(time.Millisecond))
		}
		s := stop{pid: pid, ops: batch, continued: rng.IntN(3) != 0}
		if s.continued {
			children.signal(i, syscall.SIGCONT)
		} else {
			children.kill9(i) // killed while stopped
			killed++
		}
		t.Logf("pg-batch-sigstop: pid %d stopped for %v in a batch of %d, continued=%v",
			pid, time.Since(stopped).Round(time.Millisecond), len(batch), s.continued)
		stops = append(stops, s)
	}

	feed(true)

	// Settle: every good op applied, every poison op failed in its record.
	ps, err := pgstore.New(pool, scfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	failed := func() int { return poisonFailed(ctx, ps, name, poison) }
	settleBy := time.Now().Add(pick(time.Minute, 3*time.Minute))
	for applied() < nGood || failed() < nPoison {
		if time.Now().After(settleBy) {
			var missing []string
			_ = pool.QueryRow(ctx, "SELECT coalesce(array_agg(o), '{}') FROM unnest($1::text[]) AS o WHERE NOT EXISTS (SELECT 1 FROM "+effects+" e WHERE e.op = o)", ops).Scan(&missing)
			for _, op := range missing[:min(len(missing), 5)] {
				rec, err := ps.Inspect(ctx, amqpidem.StoreKey(name, op))
				t.Logf("not settled: %s: record %+v, %v", op, rec, err)
			}
			t.Fatalf("not settled: %d of %d ops applied, %d of %d poison ops failed", applied(), nGood, failed(), nPoison)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// The continued ones' late completions: refused for a lease lost.
	lateRefused, lateCommitted := 0, 0
	for _, s := range stops {
		if !s.continued {
			continue
		}
		if count("SELECT count(*) FROM "+outcomes+" WHERE pid = $1 AND ops && $2 AND lease_lost", s.pid, s.ops) > 0 {
			lateRefused++
		} else {
			// Its batch ended before its commit (its context cancelled
			// once the heartbeat found the leases lost): harmless too.
			var errs []string
			if err := pool.QueryRow(ctx, "SELECT coalesce(array_agg(err), '{}') FROM "+outcomes+" WHERE pid = $1 AND ops && $2", s.pid, s.ops).Scan(&errs); err != nil {
				t.Fatal(err)
			}
			t.Logf("pg-batch-sigstop: pid %d continued: no commit refused; its batch's completions answered %q", s.pid, errs)
		}
		if count("SELECT count(*) FROM "+effects+" WHERE pid = $1 AND op = ANY($2)", s.pid, s.ops) > 0 {
			lateCommitted++
		}
	}
	children.stop()

	perOp := perOpRows(ctx, t, pool, "SELECT op, count(*) FROM "+effects+" GROUP BY op")
	b := tallyBatch(t, ch, name, ops, poison, perOp)
	continued := 0
	for _, s := range stops {
		if s.continued {
			continued++
		}
	}
	line := fmt.Sprintf("scenario pg-batch-sigstop ops=%d lost=%d duplicated=%d poison=%d poison_applied=%d poison_failed=%d dead_letters=%d good_dead_lettered=%d stops_in_tx=%d stop_tries=%d taken_over=%d continued=%d late_refused=%d late_committed=%d kills=%d",
		nGood, b.lost, b.duplicated, nPoison, b.poisonApplied, failed(), b.deadLetters, b.deadGood, len(stops), tries, takenOver, continued, lateRefused, lateCommitted, killed)
	printFigures(t, line)
	if b.lost != 0 || b.duplicated != 0 || b.poisonApplied != 0 || b.deadGood != 0 {
		t.Errorf("pg-batch-sigstop: lost %d, duplicated %d, poison effects %d, good ops dead-lettered %d: want all 0", b.lost, b.duplicated, b.poisonApplied, b.deadGood)
	}
	if lateCommitted != 0 {
		t.Errorf("pg-batch-sigstop: %d continued consumers committed their stale batch", lateCommitted)
	}
	if len(stops) == 0 || takenOver == 0 {
		t.Errorf("pg-batch-sigstop: %d stops landed in a batch's transaction, %d batches taken over: the scenario tested nothing", len(stops), takenOver)
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Errorf("pg-batch-sigstop: ran out of time")
	}
}
