//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
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

// Scenario 22, batches (issue 39): batch consumers (NewBatchConsumer,
// pgstore's BatchTxHandler, batches of up to 20) in child processes of
// this test binary, killed (SIGKILL) at random moments and restarted,
// with poison messages mixed in. The effect is one plain row per message
// per committed batch, with no unique key on the op (batch_effects):
// lost=0 and duplicated=0 hold only if each batch's effects and records
// commit together, once. A poison message fails every batch it is in;
// the batch is split until it is alone, dead-lettered after its
// attempts, and the rest of its batch applied once.
//
// Scenario 22b, batch-kill9, is the same on the Redis store with a plain
// BatchHandler (records completed by CompleteBatch after the handler):
// there the effects are the handler's own, and a kill between a batch's
// effects and its records' completion (the window no lease can close)
// runs them again. Its sink absorbs by op id (batch_applied, as scenario
// 2's ledger), and logs every execution (batch_executions, no unique
// key): duplicated counts ops with more than one execution not absorbed,
// reexecuted those whose re-execution was absorbed.

// Environment of a scenario 22 child.
const (
	envBatchChild  = "CHAOS_BATCH_CHILD_SCHEMA"
	envBatchQueue  = "CHAOS_BATCH_CHILD_QUEUE"
	envBatchStore  = "CHAOS_BATCH_CHILD_STORE" // "pg" or "redis"
	batchEffectsTB = "batch_effects"
	batchAppliedTB = "batch_applied"
	batchExecTB    = "batch_executions"
)

// TestChaos22PGBatchChild is the consumer TestChaos22PGBatchKill9 runs
// in a child process: it consumes until killed or stopped.
func TestChaos22PGBatchChild(t *testing.T) {
	schema, queue := os.Getenv(envBatchChild), os.Getenv(envBatchQueue)
	if schema == "" {
		t.Skip("run by TestChaos22PGBatchKill9")
	}
	pool := pgenv.Pool(t, 8)
	var store lock.Store
	var h amqpidem.BatchHandler
	if os.Getenv(envBatchStore) == "redis" {
		rs, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: queue, LeaseTTL: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		store, h = rs, amqpidem.BatchHandlerFunc(absorbingEffects(pool, schema))
	} else {
		ps, err := pgstore.New(pool, pgstore.Config{Config: lock.Config{LeaseTTL: 2 * time.Second}, Schema: schema, CleanupInterval: -1})
		if err != nil {
			t.Fatal(err)
		}
		effects := pgx.Identifier{schema, batchEffectsTB}.Sanitize()
		store, h = ps, ps.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			for _, d := range ds {
				if strings.HasPrefix(d.MessageId, "poison") {
					return nil, fmt.Errorf("poison %s", d.MessageId) // the batch's error: split
				}
				if _, err := tx.Exec(ctx, "INSERT INTO "+effects+" (op, pid) VALUES ($1, $2)", d.MessageId, os.Getpid()); err != nil {
					return nil, err
				}
			}
			time.Sleep(50 * time.Millisecond) // so that kills land inside batches too
			return nil, nil
		})
	}
	runBatchChild(t, store, h, queue, 20, 40, nil)
}

// absorbingEffects is scenario 22b's batch handler: each batch's effects
// in one autocommit statement, outside any transaction of the store's,
// into a sink that absorbs by op id (batch_applied) and logs every
// execution (batch_executions, absorbed or not).
func absorbingEffects(pool *pgxpool.Pool, schema string) func(context.Context, []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
	applied, execs := pgx.Identifier{schema, batchAppliedTB}.Sanitize(), pgx.Identifier{schema, batchExecTB}.Sanitize()
	return func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		ops := make([]string, len(ds))
		for i, d := range ds {
			if strings.HasPrefix(d.MessageId, "poison") {
				return nil, fmt.Errorf("poison %s", d.MessageId) // the batch's error: split
			}
			ops[i] = d.MessageId
		}
		_, err := pool.Exec(ctx, `WITH ins AS (INSERT INTO `+applied+` (op) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING RETURNING op)
			INSERT INTO `+execs+` (op, pid, absorbed) SELECT o, $2, NOT EXISTS (SELECT 1 FROM ins WHERE ins.op = o) FROM unnest($1::text[]) AS o`,
			ops, os.Getpid())
		if err != nil {
			return nil, err
		}
		time.Sleep(50 * time.Millisecond) // so that kills land between effects and completions too
		return nil, nil
	}
}

// TestChaos22PGBatchKill9: three batch consumer processes on pgstore,
// kill -9 of a random one at random moments (then restarted), poison
// messages mixed in. Each good op's effect row once, each poison op's
// never, its record failed and its dead letter published.
func TestChaos22PGBatchKill9(t *testing.T) { runBatchKill9(t, "pg") }

// TestChaos22RedisBatchKill9: the same on the Redis store (scenario 22b):
// each good op applied once (re-executions absorbed by op id, counted),
// each poison op never, its record failed and its dead letter published.
func TestChaos22RedisBatchKill9(t *testing.T) { runBatchKill9(t, "redis") }

