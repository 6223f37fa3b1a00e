package dynamostore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// Limits of one TransactWriteItems, as DynamoDB sets them.
const (
	// MaxTxItems is the most items one transaction takes. TxHandler adds
	// the record's completion to the handler's items, so a handler may add
	// MaxTxItems-1 of its own.
	MaxTxItems = 100
	// MaxTxBytes is the most bytes the items of one transaction may add up
	// to (4 MB), the record's completion (its result) included. DynamoDB
	// refuses a larger transaction whole (a ValidationException): the
	// handler's error, every time the message runs.
	MaxTxBytes = 4 << 20
)

var (
	// ErrTxTooLarge means a handler added more than MaxTxItems-1 items to
	// its Tx (with a batch: more than its messages' records leave room
	// for, or more than MaxTxBytes). Nothing was written. For one message
	// the error is Permanent: the same work would not fit on a retry.
	ErrTxTooLarge = errors.New("dynamostore: transaction too large")
	// ErrConditionFailed means the condition of an item the handler added
	// failed, so DynamoDB cancelled the transaction: nothing was written,
	// the record's completion neither.
	ErrConditionFailed = errors.New("dynamostore: transaction condition failed")
)

// Tx collects the writes of one execution of a TxFunc, for TxHandler to
// send with the record's completion. Each write is one item of the
// TransactWriteItems, in the order added. An item may name any table of
// the Store's account and region, but not the record's own item, and no
// two items may write the same item (DynamoDB refuses the transaction).
//
// A Tx is not safe for concurrent use.
type Tx struct {
	// OnConditionFailed, when not nil, makes the handler's error when the
	// condition of one of the added items failed and DynamoDB cancelled
	// the transaction: index is its position among the added items (0 for
	// the first), item the item as it was, when that write asked for it
	// with ReturnValuesOnConditionCheckFailure. Wrap the error with
	// amqpidem.Permanent to fail the message for good. The field nil: an
	// error wrapping ErrConditionFailed, which amqpidem retries as any
	// handler error.
	//
	// The transaction was cancelled whatever OnConditionFailed answers:
	// nothing was written, the record's completion neither. So an answer of
	// nil (as in "already applied, nothing to do") does not make the
	// message a success: the error is then one wrapping ErrConditionFailed,
	// as without the field. A message whose effect may already be there
	// should say so in its condition's place: read the item in fn and add
	// no write for it (the record then commits alone), or answer
	// amqpidem.Permanent.
	OnConditionFailed func(index int, item map[string]types.AttributeValue) error

	items []types.TransactWriteItem
}

// Put adds a PutItem to the transaction.
func (tx *Tx) Put(p *types.Put) { tx.items = append(tx.items, types.TransactWriteItem{Put: p}) }

// Update adds an UpdateItem to the transaction.
func (tx *Tx) Update(u *types.Update) {
	tx.items = append(tx.items, types.TransactWriteItem{Update: u})
}

// Delete adds a DeleteItem to the transaction.
func (tx *Tx) Delete(d *types.Delete) {
	tx.items = append(tx.items, types.TransactWriteItem{Delete: d})
}

// ConditionCheck adds a condition on an item that the transaction does
// not write.
func (tx *Tx) ConditionCheck(c *types.ConditionCheck) {
	tx.items = append(tx.items, types.TransactWriteItem{ConditionCheck: c})
}

// Len is the number of items added.
func (tx *Tx) Len() int { return len(tx.items) }

// TxFunc does the work of one message: it reads what it needs (with the
// client of its choice) and adds its writes to tx, then returns the result
// to store (and to send to ReplyTo) or an error, as amqpidem.Handler does.
// Its writes are sent after it returns, only if it returns no error. ctx
// is the handler's context (cancelled when the lease is lost, with
// amqpidem.FromContext giving the key, attempt and fence).
type TxFunc func(ctx context.Context, tx *Tx, d *amqp.Delivery) ([]byte, error)

// commitTimeout bounds the TransactWriteItems, which runs even when the
// handler's context was cancelled meanwhile: whether the work counts is
// the record's condition to decide, not the context's.
const commitTimeout = 10 * time.Second

