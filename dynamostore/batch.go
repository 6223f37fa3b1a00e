package dynamostore

import (
	"context"
	"errors"
	"fmt"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// BatchTxFunc does the work of a batch's messages, adding its writes to
// tx, and answers per message as amqpidem.BatchHandler does: nil for every
// message done with no result, or one amqpidem.BatchResult per delivery
// of ds, in order; a non-nil error is the whole batch's (nothing is sent,
// and amqpidem splits the batch). A message answered with an error may
// have added writes to tx before it failed: they are never sent. When
// some messages of a batch fail and others succeed, and tx holds writes,
// fn runs again on those that succeeded, with a new Tx, until a run's
// messages all succeed; only that run's writes are sent, with their
// records.
type BatchTxFunc func(ctx context.Context, tx *Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error)

// BatchTxHandler returns a batch handler (amqpidem.NewBatchConsumer) that
// runs fn on a batch, then sends the writes fn added to its Tx together
// with the completion of the record of every message fn answered without
// an error (each conditional on its lease, as TxHandler's), in one
// TransactWriteItems: the batch's writes and records commit together, or
// not at all.
//
// A batch of more than one message whose writes and records exceed
// MaxTxItems, or whose attribute values and keys add up to more than
// MaxTxBytes, is a batch error wrapping ErrTxTooLarge, nothing sent:
// amqpidem splits it in halves, each run again, until they fit, and no
// message of it is refused or counts an attempt for it (a single message
// whose writes do not fit with its record fails, Permanent, as with
// TxHandler; a
// batch that DynamoDB refuses as over 4 MB on its own reckoning, which
// counts the whole items an update leaves, is split the same way). Set
// ConsumerConfig.BatchSize to what fits (MaxTxItems over the items per
// message plus one, and 4 MB over the bytes per message) to spare the
// splits, each of which runs fn again on the halves. Otherwise a transaction that
// does not commit becomes what TxHandler says, for the whole batch: a
// record's condition failed (a lease lost) is a batch error wrapping
// lock.ErrLeaseLost, a condition of fn's items one wrapping
// ErrConditionFailed (or OnConditionFailed's), both with nothing written
// and the batch split to find the message at fault; a conflict,
// throttling or an answer that never came wraps lock.ErrUnavailable, and
// every message of the batch is requeued, never run again in place.
//
// The batch consumer takes the batch's leases with AcquireBatch (up to
// MaxTxItems keys in one TransactWriteItems), before the batch runs. The returned handler implements amqpidem.BatchCompleter. A
// message processed without a lease runs fn as a batch of one, its writes
// sent with no record.
func (s *Store) BatchTxHandler(fn BatchTxFunc) amqpidem.BatchHandler {
	return &batchTxHandler{s: s, fn: fn, tx: &txHandler{s: s}}
}

// batchTxHandler is what BatchTxHandler returns.
type batchTxHandler struct {
	s  *Store
	fn BatchTxFunc
	tx *txHandler // its commit
}

var _ amqpidem.BatchCompleter = (*batchTxHandler)(nil)

// CompleterStore returns the Store the handler writes records to.
func (h *batchTxHandler) CompleterStore() lock.Store { return h.s }

// HandleBatch runs fn and sends its writes, with no records, unless some
// messages failed: as with records, their writes are never sent, and the
// others run again without them.
func (h *batchTxHandler) HandleBatch(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
	var tx Tx
	rs, err := h.run(ctx, &tx, ds)
	if err != nil || tx.Len() == 0 {
		return rs, err
	}
	var ok []int
	for i := range rs {
		if rs[i].Err == nil {
			ok = append(ok, i)
		}
	}
	if rs != nil && len(ok) < len(ds) {
		// Some messages failed after fn added writes to its Tx, which may
		// be theirs: nothing is sent, and the others run again without
		// them (see BatchTxFunc), staging afresh.
		if len(ok) == 0 {
			return rs, nil
		}
		amqpidem.DiscardStaged(ctx)
		sub := make([]*amqp.Delivery, len(ok))
		for j, i := range ok {
			sub[j] = ds[i]
		}
		srs, err := h.HandleBatch(ctx, sub)
		if err != nil {
			return nil, err
		}
		rs = append([]amqpidem.BatchResult(nil), rs...)
		for j, i := range ok {
			rs[i] = srs[j]
		}
		return rs, nil
	}
	if tx.Len() > MaxTxItems {
		return nil, amqpidem.Permanent(fmt.Errorf("%w: %d items, at most %d", ErrTxTooLarge, tx.Len(), MaxTxItems))
	}
	if err := h.tx.commit(ctx, &tx, nil, lock.Lease{}, 0); err != nil {
		return nil, err
	}
	return rs, nil
}

// run runs fn on ds and checks its answer's length.
func (h *batchTxHandler) run(ctx context.Context, tx *Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
	rs, err := h.fn(ctx, tx, ds)
	if err == nil && rs != nil && len(rs) != len(ds) {
		err = fmt.Errorf("dynamostore: the batch function returned %d results for %d messages", len(rs), len(ds))
	}
	return rs, err
}

// HandleBatchComplete runs fn on the items' deliveries, then sends its
// writes and the completions of the records of the messages done in one
// TransactWriteItems (see BatchTxHandler).
func (h *batchTxHandler) HandleBatchComplete(ctx context.Context, items []amqpidem.BatchItem, value func(int, []byte) ([]byte, error)) ([]amqpidem.BatchResult, error) {
	rs, ok, err := h.complete(ctx, items, value)
	if err != nil || ok == nil {
		return rs, err
	}
	// Some messages failed after fn added writes to its Tx, which may be
	// theirs: run the others again, without them (see BatchTxFunc),
	// staging afresh (what this run staged is not stored).
	amqpidem.DiscardStaged(ctx)
	sub := make([]amqpidem.BatchItem, len(ok))
	for j, i := range ok {
		sub[j] = items[i]
	}
	srs, err := h.HandleBatchComplete(ctx, sub, func(j int, result []byte) ([]byte, error) { return value(ok[j], result) })
	if err != nil {
		return nil, err // the rest failed as a batch: amqpidem splits it all
	}
	for j, i := range ok {
		rs[i] = srs[j]
	}
	return rs, nil
}

// complete runs fn on the items' deliveries and sends its writes with the
// records of the messages done, as HandleBatchComplete says; unless some
// messages failed and others did not while fn's Tx holds writes: then it
// sends nothing and returns in ok the messages to run again.
func (h *batchTxHandler) complete(ctx context.Context, items []amqpidem.BatchItem, value func(int, []byte) ([]byte, error)) (rs []amqpidem.BatchResult, ok []int, err error) {
	ds := make([]*amqp.Delivery, len(items))
	for i, it := range items {
		if err := lock.CheckLease(it.Lease); err != nil {
			return nil, nil, err
		}
		ds[i] = it.Delivery
	}
	var tx Tx
	rs, err = h.run(ctx, &tx, ds)
	if err != nil {
		return nil, nil, err
	}
	if rs == nil {
		rs = make([]amqpidem.BatchResult, len(ds))
	} else {
		rs = append([]amqpidem.BatchResult(nil), rs...)
	}
	_, nowMs := h.s.now()
	var records []types.TransactWriteItem
	var leases []lock.Lease
	var done []int
	for i := range rs {
		if rs[i].Err != nil {
			continue
		}
		lease := items[i].Lease
		v, err := value(i, rs[i].Result)
		if err == nil && len(v) > h.s.cfg.MaxResultSize {
			err = fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", lock.ErrResultTooLarge, lease.Key, len(v), h.s.cfg.MaxResultSize)
		}
		if err != nil {
			rs[i] = amqpidem.BatchResult{Err: err}
			continue
		}
		u := h.s.finishWrite(lease, stateCompleted, v, nowMs)
		records = append(records, types.TransactWriteItem{Update: &types.Update{
			TableName:                           aws.String(h.s.cfg.Table),
			Key:                                 keyAttr(h.s.cfg.Prefix, lease.Key),
			UpdateExpression:                    aws.String("SET " + u.set),
			ConditionExpression:                 aws.String(leaseCond),
			ExpressionAttributeNames:            u.names,
			ExpressionAttributeValues:           u.values,
			ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
		}})
		leases = append(leases, lease)
		done = append(done, i)
	}
	switch n := tx.Len() + len(records); {
	case len(records) == 0:
		return rs, nil, nil // nothing done: fn's writes are for none of them
	case len(records) < len(ds) && tx.Len() > 0:
		return rs, done, nil // the failed ones' writes may be in tx
	case n > MaxTxItems:
		return nil, nil, amqpidem.Permanent(fmt.Errorf("%w: %d items and %d records, at most %d in all", ErrTxTooLarge, tx.Len(), len(records), MaxTxItems))
	case len(records) > 1:
		if size := txSize(tx.items) + txSize(records); size > MaxTxBytes {
			return nil, nil, amqpidem.Permanent(fmt.Errorf("%w: %d items and %d records of about %d bytes, at most %d in all", ErrTxTooLarge, tx.Len(), len(records), size, MaxTxBytes))
		}
	}
	return rs, nil, h.commitBatch(ctx, &tx, records, leases)
}

// commitBatch sends tx's items and the records' completions after them in
// one TransactWriteItems, and says what its failure means for the batch.
func (h *batchTxHandler) commitBatch(ctx context.Context, tx *Tx, records []types.TransactWriteItem, leases []lock.Lease) error {
	all := append(tx.items[:len(tx.items):len(tx.items)], records...)
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	_, err := h.s.client.TransactWriteItems(cctx, &dynamodb.TransactWriteItemsInput{TransactItems: all})
	if err == nil {
		return nil
	}
	var tce *types.TransactionCanceledException
	if !errors.As(err, &tce) {
		if refusedWhole(err) {
			return fmt.Errorf("dynamostore: batch transaction refused, nothing written: %w", classify(err))
		}
		// Whatever the error, it may have been written: said as
		// lock.ErrUnavailable, so that the batch is not run again.
		return fmt.Errorf("%w: dynamostore: batch transaction (its outcome may be unknown: the records tell): %w", lock.ErrUnavailable, classify(err))
	}
	reasons := tce.CancellationReasons
	if len(reasons) == len(all) {
		for j, r := range reasons[tx.Len():] {
			if aws.ToString(r.Code) == "ConditionalCheckFailed" {
				l := leases[j]
				return fmt.Errorf("%w: complete key %q fence %d in a batch: nothing written", lock.ErrLeaseLost, l.Key, l.Fence)
			}
		}
	}
	var unavailable []string
	for i, r := range reasons {
		code := aws.ToString(r.Code)
		switch {
		case code == "" || code == "None":
		case code == "ConditionalCheckFailed" && i < tx.Len():
			if tx.OnConditionFailed != nil {
				if err := tx.OnConditionFailed(i, r.Item); err != nil {
					return err
				}
			}
			return fmt.Errorf("%w: item %d: %s (the batch did not commit)", ErrConditionFailed, i, aws.ToString(r.Message))
		case transientCancel(code):
			unavailable = append(unavailable, fmt.Sprintf("item %d: %s", i, code))
		default:
			return fmt.Errorf("dynamostore: batch transaction refused: item %d: %s: %s: %w", i, code, aws.ToString(r.Message), err)
		}
	}
	if len(unavailable) > 0 {
		return fmt.Errorf("%w: batch transaction cancelled (%v): %w", lock.ErrUnavailable, unavailable, err)
	}
	return fmt.Errorf("dynamostore: batch transaction cancelled: %w", classify(err))
}

// txSize is about the bytes items add to a transaction: their keys, a
// Put's item, and the values an Update or a ConditionCheck carries (its
// condition's operands among them), as DynamoDB sizes attributes. It
// leaves out what an Update keeps of the item it changes, which DynamoDB
// counts too.
func txSize(items []types.TransactWriteItem) int {
	n := 0
	for _, it := range items {
		switch {
		case it.Put != nil:
			n += attrsSize(it.Put.Item) + attrsSize(it.Put.ExpressionAttributeValues)
		case it.Update != nil:
			n += attrsSize(it.Update.Key) + attrsSize(it.Update.ExpressionAttributeValues)
		case it.Delete != nil:
			n += attrsSize(it.Delete.Key) + attrsSize(it.Delete.ExpressionAttributeValues)
		case it.ConditionCheck != nil:
			n += attrsSize(it.ConditionCheck.Key) + attrsSize(it.ConditionCheck.ExpressionAttributeValues)
		}
	}
	return n
}

// attrsSize is the size of the attributes m, names and values.
func attrsSize(m map[string]types.AttributeValue) int {
	n := 0
	for k, v := range m {
		n += len(k) + attrSize(v)
	}
	return n
}

// attrSize is the size of one attribute value.
func attrSize(v types.AttributeValue) int {
	switch v := v.(type) {
	case *types.AttributeValueMemberS:
		return len(v.Value)
	case *types.AttributeValueMemberB:
		return len(v.Value)
	case *types.AttributeValueMemberN:
		return len(v.Value)
	case *types.AttributeValueMemberSS:
		n := 0
		for _, s := range v.Value {
			n += len(s)
		}
		return n
	case *types.AttributeValueMemberNS:
		n := 0
		for _, s := range v.Value {
			n += len(s)
		}
		return n
	case *types.AttributeValueMemberBS:
		n := 0
		for _, b := range v.Value {
			n += len(b)
		}
		return n
	case *types.AttributeValueMemberL:
		n := 3
		for _, e := range v.Value {
			n += 1 + attrSize(e)
		}
		return n
	case *types.AttributeValueMemberM:
		return 3 + attrsSize(v.Value) + len(v.Value)
	}
	return 1 // BOOL, NULL
}
