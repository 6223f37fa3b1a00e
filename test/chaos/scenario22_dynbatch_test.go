//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
)

// Scenario 22c, dynamo-batch-kill9 (issue 39): scenario 22 on
// dynamostore. Three batch consumers (NewBatchConsumer with a
// BatchTxHandler, batches of up to 60, their leases taken by AcquireBatch)
// in child processes of this test binary, killed (SIGKILL) at random
// moments and restarted, with poison messages mixed in. The effect of a
// message is one item Put with no condition, under a key of its own per
// execution (no unique key on the op): a second commit of an op's effect
// is a second item, so lost=0 and duplicated=0 hold only if each batch's
// effects and records commit together, once. A full batch (60 effects and
// 60 records, 120 items) does not fit in one TransactWriteItems and is
// cut in halves, so the cut runs under the kills too. A poison message
// fails every batch it is in; the batch is split until it is alone,
// dead-lettered after its attempts, and the rest of its batch applied
// once. It runs once per DynamoDB server of the tests (minidyn, then
// DynamoDB Local), and its line names the server.

// Environment of a scenario 22c child.
const (
	envDynBatchQueue    = "CHAOS_DYNBATCH_CHILD_QUEUE"
	envDynBatchEndpoint = "CHAOS_DYNBATCH_CHILD_ENDPOINT"
	envDynBatchTables   = "CHAOS_DYNBATCH_CHILD_TABLES" // "records,effects"
	dynBatchExecAttr    = "exec"                        // the effects table's key: one per execution
	dynBatchOpAttr      = "op"
)

// dynBatchStoreConfig is the store configuration of the children and of
// the test reading their records: a 2 s lease, and a clock skew of 200 ms
// (every process shares one clock) so that a killed consumer's keys are
// taken over soon.
func dynBatchStoreConfig(prefix, table string) dynamostore.Config {
	return dynamostore.Config{Config: lock.Config{Prefix: prefix, LeaseTTL: 2 * time.Second}, Table: table, MaxClockSkew: 200 * time.Millisecond}
}

// TestChaos22DynamoBatchChild is the consumer TestChaos22DynamoBatchKill9
// runs in a child process: it consumes until killed or stopped.
func TestChaos22DynamoBatchChild(t *testing.T) {
	queue := os.Getenv(envDynBatchQueue)
	if queue == "" {
		t.Skip("run by TestChaos22DynamoBatchKill9")
	}
	records, effects, _ := strings.Cut(os.Getenv(envDynBatchTables), ",")
	s, err := dynamostore.New(worker.DynamoClient(os.Getenv(envDynBatchEndpoint), 30*time.Second), dynBatchStoreConfig(queue, records))
	if err != nil {
		t.Fatal(err)
	}
	run := fmt.Sprintf("%d.%x", os.Getpid(), rand.Uint64()) // this process, even if its pid comes again
	var execs atomic.Int64
	h := s.BatchTxHandler(func(ctx context.Context, tx *dynamostore.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		for _, d := range ds {
			if strings.HasPrefix(d.MessageId, "poison") {
				return nil, fmt.Errorf("poison %s", d.MessageId) // the batch's error: split
			}
			tx.Put(&types.Put{TableName: aws.String(effects), Item: map[string]types.AttributeValue{
				dynBatchExecAttr: &types.AttributeValueMemberS{Value: fmt.Sprintf("%s.%s.%d", d.MessageId, run, execs.Add(1))},
				dynBatchOpAttr:   &types.AttributeValueMemberS{Value: d.MessageId},
			}})
		}
		time.Sleep(50 * time.Millisecond) // so that kills land inside batches too
		return nil, nil
	})
	runBatchChild(t, s, h, queue, 60, 80, func(c *amqpidem.Config) {
		// Poison is dead-lettered after 10 attempts; a good message
		// is only if 10 kills or lease expiries in a row caught it
		// (with 3, minidyn's slow transactions and 30 kills
		// dead-lettered 16 of 1,000: records failed at attempts 4-5).
		c.MaxAttempts = 10
	})
}

// TestChaos22DynamoBatchKill9: three batch consumer processes on
// dynamostore, kill -9 of a random one at random moments (then
// restarted), poison messages mixed in, on each DynamoDB server. Each good
// op's effect item once, each poison op's never, its record failed and
// its dead letter published.
func TestChaos22DynamoBatchKill9(t *testing.T) {
	if os.Getenv(envDynBatchQueue) != "" {
		t.Skip("a child")
	}
	testenv.EachDynamo(t, runDynBatchKill9)
}