// TxHandler returns a handler that runs fn, then sends the writes fn
// added to its Tx together with the completion of the message's record
// (conditional on the lease's owner and fence, the record in progress and
// not expired) in one TransactWriteItems: fn's writes and the record
// commit together or not at all. Give it to amqpidem.NewConsumer or
// amqpidem.Wrap with this Store. The SDK gives the request a
// ClientRequestToken, so that its own retries of it are idempotent.
//
// What a transaction that does not commit becomes:
//
//   - fn returns an error: nothing is sent, and the error is the
//     handler's, retried or dead-lettered as usual.
//   - The lease was lost meanwhile (another consumer took the key over
//     after it expired): the record's condition fails, DynamoDB cancels
//     the transaction, and the error wraps lock.ErrLeaseLost: the message
//     is requeued for the record to decide.
//   - The condition of an item fn added failed: cancelled, and the error
//     is Tx.OnConditionFailed's, by default (or when it answers nil) one
//     wrapping ErrConditionFailed. Never nil: nothing was written. The
//     record decides first: if the lease was lost as well, the error
//     wraps lock.ErrLeaseLost and OnConditionFailed is not called. (The
//     cancellation reasons say so when the server reports every failed
//     condition; otherwise one strongly consistent GetItem of the record
//     tells, and if it fails its error, lock.ErrUnavailable, is the
//     handler's.)
//   - A conflict with another transaction or write on one of the items
//     (TransactionConflict), throttling, or DynamoDB unavailable: the
//     error wraps lock.ErrUnavailable, and the message is requeued; its
//     redelivery finds the record still held, and runs again.
//   - An answer that never came (the connection broke): lock.ErrUnavailable
//     as well, and the redelivery finds the record completed (a duplicate,
//     acked) or still held (nothing was written, and it runs again).
//   - A transaction DynamoDB refuses as such: more than MaxTxItems items
//     (ErrTxTooLarge, before any request: Permanent, dead-lettered at
//     once), over MaxTxBytes, two writes of one item, an invalid
//     expression: the handler's error, every time (retried as usual).
//
// A message processed without a lease (amqpidem.ProcessMissingKey,
// FailOpen) sends fn's writes in a TransactWriteItems of their own, with no
// record.
//
// The returned handler implements amqpidem.Completer.
func (s *Store) TxHandler(fn TxFunc) amqpidem.Handler {
	return &txHandler{s: s, fn: fn}
}

// txHandler is what TxHandler returns.
type txHandler struct {
	s  *Store
	fn TxFunc
}

var _ amqpidem.Completer = (*txHandler)(nil)

// CompleterStore returns the Store the handler writes records to.
func (h *txHandler) CompleterStore() lock.Store { return h.s }

// Handle runs fn and sends its writes, with no record.
func (h *txHandler) Handle(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	var tx Tx
	result, err := h.fn(ctx, &tx, d)
	if err != nil {
		return nil, err
	}
	if tx.Len() == 0 {
		return result, nil
	}
	if tx.Len() > MaxTxItems {
		return nil, amqpidem.Permanent(fmt.Errorf("%w: %d items, at most %d", ErrTxTooLarge, tx.Len(), MaxTxItems))
	}
	if err := h.commit(ctx, &tx, nil, lock.Lease{}, 0); err != nil {
		return nil, err
	}
	return result, nil
}

// HandleComplete runs fn and sends its writes with the completion of
// lease's record with value(result).
func (h *txHandler) HandleComplete(ctx context.Context, d *amqp.Delivery, lease lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	if err := lock.CheckLease(lease); err != nil {
		return nil, err
	}
	var tx Tx
	result, err := h.fn(ctx, &tx, d)
	if err != nil {
		return nil, err
	}
	if tx.Len() > MaxTxItems-1 {
		return nil, amqpidem.Permanent(fmt.Errorf("%w: %d items and the record's, at most %d in all", ErrTxTooLarge, tx.Len(), MaxTxItems))
	}
	v, err := value(result)
	if err != nil {
		return nil, err
	}
	if len(v) > h.s.cfg.MaxResultSize {
		return nil, fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", lock.ErrResultTooLarge, lease.Key, len(v), h.s.cfg.MaxResultSize)
	}
	_, nowMs := h.s.now()
	u := h.s.finishWrite(lease, stateCompleted, v, nowMs)
	record := &types.Update{
		TableName:                           aws.String(h.s.cfg.Table),
		Key:                                 keyAttr(h.s.cfg.Prefix, lease.Key),
		UpdateExpression:                    aws.String("SET " + u.set),
		ConditionExpression:                 aws.String(leaseCond),
		ExpressionAttributeNames:            u.names,
		ExpressionAttributeValues:           u.values,
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
	}
	if err := h.commit(ctx, &tx, record, lease, nowMs); err != nil {
		return nil, err
	}
	return result, nil
}

