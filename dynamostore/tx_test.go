package dynamostore_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
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
)

// bump adds to tx the effect of one execution for id: a counter that
// counts every execution, the plain non-idempotent write.
func bump(tx *dynamostore.Tx, table, id string) {
	tx.Update(&types.Update{
		TableName:                 aws.String(table),
		Key:                       map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: id}},
		UpdateExpression:          aws.String("ADD #n :one"),
		ExpressionAttributeNames:  map[string]string{"#n": "n"},
		ExpressionAttributeValues: map[string]types.AttributeValue{":one": &types.AttributeValueMemberN{Value: "1"}},
	})
}

func completer(t *testing.T, h amqpidem.Handler) amqpidem.Completer {
	t.Helper()
	c, ok := h.(amqpidem.Completer)
	if !ok {
		t.Fatalf("%T is not an amqpidem.Completer", h)
	}
	return c
}

func same(b []byte) ([]byte, error) { return b, nil }

func TestTxHandlerCommitsEffectWithRecord(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		res, err := s.Acquire(ctx, lock.Request{Key: "op-1"})
		if err != nil {
			t.Fatal(err)
		}
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, table, id)
			return []byte("receipt"), nil
		}))
		if h.CompleterStore() != lock.Store(s) {
			t.Fatal("CompleterStore is not the store")
		}
		got, err := h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, func(r []byte) ([]byte, error) { return append([]byte("v:"), r...), nil })
		if err != nil || string(got) != "receipt" {
			t.Fatalf("HandleComplete: %q, %v", got, err)
		}
		if n := srv.count(t, id); n != 1 {
			t.Fatalf("effect applied %d times, want 1", n)
		}
		done, err := s.Acquire(ctx, lock.Request{Key: "op-1"})
		if err != nil || done.Status != lock.Completed || string(done.Value) != "v:receipt" {
			t.Fatalf("record after the transaction: %+v, %v", done, err)
		}
		// The same lease again: its record is completed already.
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same); err != nil {
			t.Fatalf("HandleComplete resent after it committed: %v, want nil (its own completion)", err)
		}
		if n := srv.count(t, id); n != 1 {
			t.Fatalf("a resent transaction applied the effect again: %d", n)
		}
	})
}

func TestTxHandlerLeaseLostWritesNothing(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		stale, err := s.Acquire(ctx, lock.Request{Key: "op", TTL: 30 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(80 * time.Millisecond)
		cur, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil || cur.Status != lock.Acquired {
			t.Fatalf("takeover: %+v, %v", cur, err)
		}
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, table, id)
			return nil, nil
		}))
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, stale.Lease, same); !errors.Is(err, lock.ErrLeaseLost) {
			t.Fatalf("HandleComplete by a stale lease: got %v, want ErrLeaseLost", err)
		}
		if n := srv.count(t, id); n != 0 {
			t.Fatalf("a stale lease's effect applied %d times, want 0", n)
		}
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, cur.Lease, same); err != nil {
			t.Fatalf("HandleComplete by the current lease: %v", err)
		}
		if n := srv.count(t, id); n != 1 {
			t.Fatalf("effect applied %d times, want 1", n)
		}
	})
}

func TestTxHandlerConditionFailed(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		res, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil {
			t.Fatal(err)
		}
		var hook bool
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, table, id)
			tx.ConditionCheck(&types.ConditionCheck{
				TableName:                           aws.String(table),
				Key:                                 map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: id + "-account"}},
				ConditionExpression:                 aws.String("attribute_exists(id)"),
				ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
			})
			if hook {
				tx.OnConditionFailed = func(i int, item map[string]types.AttributeValue) error {
					return amqpidem.Permanent(fmt.Errorf("no account (item %d, %d attributes)", i, len(item)))
				}
			}
			return nil, nil
		}))
		_, err = h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same)
		if !errors.Is(err, dynamostore.ErrConditionFailed) || !strings.Contains(err.Error(), "item 1") || amqpidem.IsPermanent(err) {
			t.Fatalf("a failed condition: got %v, want ErrConditionFailed naming item 1, retryable", err)
		}
		hook = true
		_, err = h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same)
		if !amqpidem.IsPermanent(err) || !strings.Contains(err.Error(), "no account (item 1") {
			t.Fatalf("a failed condition with OnConditionFailed: got %v, want its permanent error", err)
		}
		if n := srv.count(t, id); n != 0 {
			t.Fatalf("a cancelled transaction's effect applied %d times, want 0", n)
		}
		busy, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil || busy.Status != lock.InProgress {
			t.Fatalf("record after a cancelled transaction: %+v, %v; want still in progress", busy, err)
		}
	})
}