// runDynBatchKill9 is scenario 22c on srv.
func runDynBatchKill9(t *testing.T, srv testenv.DynamoServer) {
	url := testenv.AMQPURL(t)
	name := testenv.Name(t)
	ctx, cancel := context.WithTimeout(context.Background(), pick(2*time.Minute, 8*time.Minute))
	defer cancel()
	client := worker.DynamoClient(srv.Endpoint, 30*time.Second)
	records, effects := name+"-records", name+"-effects"
	cfg := dynBatchStoreConfig(name, records)
	t.Cleanup(func() {
		for _, tb := range []string{records, effects} {
			_, _ = client.DeleteTable(context.Background(), &dynamodb.DeleteTableInput{TableName: aws.String(tb)})
		}
	})
	if err := dynamostore.CreateTable(ctx, client, cfg); err != nil {
		t.Fatalf("creating the records table: %v", err)
	}
	// Keyed by execution: nothing absorbs a second commit of an op.
	if _, err := client.CreateTable(ctx, &dynamodb.CreateTableInput{
		TableName:            aws.String(effects),
		AttributeDefinitions: []types.AttributeDefinition{{AttributeName: aws.String(dynBatchExecAttr), AttributeType: types.ScalarAttributeTypeS}},
		KeySchema:            []types.KeySchemaElement{{AttributeName: aws.String(dynBatchExecAttr), KeyType: types.KeyTypeHash}},
		BillingMode:          types.BillingModePayPerRequest,
	}); err != nil {
		t.Fatalf("creating the effects table: %v", err)
	}

	nGood, nPoison, kills := pick(2000, 20000), pick(6, 20), pick(6, 30)
	if !srv.Strict {
		// minidyn runs each transaction under one lock over a deep copy
		// of the tables it writes (to roll it back): its cost grows with
		// the tables, and decides one failed condition per cancelled
		// transaction (AcquireBatch then takes the rest key by key).
		// At 5,000 ops on a shared 2-core machine it applied 4,176 in the
		// 8 minutes allowed, its transactions taking seconds.
		nGood = pick(500, 1000)
	}
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 39))
	ops, poison := batchOps(nGood, nPoison)
	ch := batchQueue(t, url, name)
	publishOps(ctx, t, ch, name, ops)

	children := startBatchChildren(t, 3, "TestChaos22DynamoBatchChild",
		envDynBatchQueue+"="+name, envDynBatchEndpoint+"="+srv.Endpoint, envDynBatchTables+"="+records+","+effects)
	// perOp counts each op's effect items (a strongly consistent scan).
	perOp := func(ctx context.Context) map[string]int {
		t.Helper()
		m := map[string]int{}
		pages := dynamodb.NewScanPaginator(client, &dynamodb.ScanInput{TableName: aws.String(effects), ConsistentRead: aws.Bool(true)})
		for pages.HasMorePages() {
			page, err := pages.NextPage(ctx)
			if err != nil {
				t.Fatalf("scanning the effects: %v", err)
			}
			for _, it := range page.Items {
				if op, ok := it[dynBatchOpAttr].(*types.AttributeValueMemberS); ok {
					m[op.Value]++
				}
			}
		}
		return m
	}
	applied := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		n := 0
		for op := range perOp(ctx) {
			if !strings.HasPrefix(op, "poison") {
				n++
			}
		}
		return n
	}

	killed := 0
	for killed < kills && applied() < nGood {
		time.Sleep(time.Duration(100+rng.IntN(400)) * time.Millisecond)
		children.kill9(rng.IntN(len(children.list)))
		killed++
	}
	// Settle: every good op applied, every poison op failed in its record.
	store, err := dynamostore.New(client, cfg)
	if err != nil {
		t.Fatal(err)
	}
	failed := func() int { return poisonFailed(ctx, store, name, poison) }
	settled := true
	for applied() < nGood || failed() < nPoison {
		if ctx.Err() != nil {
			// Not settled: report what is missing (an op acked with no
			// effect is lost), then the figures as they are.
			counts := perOp(context.Background())
			var missing []string
			for _, op := range ops {
				if len(missing) < 20 && (counts[op] == 0 || strings.HasPrefix(op, "poison")) {
					rec, err := store.Inspect(context.Background(), amqpidem.StoreKey(name, op))
					missing = append(missing, fmt.Sprintf("%s: %d items, record %v attempts %d (%v)", op, counts[op], rec.State, rec.Attempts, err))
				}
			}
			t.Errorf("not settled: %d of %d ops applied; unapplied and poison ops (the first 20):\n%s", applied(), nGood, strings.Join(missing, "\n"))
			settled = false
			break
		}
		time.Sleep(300 * time.Millisecond)
	}
	// The figures, read with a context of their own (ctx may be over).
	ctx, cancel = context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	children.stop()

	counts := perOp(ctx)
	effectItems := 0
	for _, op := range ops {
		effectItems += counts[op]
	}
	b := tallyBatch(t, ch, name, ops, poison, counts)
	scenario := "dynamo-batch-kill9/" + srv.Name
	line := fmt.Sprintf("scenario %s ops=%d lost=%d duplicated=%d effect_items=%d poison=%d poison_applied=%d poison_failed=%d dead_letters=%d poison_dead_lettered_once=%d good_dead_lettered=%d kills=%d",
		scenario, nGood, b.lost, b.duplicated, effectItems, nPoison, b.poisonApplied, failed(), b.deadLetters, b.deadOnce, b.deadGood, killed)
	printFigures(t, line)
	if b.lost != 0 || b.duplicated != 0 || b.poisonApplied != 0 || b.deadGood != 0 {
		t.Errorf("%s: lost %d, duplicated %d, poison effects %d, good ops dead-lettered %d: want all 0", scenario, b.lost, b.duplicated, b.poisonApplied, b.deadGood)
	}
	if !settled {
		t.Errorf("%s: ran out of time", scenario)
	}
	if killed == 0 {
		t.Errorf("%s: every op was applied before the first kill -9: the scenario tested nothing", scenario)
	}
}
