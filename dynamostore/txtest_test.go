package dynamostore_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/txtest"
)

// TestTxHandlerConformance runs the handler idioms of package txtest
// through a Consumer on each DynamoDB server of the tests: every idiom
// comes to its effect once or a dead letter, and to the same on both
// servers. The table is logged (go test -v -run TestTxHandlerConformance
// ./dynamostore/).
func TestTxHandlerConformance(t *testing.T) {
	var mu sync.Mutex
	all := map[string][]txtest.Row{}
	t.Run("servers", func(t *testing.T) {
		eachServer(t, func(t *testing.T, srv *server) {
			env := txtest.Env{
				Store:   srv.newStore(t, dynamostore.Config{}),
				Effects: func(t testing.TB, op string) int { return srv.count(t, op) },
			}
			rows := txtest.Check(t, "tx", func(*testing.T) txtest.Env { return env }, idioms(env.Store.(*dynamostore.Store), srv.effects(t)))
			mu.Lock()
			all[srv.Name] = rows
			mu.Unlock()
		})
	})
	if len(all) == 2 {
		txtest.Same(t, all["minidyn"], all["dynamodb-local"])
	}
	for _, name := range []string{"minidyn", "dynamodb-local"} {
		for _, r := range all[name] {
			if r.Case != "" { // a case -run left out
				t.Logf("%-14s %s", name, r)
			}
		}
	}
}

// idioms are the handler shapes users write with a Tx, on store, whose
// effect is a counter item of the effects table incremented by every
// execution that commits (an ADD, not idempotent by itself).
func idioms(store *dynamostore.Store, effects string) []txtest.Case {
	errDeclined := errors.New("the card was declined")
	// handler makes the idiom fn into a TxHandler whose function fails
	// first as txtest wants, then adds the effect, then runs fn.
	handler := func(fn func(r *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error)) func(r *txtest.Run) amqpidem.Handler {
		return func(r *txtest.Run) amqpidem.Handler {
			return store.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.FailFirst(d); err != nil {
					return nil, err
				}
				bump(tx, effects, txtest.Op(ctx, d))
				return fn(r, ctx, tx, d)
			})
		}
	}
	// failing adds a condition that fails every time: an item that is
	// never there.
	failing := func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) {
		tx.ConditionCheck(&types.ConditionCheck{
			TableName:           aws.String(effects),
			Key:                 map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: txtest.Op(ctx, d) + "/account"}},
			ConditionExpression: aws.String("attribute_exists(id)"),
		})
	}
	return []txtest.Case{
		{Name: "plain success", Effects: 1, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			return []byte("receipt"), nil
		})},
		{Name: "an error every time", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, errDeclined
		})},
		{Name: "Permanent", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, amqpidem.Permanent(errDeclined)
		})},
		{Name: "panic", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			panic("the handler panicked")
		})},
		{Name: "a condition that fails, no OnConditionFailed", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			failing(ctx, tx, d)
			return nil, nil
		})},
		{Name: "a condition that fails, OnConditionFailed Permanent", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			failing(ctx, tx, d)
			tx.OnConditionFailed = func(int, map[string]types.AttributeValue) error { return amqpidem.Permanent(errDeclined) }
			return nil, nil
		})},
		{Name: "a condition that fails, OnConditionFailed nil", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			failing(ctx, tx, d)
			tx.OnConditionFailed = func(int, map[string]types.AttributeValue) error { return nil }
			return nil, nil
		})},
		{Name: "two writes of one item (refused)", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, effects, txtest.Op(ctx, d))
			return nil, nil
		})},
		{Name: "more items than a transaction takes", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			for i := range dynamostore.MaxTxItems {
				bump(tx, effects, txtest.Op(ctx, d)+"/"+strings.Repeat("x", i+1))
			}
			return nil, nil
		})},
		{Name: "a result too large to store", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			return make([]byte, store.MaxResultSize()+1), nil
		})},
		{Name: "idle past the lease", Effects: 1, Handler: handler(func(r *txtest.Run, ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			if r.First(d) {
				time.Sleep(txtest.LeaseTTL * 3 / 2) // a slow call elsewhere; the heartbeat keeps the lease
			}
			return nil, nil
		})},
	}
}