// TestTxHandlerConditionFailedNilAnswer: an OnConditionFailed that answers
// nil (as if "already applied" were success) still fails the completion:
// nothing was written, the record is still in progress, and a nil error
// would make amqpidem ack the message as completed, then run it again
// once the lease expires.
func TestTxHandlerConditionFailedNilAnswer(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		res, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil {
			t.Fatal(err)
		}
		var calls int
		h := s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, table, id)
			tx.ConditionCheck(&types.ConditionCheck{
				TableName:           aws.String(table),
				Key:                 map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: id + "-applied"}},
				ConditionExpression: aws.String("attribute_exists(id)"),
			})
			tx.OnConditionFailed = func(int, map[string]types.AttributeValue) error {
				calls++
				return nil // "already applied": not an error, the handler thinks
			}
			return []byte("r"), nil
		})
		got, err := completer(t, h).HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same)
		if !errors.Is(err, dynamostore.ErrConditionFailed) || got != nil {
			t.Fatalf("HandleComplete with OnConditionFailed answering nil: got %q, %v; want ErrConditionFailed", got, err)
		}
		if got, want := calls, 1; got != want {
			t.Fatalf("OnConditionFailed calls: got %d, want %d", got, want)
		}
		if busy, err := s.Acquire(ctx, lock.Request{Key: "op"}); err != nil || busy.Status != lock.InProgress {
			t.Fatalf("record after the cancelled transaction: %+v, %v; want still in progress", busy, err)
		}
		// Without a record (amqpidem.ProcessMissingKey) the same.
		if got, err := h.Handle(ctx, &amqp.Delivery{}); !errors.Is(err, dynamostore.ErrConditionFailed) || got != nil {
			t.Fatalf("Handle with OnConditionFailed answering nil: got %q, %v; want ErrConditionFailed", got, err)
		}
		if n := srv.count(t, id); n != 0 {
			t.Fatalf("a cancelled transaction's effect applied %d times, want 0", n)
		}
	})
}

func TestTxHandlerRefusedBeforeSending(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{Config: lock.Config{MaxResultSize: 10}})
		table, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		res, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil {
			t.Fatal(err)
		}
		items, result := 0, []byte("small")
		boom := errors.New("boom")
		var fnErr error
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			for i := range items {
				bump(tx, table, fmt.Sprint(id, "-", i))
			}
			return result, fnErr
		}))
		for _, tc := range []struct {
			name   string
			items  int
			result string
			fnErr  error
			want   error
		}{
			{"handler error", 1, "small", boom, boom},
			{"too many items", dynamostore.MaxTxItems, "small", nil, dynamostore.ErrTxTooLarge},
			{"result too large", 1, "larger than ten", nil, lock.ErrResultTooLarge},
		} {
			items, result, fnErr = tc.items, []byte(tc.result), tc.fnErr
			_, err := h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same)
			if !errors.Is(err, tc.want) {
				t.Fatalf("%s: got %v, want %v", tc.name, err, tc.want)
			}
			// Too many items would be too many on every retry.
			if errors.Is(tc.want, dynamostore.ErrTxTooLarge) && !amqpidem.IsPermanent(err) {
				t.Fatalf("%s: %v is not Permanent: retried MaxAttempts times before its dead letter", tc.name, err)
			}
			if n := srv.count(t, id+"-0"); n != 0 {
				t.Fatalf("%s: effect applied %d times, want 0", tc.name, n)
			}
		}
		// The most a handler may add, with the record's completion.
		items, result, fnErr = dynamostore.MaxTxItems-1, []byte("ok"), nil
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same); err != nil {
			t.Fatalf("%d items and the record: %v", items, err)
		}
		if n := srv.count(t, fmt.Sprint(id, "-", items-1)); n != 1 {
			t.Fatalf("the last item's effect applied %d times, want 1", n)
		}
	})
}