// commit sends tx's items, and record's completion after them when record
// is not nil, in one TransactWriteItems, and says what its failure means.
func (h *txHandler) commit(ctx context.Context, tx *Tx, record *types.Update, lease lock.Lease, nowMs int64) error {
	items := tx.items
	if record != nil {
		items = append(items[:len(items):len(items)], types.TransactWriteItem{Update: record})
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	_, err := h.s.client.TransactWriteItems(cctx, &dynamodb.TransactWriteItemsInput{TransactItems: items})
	if err == nil {
		return nil
	}
	var tce *types.TransactionCanceledException
	if !errors.As(err, &tce) {
		if refusedWhole(err) {
			return fmt.Errorf("dynamostore: transaction refused, nothing written: %w", classify(err))
		}
		return fmt.Errorf("dynamostore: transaction (its outcome may be unknown: the record tells): %w", classify(err))
	}
	reasons := tce.CancellationReasons
	if record != nil && len(reasons) == len(items) {
		last := reasons[len(reasons)-1]
		if aws.ToString(last.Code) == "ConditionalCheckFailed" {
			// The record's condition failed: another owner, or an outcome.
			// Its own completion (a resent request that landed) is success.
			return h.s.refused(lease, "complete", stateCompleted, last.Item, nowMs)
		}
	}
	var unavailable []string
	for i, r := range reasons {
		code := aws.ToString(r.Code)
		switch {
		case code == "" || code == "None":
		case code == "ConditionalCheckFailed" && i < tx.Len():
			if record != nil {
				// The record decides first: a lost lease is lock.ErrLeaseLost
				// whatever fn's items say. DynamoDB reports every failed
				// condition, but a server may stop at the first (minidyn
				// does), leaving the record's reason "None".
				if err := h.stillHeld(cctx, lease, nowMs, i); err != nil {
					return err
				}
			}
			if tx.OnConditionFailed != nil {
				if err := tx.OnConditionFailed(i, r.Item); err != nil {
					return err
				}
				// Nothing was written, the record's completion neither: a
				// nil error would be acked as completed.
				return fmt.Errorf("%w: item %d: %s (OnConditionFailed answered nil; the transaction did not commit)", ErrConditionFailed, i, aws.ToString(r.Message))
			}
			return fmt.Errorf("%w: item %d: %s", ErrConditionFailed, i, aws.ToString(r.Message))
		case transientCancel(code):
			unavailable = append(unavailable, fmt.Sprintf("item %d: %s", i, code))
		default:
			return fmt.Errorf("dynamostore: transaction refused: item %d: %s: %s: %w", i, code, aws.ToString(r.Message), err)
		}
	}
	if len(unavailable) > 0 {
		return fmt.Errorf("%w: transaction cancelled (%v): %w", lock.ErrUnavailable, unavailable, err)
	}
	return fmt.Errorf("dynamostore: transaction cancelled: %w", classify(err))
}

// transientCancel reports whether code, an item's cancellation reason in a
// TransactionCanceledException, says DynamoDB could not take the
// transaction now (a conflict, throttling, an internal error), not that
// it refuses it: lock.ErrUnavailable.
func transientCancel(code string) bool {
	switch code {
	case "TransactionConflict", "ThrottlingError", "ProvisionedThroughputExceeded", "RequestLimitExceeded", "InternalServerError":
		return true
	}
	return false
}

// stillHeld reads lease's record (strongly consistent) after a transaction
// was cancelled on the condition of fn's item index, and returns nil if
// the record's own condition held: in progress under lease's owner and
// fence, not expired at nowMs. Else an error wrapping lock.ErrLeaseLost, or
// the read's error.
func (h *txHandler) stillHeld(ctx context.Context, lease lock.Lease, nowMs int64, index int) error {
	out, err := h.s.client.GetItem(ctx, &dynamodb.GetItemInput{
		TableName:      aws.String(h.s.cfg.Table),
		Key:            keyAttr(h.s.cfg.Prefix, lease.Key),
		ConsistentRead: aws.Bool(true),
	})
	if err != nil {
		return fmt.Errorf("dynamostore: the transaction was cancelled on the condition of item %d, and reading the record of %q to tell whether the lease still holds failed: %w",
			index, lease.Key, classify(err))
	}
	if out.Item != nil {
		if r, err := decode(lease.Key, out.Item); err == nil && !r.gone(nowMs) &&
			r.owner == lease.Owner && r.fence == lease.Fence && r.state == stateInProgress {
			return nil
		}
	}
	return fmt.Errorf("%w: complete key %q fence %d (the condition of item %d failed too)", lock.ErrLeaseLost, lease.Key, lease.Fence, index)
}
