package worker

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// The dynamo mode's side-effect sink (Config.DynamoEndpoint): a table
// whose partition key is the execution id, one item Put per execution
// that reached its effect, in the TransactWriteItems of dynamostore's
// TxHandler, with no condition. It is deliberately not idempotent: an
// operation applied twice is two items. Only the transaction (the effect
// and the completed record commit together or not at all) keeps it to
// one item per operation.
const (
	// DynamoEffectKey is the effects table's partition key (S): the
	// execution id.
	DynamoEffectKey = "exec_id"
	// DynamoEffectOp, DynamoEffectFence and DynamoEffectConsumer are the
	// item's other attributes: the operation id (S), the lease's fence
	// (N) and the consumer's name (S).
	DynamoEffectOp       = "op_id"
	DynamoEffectFence    = "fence"
	DynamoEffectConsumer = "consumer"
)

// DynamoClient returns a DynamoDB client of the DynamoDB-compatible server
// at endpoint (a local emulator: any credentials, region us-east-1), with
// requests bounded by timeout.
func DynamoClient(endpoint string, timeout time.Duration) *dynamodb.Client {
	return dynamodb.New(dynamodb.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(endpoint),
		HTTPClient:   &http.Client{Timeout: timeout},
		// minidyn sends no X-Amz-Crc32 header, which the SDK (v1.74)
		// checks as a checksum of 0 and warns about on stderr.
		DisableValidateResponseChecksum: true,
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "chaos", SecretAccessKey: "chaos", Source: "chaos"}, nil
		}),
	})
}

// DynamoStoreConfig is the dynamostore configuration of a dynamo-mode
// worker with the given key prefix and records table; a test makes the
// same one to create the table and read the records.
func DynamoStoreConfig(prefix, table string, leaseTTL time.Duration) dynamostore.Config {
	return dynamostore.Config{Config: lock.Config{Prefix: prefix, LeaseTTL: leaseTTL}, Table: table}
}

// DynamoEffectsInput is the CreateTableInput of an effects table.
func DynamoEffectsInput(table string) *dynamodb.CreateTableInput {
	return &dynamodb.CreateTableInput{
		TableName:            aws.String(table),
		AttributeDefinitions: []types.AttributeDefinition{{AttributeName: aws.String(DynamoEffectKey), AttributeType: types.ScalarAttributeTypeS}},
		KeySchema:            []types.KeySchemaElement{{AttributeName: aws.String(DynamoEffectKey), KeyType: types.KeyTypeHash}},
		BillingMode:          types.BillingModePayPerRequest,
	}
}

// openDynamo makes the dynamostore Store on Config.DynamoTable and its
// transactional handler, wrapped as in pg mode (txCompleter).
func (w *Worker) openDynamo() (lock.Store, amqpidem.Handler, *dynamostore.Store, error) {
	cfg := w.cfg
	if cfg.DynamoTable == "" || cfg.DynamoEffects == "" {
		return nil, nil, nil, errors.New("worker: Config.DynamoTable and DynamoEffects are required with DynamoEndpoint")
	}
	scfg := DynamoStoreConfig(cfg.Prefix, cfg.DynamoTable, cfg.StoreLeaseTTL)
	scfg.Logger = cfg.Logger
	ds, err := dynamostore.New(DynamoClient(cfg.DynamoEndpoint, 10*time.Second), scfg)
	if err != nil {
		return nil, nil, nil, err
	}
	c, ok := ds.TxHandler(w.handleDynamoTx).(amqpidem.Completer)
	if !ok {
		return nil, nil, nil, errors.New("worker: dynamostore's TxHandler is not an amqpidem.Completer")
	}
	rec, err := w.recorded(ds)
	if err != nil {
		return nil, nil, nil, err
	}
	st := &store{Store: rec, w: w}
	return st, &txCompleter{Completer: c, store: st, w: w}, ds, nil
}

// handleDynamoTx is the dynamo mode's handler, whose writes dynamostore
// sends with the record's completion in one TransactWriteItems: it logs
// its execution in the ledger (outside the transaction, so that an
// execution whose transaction never commits is still counted), follows the
// message's plan, and adds its effect (a Put of an item of its own) to tx.
// A stalled victim (Plan.Stall) stalls after adding it, announcing so on
// stderr for the test to see.
func (w *Worker) handleDynamoTx(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
	info, op, plan, execID, err := w.start(ctx, d)
	if err != nil {
		return nil, err
	}
	// How the execution ended is logged by txCompleter.
	if plan.Crash == workload.BeforeEffect {
		w.crash(op, plan.Crash, execID, info.Fence)
	}
	if err := sleep(ctx, plan.Work(info.Attempt)); err != nil {
		w.cancelled(ctx, execID)
		return nil, err
	}
	switch {
	case plan.Permanent:
		return nil, amqpidem.Permanent(fmt.Errorf("chaos: %s fails for good", op))
	case plan.AlwaysFail || info.Attempt < plan.FailUntil:
		return nil, fmt.Errorf("chaos: %s fails at attempt %d", op, info.Attempt)
	}
	if ctx.Err() != nil {
		w.cancelled(ctx, execID)
		return nil, context.Cause(ctx)
	}
	// The effect: a plain Put, one item per execution, no condition.
	tx.Put(&types.Put{
		TableName: aws.String(w.cfg.DynamoEffects),
		Item: map[string]types.AttributeValue{
			DynamoEffectKey:      &types.AttributeValueMemberS{Value: execID},
			DynamoEffectOp:       &types.AttributeValueMemberS{Value: op},
			DynamoEffectFence:    &types.AttributeValueMemberN{Value: strconv.FormatInt(info.Fence, 10)},
			DynamoEffectConsumer: &types.AttributeValueMemberS{Value: w.cfg.Name},
		},
	})
	w.markInserted(info.Key, info.Fence)
	if plan.Stall && info.Attempt == 1 {
		fmt.Fprintf(os.Stderr, "chaos: %s stalling %s with its effect in the transaction, fence %d\n", w.cfg.Name, op, info.Fence)
		w.stallUntilCompleted(ctx, op, execID, plan)
	}
	return make([]byte, plan.ResultBytes), nil
}