func TestTxHandlerUnkeyed(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, id := srv.effects(t), testenv.Name(t)
		h := s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, table, id)
			return []byte("r"), nil
		})
		for range 2 {
			if got, err := h.Handle(context.Background(), &amqp.Delivery{}); err != nil || string(got) != "r" {
				t.Fatalf("Handle: %q, %v", got, err)
			}
		}
		if n := srv.count(t, id); n != 2 {
			t.Fatalf("without a record, effect applied %d times, want 2 (once per call)", n)
		}
	})
}

// cancelling answers every TransactWriteItems with a cancellation whose
// reasons are codes, in order, and every GetItem with getErr when set.
type cancelling struct {
	dynamostore.Client
	codes  []string
	getErr error
}

func (c *cancelling) GetItem(ctx context.Context, in *dynamodb.GetItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.GetItemOutput, error) {
	if c.getErr != nil {
		return nil, c.getErr
	}
	return c.Client.GetItem(ctx, in, opts...)
}

func (c *cancelling) TransactWriteItems(ctx context.Context, in *dynamodb.TransactWriteItemsInput, opts ...func(*dynamodb.Options)) (*dynamodb.TransactWriteItemsOutput, error) {
	e := &types.TransactionCanceledException{Message: aws.String("Transaction cancelled")}
	for _, code := range c.codes {
		e.CancellationReasons = append(e.CancellationReasons, types.CancellationReason{Code: aws.String(code)})
	}
	return nil, e
}

func TestTxHandlerCancellationReasons(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		client, table := srv.sharedTable(t)
		fake := &cancelling{Client: client}
		s, err := dynamostore.New(fake, dynamostore.Config{Table: table, Config: lock.Config{Prefix: testenv.Name(t)}})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		res, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil {
			t.Fatal(err)
		}
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, srv.effects(t), "x")
			return nil, nil
		}))
		for _, tc := range []struct {
			codes []string
			want  error
		}{
			{[]string{"TransactionConflict", "None"}, lock.ErrUnavailable},
			{[]string{"None", "TransactionConflict"}, lock.ErrUnavailable},
			{[]string{"ThrottlingError", "None"}, lock.ErrUnavailable},
			{[]string{"ProvisionedThroughputExceeded", "None"}, lock.ErrUnavailable},
			{[]string{"ConditionalCheckFailed", "None"}, dynamostore.ErrConditionFailed},
			{[]string{"ConditionalCheckFailed", "ConditionalCheckFailed"}, lock.ErrLeaseLost},
			{[]string{"None", "ConditionalCheckFailed"}, lock.ErrLeaseLost},
		} {
			fake.codes = tc.codes
			if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same); !errors.Is(err, tc.want) {
				t.Fatalf("reasons %v: got %v, want %v", tc.codes, err, tc.want)
			}
		}
		// An item's condition failed; whether the lease still holds cannot
		// be read: unavailable, not the item's error.
		fake.codes, fake.getErr = []string{"ConditionalCheckFailed", "None"}, &types.ProvisionedThroughputExceededException{Message: aws.String("slow down")}
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same); !errors.Is(err, lock.ErrUnavailable) || errors.Is(err, dynamostore.ErrConditionFailed) {
			t.Fatalf("reasons [ConditionalCheckFailed None], the record unreadable: got %v, want ErrUnavailable", err)
		}
		fake.getErr = nil
		fake.codes = []string{"ValidationError", "None"}
		_, err = h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same)
		if err == nil || errors.Is(err, lock.ErrUnavailable) || errors.Is(err, lock.ErrLeaseLost) || !strings.Contains(err.Error(), "ValidationError") {
			t.Fatalf("reasons [ValidationError None]: got %v, want the handler's error naming it", err)
		}
	})
}

// answerLost sends every TransactWriteItems, then loses its answer.
type answerLost struct{ dynamostore.Client }

func (a *answerLost) TransactWriteItems(ctx context.Context, in *dynamodb.TransactWriteItemsInput, opts ...func(*dynamodb.Options)) (*dynamodb.TransactWriteItemsOutput, error) {
	if _, err := a.Client.TransactWriteItems(ctx, in, opts...); err != nil {
		return nil, err
	}
	return nil, &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer")}
}

