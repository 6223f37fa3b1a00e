package dynamostore_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/dynamostore"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// sentTx is one TransactWriteItems a txRecorder saw: its items, the bytes
// of their values, and whether DynamoDB took it.
type sentTx struct {
	items, bytes int
	ok           bool
}

// txRecorder records the TransactWriteItems its client sends.
type txRecorder struct {
	dynamostore.Client
	mu   sync.Mutex
	sent []sentTx
}

func (r *txRecorder) TransactWriteItems(ctx context.Context, in *dynamodb.TransactWriteItemsInput, opts ...func(*dynamodb.Options)) (*dynamodb.TransactWriteItemsOutput, error) {
	out, err := r.Client.TransactWriteItems(ctx, in, opts...)
	bytes := 0
	for _, it := range in.TransactItems {
		var vs []map[string]types.AttributeValue
		switch {
		case it.Put != nil:
			vs = append(vs, it.Put.Item)
		case it.Update != nil:
			vs = append(vs, it.Update.Key, it.Update.ExpressionAttributeValues)
		}
		for _, m := range vs {
			for k, v := range m {
				bytes += len(k)
				switch v := v.(type) {
				case *types.AttributeValueMemberS:
					bytes += len(v.Value)
				case *types.AttributeValueMemberB:
					bytes += len(v.Value)
				}
			}
		}
	}
	r.mu.Lock()
	r.sent = append(r.sent, sentTx{items: len(in.TransactItems), bytes: bytes, ok: err == nil})
	r.mu.Unlock()
	return out, err
}

// TestBatchTxHandlerCutToFit runs a batch whose handler's items and
// records exceed one TransactWriteItems (in items, then in bytes): it is
// cut until each part fits, every transaction sent is within DynamoDB's
// limits and taken, and every message completes once, at its first
// attempt, none refused. Before the byte limit was checked, minidyn
// committed a transaction of 4.8 MB and DynamoDB Local refused one.
func TestBatchTxHandlerCutToFit(t *testing.T) {
	for _, tc := range []struct {
		name     string
		messages int
		blob     int // bytes of the item each message puts, besides its counter
	}{
		{"items", 40, 0},         // 40 counters, 40 twins, 40 records: 120 items
		{"bytes", 16, 300 << 10}, // 16 items of 300 KB: 4.8 MB
	} {
		t.Run(tc.name, func(t *testing.T) {
			eachServer(t, func(t *testing.T, srv *server) {
				client, records := srv.sharedTable(t)
				rec := &txRecorder{Client: client}
				s, err := dynamostore.New(rec, dynamostore.Config{Table: records, MaxClockSkew: testSkew, Config: lock.Config{Prefix: testenv.Name(t)}})
				if err != nil {
					t.Fatal(err)
				}
				table, prefix, queue := srv.effects(t), testenv.Name(t), testenv.Name(t)
				ch := testenv.QueueChannel(t, queue)
				var mu sync.Mutex
				var events []amqpidem.Event
				var runs []int
				h := s.BatchTxHandler(func(ctx context.Context, tx *dynamostore.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
					mu.Lock()
					runs = append(runs, len(ds))
					mu.Unlock()
					for _, d := range ds {
						bump(tx, table, prefix+"-"+d.MessageId)
						if tc.blob == 0 {
							bump(tx, table, prefix+"-"+d.MessageId+"-twin")
							continue
						}
						tx.Put(&types.Put{TableName: aws.String(table), Item: map[string]types.AttributeValue{
							"id": &types.AttributeValueMemberS{Value: prefix + "-" + d.MessageId + "-blob"},
							"x":  &types.AttributeValueMemberS{Value: strings.Repeat("x", tc.blob)},
						}})
					}
					return nil, nil
				})
				var ids []string
				for i := range tc.messages {
					id := fmt.Sprintf("m%02d", i)
					ids = append(ids, id)
					if err := ch.PublishWithContext(context.Background(), "", queue, false, false,
						amqp.Publishing{MessageId: id, DeliveryMode: amqp.Persistent}); err != nil {
						t.Fatal(err)
					}
				}
				c, err := amqpidem.NewBatchConsumer(s, amqpidem.ConsumerConfig{
					URL: testenv.AMQPURL(t), Prefetch: 64, BatchSize: tc.messages, BatchWait: 300 * time.Millisecond,
					Config: amqpidem.Config{
						Queue: queue, LeaseTTL: 10 * time.Second,
						Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
						Logger:  slog.New(slog.DiscardHandler),
						Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) {
							mu.Lock()
							events = append(events, e)
							mu.Unlock()
						}),
					},
				}, h)
				if err != nil {
					t.Fatal(err)
				}
				testrun.Consumer(t, c)
				deadline := time.Now().Add(60 * time.Second)
				for {
					mu.Lock()
					n := len(events)
					mu.Unlock()
					if n >= len(ids) {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("%d of %d messages settled in 60s", n, len(ids))
					}
					time.Sleep(20 * time.Millisecond)
				}
				mu.Lock()
				defer mu.Unlock()
				got := map[string][]string{}
				for _, e := range events {
					got[e.Key] = append(got[e.Key], fmt.Sprintf("%v attempt %d", e.Outcome, e.Attempt))
				}
				for _, id := range ids {
					if want := []string{fmt.Sprintf("%v attempt 1", amqpidem.Completed)}; fmt.Sprint(got[id]) != fmt.Sprint(want) {
						t.Errorf("%s: %v, want %v", id, got[id], want)
					}
					if n := srv.count(t, prefix+"-"+id); n != 1 {
						t.Errorf("%s: effect applied %d times, want 1", id, n)
					}
				}
				rec.mu.Lock()
				defer rec.mu.Unlock()
				t.Logf("handler runs (batch sizes): %v; transactions sent: %+v", runs, rec.sent)
				if runs[0] != len(ids) {
					t.Errorf("first batch: %d messages, want all %d (a batch too small tests nothing)", runs[0], len(ids))
				}
				committed := 0
				for _, tx := range rec.sent {
					if tx.items > dynamostore.MaxTxItems || tx.bytes > dynamostore.MaxTxBytes || !tx.ok {
						t.Errorf("transaction sent: %+v; want at most %d items and %d bytes, taken", tx, dynamostore.MaxTxItems, dynamostore.MaxTxBytes)
					}
					if tx.ok {
						committed++
					}
				}
				if committed < 2 {
					t.Errorf("%d transactions committed, want the batch cut in at least 2", committed)
				}
			})
		})
	}
}
