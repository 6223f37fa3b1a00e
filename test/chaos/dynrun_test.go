//go:build linux

package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"os"

	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
)

// dynRun is a scenario on the DynamoDB store (dynamostore, issue 25): an
// effect run, plus a records table and an effects table of its own on one
// of the tests' DynamoDB servers (testenv.EachDynamo: minidyn or DynamoDB
// Local), both deleted in t.Cleanup. The ledger (executions, completions,
// crashes) stays in PostgreSQL; the effects are items in the effects
// table, one per execution whose transaction committed
// (worker.DynamoEffectKey). Its scenario lines name the server:
// "scenario dynamo-kill9/dynamodb-local ...".
type dynRun struct {
	effectRun
	endpoint       string
	table, effects string
	client         *dynamodb.Client
	cfg            dynamostore.Config
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
	r := &dynRun{effectRun: effectRun{env: e, server: srv.Name, start: start}, endpoint: endpoint,
		table: e.name + "-records", effects: e.name + "-effects", client: worker.DynamoClient(endpoint, 30*time.Second)}
	r.sink = r
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

// countApplied returns how many operations have an effect item
// (effectSink).
func (r *dynRun) countApplied(ctx context.Context) (int, error) {
	effects, err := r.readEffects(ctx)
	return len(effects), err
}

// readEffects returns the exec ids of each operation's effect items
// (effectSink).
func (r *dynRun) readEffects(ctx context.Context) (map[string][]string, error) {
	items, err := r.scanEffects(ctx)
	if err != nil {
		return nil, err
	}
	effects := map[string][]string{}
	for _, e := range items {
		effects[e.op] = append(effects[e.op], e.exec)
	}
	return effects, nil
}

// readRecords reads the records with lock.Admin's Inspect (effectSink).
func (r *dynRun) readRecords(context.Context) (func(context.Context, string) (bool, string, error), func(), error) {
	store, err := dynamostore.New(r.client, r.cfg)
	if err != nil {
		return nil, nil, err
	}
	check := func(ctx context.Context, op string) (bool, string, error) {
		rec, err := store.Inspect(ctx, amqpidem.StoreKey(r.queue, op))
		if err != nil {
			return false, "", err
		}
		return rec.State == lock.StateCompleted, fmt.Sprintf("%v (attempts %d, fence %d)", rec.State, rec.Attempts, rec.Fence), nil
	}
	return check, func() {}, nil
}

// commitUnknown reports whether an execution's logged end
// (worker.TxResult) is a TransactWriteItems whose answer never came
// (dynamostore says its outcome may be unknown): its effect item may or
// may not exist. A cancelled transaction wrote nothing (effectSink).
func (r *dynRun) commitUnknown(result string) bool {
	return strings.HasPrefix(result, "failed after-effect unavailable: ") && strings.Contains(result, "outcome may be unknown")
}

// words names dynamostore and its effects, items (effectSink).
func (r *dynRun) words() (store, effect string) { return "dynamostore", "item" }

// dynFlags are the consumer flags the dynamo scenarios share: pgFlags (a
// 2 s lease, short waits, attempts enough for the faults).
var dynFlags = pgFlags