// TestTxHandlerAnswerLost: a transaction that committed but whose answer
// was lost is lock.ErrUnavailable, and the record then says it committed:
// the redelivery is a duplicate, and the effect was applied once.
func TestTxHandlerAnswerLost(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		client, table := srv.sharedTable(t)
		s, err := dynamostore.New(&answerLost{client}, dynamostore.Config{Table: table, Config: lock.Config{Prefix: testenv.Name(t)}})
		if err != nil {
			t.Fatal(err)
		}
		effectTable, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		res, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil {
			t.Fatal(err)
		}
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, effectTable, id)
			return []byte("r"), nil
		}))
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same); !errors.Is(err, lock.ErrUnavailable) {
			t.Fatalf("HandleComplete whose answer was lost: got %v, want ErrUnavailable", err)
		}
		if got, err := s.Acquire(ctx, lock.Request{Key: "op"}); err != nil || got.Status != lock.Completed || string(got.Value) != "r" {
			t.Fatalf("the redelivery: %+v, %v; want a duplicate of the committed result", got, err)
		}
		if n := srv.count(t, id); n != 1 {
			t.Fatalf("effect applied %d times, want 1", n)
		}
	})
}

// TestTxHandlerRefusedTransaction: a transaction DynamoDB refuses as such
// (two writes of one item: a ValidationException) wrote nothing, and its
// error says so: not "outcome may be unknown", not lock.ErrUnavailable.
func TestTxHandlerRefusedTransaction(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		res, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil {
			t.Fatal(err)
		}
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			bump(tx, table, id)
			bump(tx, table, id)
			return nil, nil
		}))
		_, err = h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same)
		if err == nil || errors.Is(err, lock.ErrUnavailable) || errors.Is(err, lock.ErrLeaseLost) ||
			strings.Contains(err.Error(), "may be unknown") || !strings.Contains(err.Error(), "refused") ||
			!strings.Contains(err.Error(), "ValidationException") {
			t.Fatalf("a transaction writing one item twice: got %v, want a refusal naming the ValidationException", err)
		}
		if n := srv.count(t, id); n != 0 {
			t.Fatalf("a refused transaction's effect applied %d times, want 0", n)
		}
		if busy, err := s.Acquire(ctx, lock.Request{Key: "op"}); err != nil || busy.Status != lock.InProgress {
			t.Fatalf("record after a refused transaction: %+v, %v; want still in progress", busy, err)
		}
	})
}

// TestTxHandlerStaleLeaseBeforeItemCondition: when a stale lease's
// transaction fails on the record's condition and on an item's (the new
// owner applied the effect already), the error is lock.ErrLeaseLost and
// OnConditionFailed is not asked: the record decides first, whether the
// server reports every failed condition (DynamoDB Local) or the first
// only (minidyn).
func TestTxHandlerStaleLeaseBeforeItemCondition(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		s := srv.newStore(t, dynamostore.Config{})
		table, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		stale, err := s.Acquire(ctx, lock.Request{Key: "op", TTL: 30 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(80 * time.Millisecond)
		cur, err := s.Acquire(ctx, lock.Request{Key: "op"})
		if err != nil || cur.Status != lock.Acquired {
			t.Fatalf("takeover: %+v, %v", cur, err)
		}
		var asked int
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			tx.Put(&types.Put{
				TableName:           aws.String(table),
				Item:                map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: id}},
				ConditionExpression: aws.String("attribute_not_exists(id)"),
			})
			tx.OnConditionFailed = func(int, map[string]types.AttributeValue) error {
				asked++
				return amqpidem.Permanent(errors.New("already paid"))
			}
			return nil, nil
		}))
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, cur.Lease, same); err != nil {
			t.Fatalf("HandleComplete by the current lease: %v", err)
		}
		_, err = h.HandleComplete(ctx, &amqp.Delivery{}, stale.Lease, same)
		if !errors.Is(err, lock.ErrLeaseLost) || amqpidem.IsPermanent(err) {
			t.Fatalf("HandleComplete by the stale lease: got %v, want ErrLeaseLost", err)
		}
		if asked != 0 {
			t.Fatalf("OnConditionFailed asked %d times for a stale lease, want 0", asked)
		}
		// A lease still held whose item condition fails gets the hook's error.
		again, err := s.Acquire(ctx, lock.Request{Key: "op2"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, again.Lease, same); !amqpidem.IsPermanent(err) || asked != 1 {
			t.Fatalf("HandleComplete by a held lease whose item condition fails: got %v (hook asked %d times), want the hook's error", err, asked)
		}
	})
}