// runBatchKill9 is scenario 22 on store "pg" or "redis".
func runBatchKill9(t *testing.T, kind string) {
	if os.Getenv(envBatchChild) != "" {
		t.Skip("a child")
	}
	url := testenv.AMQPURL(t)
	name := testenv.Name(t)
	pool := pgenv.Pool(t, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	schema, scfg := batchSchema(ctx, t, pool)
	effects := pgx.Identifier{schema, batchEffectsTB}.Sanitize()
	// No unique key on op: a second commit of an op's effect is a second row.
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (seq bigserial PRIMARY KEY, op text NOT NULL, pid int NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	appliedTB, execs := pgx.Identifier{schema, batchAppliedTB}.Sanitize(), pgx.Identifier{schema, batchExecTB}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+appliedTB+" (op text PRIMARY KEY); CREATE TABLE "+execs+
		" (seq bigserial PRIMARY KEY, op text NOT NULL, pid int NOT NULL, absorbed bool NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	if kind == "redis" {
		effects = appliedTB // applied ops: one row each at most
	}

	nGood, nPoison, kills := pick(3000, 20000), pick(6, 20), pick(8, 30)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 39))
	ops, poison := batchOps(nGood, nPoison)
	ch := batchQueue(t, url, name)
	publishOps(ctx, t, ch, name, ops)

	children := startBatchChildren(t, 3, "TestChaos22PGBatchChild", envBatchChild+"="+schema, envBatchQueue+"="+name, envBatchStore+"="+kind)
	count := func(sql string, args ...any) int {
		t.Helper()
		var n int
		if err := pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	applied := func() int { return count("SELECT count(DISTINCT op) FROM " + effects) }

	killed := 0
	for killed < kills && applied() < nGood {
		time.Sleep(time.Duration(100+rng.IntN(400)) * time.Millisecond)
		children.kill9(rng.IntN(len(children.list)))
		killed++
	}
	// Settle: every good op applied, every poison op failed in its record.
	var store lock.Admin
	if kind == "redis" {
		rdb := testenv.RedisClient(t)
		testenv.DeleteKeys(t, rdb, name+"*")
		rs, err := lock.NewRedisStore(rdb, lock.Config{Prefix: name})
		if err != nil {
			t.Fatal(err)
		}
		store = rs
	} else {
		ps, err := pgstore.New(pool, scfg)
		if err != nil {
			t.Fatal(err)
		}
		defer ps.Close()
		store = ps
	}
	failed := func() int { return poisonFailed(ctx, store, name, poison) }
	for applied() < nGood || failed() < nPoison {
		if ctx.Err() != nil {
			t.Fatalf("not settled: %d of %d ops applied, %d of %d poison ops failed", applied(), nGood, failed(), nPoison)
		}
		time.Sleep(200 * time.Millisecond)
	}
	children.stop()

	perOp := perOpRows(ctx, t, pool, "SELECT op, count(*) FROM "+effects+" GROUP BY op")
	// With the Redis store, an op's count is its executions not absorbed
	// (at most one row of it in batch_applied, which decides lost).
	reexecuted := 0
	if kind == "redis" {
		reexecuted = count("SELECT count(DISTINCT op) FROM " + execs + " WHERE absorbed")
		notAbsorbed := perOpRows(ctx, t, pool, "SELECT op, count(*) FILTER (WHERE NOT absorbed) FROM "+execs+" GROUP BY op")
		for op := range perOp {
			perOp[op] = notAbsorbed[op]
		}
	}
	b := tallyBatch(t, ch, name, ops, poison, perOp)
	scenario, extra := "pg-batch-kill9", ""
	if kind == "redis" {
		scenario, extra = "batch-kill9", fmt.Sprintf(" reexecuted=%d", reexecuted)
	}
	line := fmt.Sprintf("scenario %s ops=%d lost=%d duplicated=%d poison=%d poison_applied=%d poison_failed=%d dead_letters=%d poison_dead_lettered_once=%d good_dead_lettered=%d kills=%d%s",
		scenario, nGood, b.lost, b.duplicated, nPoison, b.poisonApplied, failed(), b.deadLetters, b.deadOnce, b.deadGood, killed, extra)
	printFigures(t, line)
	if b.lost != 0 || b.duplicated != 0 || b.poisonApplied != 0 || b.deadGood != 0 {
		t.Errorf("%s: lost %d, duplicated %d, poison effects %d, good ops dead-lettered %d: want all 0", scenario, b.lost, b.duplicated, b.poisonApplied, b.deadGood)
	}
	if killed == 0 {
		t.Errorf("%s: every op was applied before the first kill -9: the scenario tested nothing", scenario)
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Errorf("%s: ran out of time", scenario)
	}
}

// batchTally is what a batch scenario's ledger and dead-letter queue say
// (scenarios 22, 22b, 22c and 23): per good op, lost (no effect) or
// duplicated (more than one); effects of poison ops; and the dead letters
// in name's DLQ, which must hold each poison op at least once (a kill
// between a dead letter's publish and its delivery's ack publishes it
// again: more than once is counted, not failed) and no good op.
type batchTally struct {
	lost, duplicated, poisonApplied int
	deadLetters, deadOnce, deadGood int
}

// tallyBatch counts ops by perOp (effects per op) and drains name's DLQ.
func tallyBatch(t *testing.T, ch *amqp.Channel, name string, ops, poison []string, perOp map[string]int) batchTally {
	t.Helper()
	var b batchTally
	for _, op := range ops {
		switch {
		case strings.HasPrefix(op, "poison"):
			b.poisonApplied += perOp[op]
		case perOp[op] == 0:
			b.lost++
		case perOp[op] > 1:
			b.duplicated++
		}
	}
	dead := map[string]int{}
	for {
		d, ok, err := ch.Get(name+".dlq", true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		dead[d.MessageId]++
	}
	for id, n := range dead {
		b.deadLetters += n
		if !strings.HasPrefix(id, "poison") {
			b.deadGood += n
		}
	}
	for _, p := range poison {
		if dead[p] == 1 {
			b.deadOnce++
		}
		if dead[p] == 0 {
			t.Errorf("%s: no dead letter", p)
		}
	}
	return b
}