// TestTxHandlerSizeLimits: on a server that enforces DynamoDB's limits,
// the largest record (MaxResultSizeLimit bytes of result, the longest
// prefix, key and fingerprint) fits in an item, completed by Complete or
// in a transaction, and a transaction over MaxTxBytes is refused whole.
func TestTxHandlerSizeLimits(t *testing.T) {
	eachServer(t, func(t *testing.T, srv *server) {
		if !srv.Strict {
			t.Skipf("%s enforces no size limit: it takes items over 400 KB and transactions over 4 MB", srv.Name)
		}
		prefix := strings.Repeat("p", 64-len(testenv.Name(t))) + testenv.Name(t)
		s := srv.newStore(t, dynamostore.Config{Config: lock.Config{Prefix: prefix, MaxResultSize: dynamostore.MaxResultSizeLimit}})
		table, id := srv.effects(t), testenv.Name(t)
		ctx := context.Background()
		big := []byte(strings.Repeat("r", dynamostore.MaxResultSizeLimit))
		fp := strings.Repeat("f", lock.MaxFingerprintLen)
		key := func(c byte) string { return strings.Repeat(string(c), lock.MaxKeyLen) }

		res, err := s.Acquire(ctx, lock.Request{Key: key('a'), Fingerprint: fp})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, res.Lease, big); err != nil {
			t.Fatalf("Complete with the largest result: %v", err)
		}
		if rec, err := s.Inspect(ctx, key('a')); err != nil || len(rec.Value) != len(big) {
			t.Fatalf("Inspect of the largest record: %d bytes, %v", len(rec.Value), err)
		}
		if err := s.Amend(ctx, key('a'), res.Lease.Fence, big, append(big[:len(big)-1:len(big)-1], 's')); err != nil {
			t.Fatalf("Amend with the largest value: %v", err)
		}
		res, err = s.Acquire(ctx, lock.Request{Key: key('b'), Fingerprint: fp})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Fail(ctx, res.Lease, string(big)+"and more"); err != nil {
			t.Fatalf("Fail with the longest reason: %v", err)
		}

		var items, itemSize int
		h := completer(t, s.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
			for i := range items {
				tx.Put(&types.Put{TableName: aws.String(table), Item: map[string]types.AttributeValue{
					"id": &types.AttributeValueMemberS{Value: fmt.Sprint(id, "-", i)},
					"x":  &types.AttributeValueMemberS{Value: strings.Repeat("x", itemSize)},
				}})
			}
			return big, nil
		}))
		res, err = s.Acquire(ctx, lock.Request{Key: key('c'), Fingerprint: fp})
		if err != nil {
			t.Fatal(err)
		}
		// The record's completion with the largest result, and 3 MB more.
		items, itemSize = 8, 384<<10
		if _, err := h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same); err != nil {
			t.Fatalf("a transaction of %d KB: %v", (items*itemSize+len(big))>>10, err)
		}
		res, err = s.Acquire(ctx, lock.Request{Key: key('d'), Fingerprint: fp})
		if err != nil {
			t.Fatal(err)
		}
		items = 10 // over 4 MB with the record
		_, err = h.HandleComplete(ctx, &amqp.Delivery{}, res.Lease, same)
		if err == nil || errors.Is(err, lock.ErrUnavailable) || strings.Contains(err.Error(), "may be unknown") || !strings.Contains(err.Error(), "refused") {
			t.Fatalf("a transaction of %d KB: got %v, want a refusal", (items*itemSize+len(big))>>10, err)
		}
		if busy, err := s.Acquire(ctx, lock.Request{Key: key('d')}); err != nil || busy.Status != lock.InProgress {
			t.Fatalf("record after a refused transaction: %+v, %v; want still in progress", busy, err)
		}
	})
}
