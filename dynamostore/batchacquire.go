package dynamostore

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/lock"
)

// batchAcquireRounds bounds the transactions AcquireBatch sends for the
// keys of one chunk before it takes what is left one key at a time.
const batchAcquireRounds = 3

var _ lock.BatchAcquirer = (*Store)(nil)

// AcquireBatch takes the leases of reqs (lock.BatchAcquirer): each key's
// answer is Acquire's, decided on the same item by the same conditional
// write (compare-and-set on what was seen, the fence above the record's),
// but the writes of up to MaxTxItems keys go in one TransactWriteItems.
//
// The first transaction writes every key as new (the item must not
// exist). When it commits, that is the batch's one round trip. When some
// conditions fail, DynamoDB cancels it whole, and its answer holds the
// item each failed condition saw: those keys are decided on it as Acquire
// decides (a duplicate, a conflict, a key in progress need no write), and
// the keys still to take (those that were new, and the takeovers,
// compare-and-set on the item seen) go in a second transaction. So a batch
// of new keys costs one round trip, and a batch mixing new keys,
// duplicates and takeovers two, at most MaxTxItems keys a transaction.
// Keys still not decided after 3 transactions (their items changing under
// them, transaction conflicts, throttling), and every key of a
// transaction whose answer was an error (its outcome unknown), are taken
// one by one with Acquire's writes and retries, with the same owner
// tokens (a lease the lost transaction took is found and answered), at
// most Config.ExtendConcurrency at once. A key that comes twice in reqs
// is taken for its first request and then asked again with Acquire,
// which answers the second InProgress (DynamoDB refuses two writes of one
// item in a transaction).
//
// A transactional write costs twice the write capacity of an UpdateItem,
// and a cancelled transaction is charged too.
func (s *Store) AcquireBatch(ctx context.Context, reqs []lock.Request) ([]lock.Result, []error) {
	b := &acquireBatch{
		s:       s,
		reqs:    make([]lock.Request, len(reqs)),
		owners:  make([]string, len(reqs)),
		seen:    make([]map[string]types.AttributeValue, len(reqs)),
		results: make([]lock.Result, len(reqs)),
		errs:    make([]error, len(reqs)),
		sent:    make([]error, len(reqs)),
	}
	var pending, again []int
	keys := make(map[string]bool, len(reqs))
	for i := range reqs {
		req, err := s.cfg.CheckRequest(reqs[i])
		switch {
		case err != nil:
			b.errs[i] = err
			continue
		case keys[req.Key]:
			again = append(again, i)
		default:
			keys[req.Key] = true
			pending = append(pending, i)
		}
		b.reqs[i], b.owners[i] = req, lock.NewOwner()
	}
	var alone []int // to take one by one
	for len(pending) > 0 {
		n := min(len(pending), MaxTxItems)
		chunk := pending[:n]
		pending = pending[n:]
		for round := 0; len(chunk) > 0; round++ {
			if round == batchAcquireRounds {
				alone = append(alone, chunk...)
				break
			}
			var fail []int
			chunk, fail = b.send(ctx, chunk)
			alone = append(alone, fail...)
		}
	}
	b.oneByOne(ctx, alone)
	for _, i := range again {
		b.results[i], b.errs[i] = s.Acquire(ctx, b.reqs[i])
	}
	return b.results, b.errs
}

// acquireBatch is the state of one AcquireBatch.
type acquireBatch struct {
	s       *Store
	reqs    []lock.Request
	owners  []string                          // each request's owner token, kept across tries
	seen    []map[string]types.AttributeValue // the item last seen for each key (nil: none)
	results []lock.Result
	errs    []error
	sent    []error // the error of a transaction that may have taken the key's lease
}

// send decides the keys of chunk on the items seen and sends the writes of
// those still to take in one TransactWriteItems. It returns the keys to
// send again (the transaction was cancelled: they are decided on the items
// its failed conditions saw) and those to take one by one (it was
// cancelled with no reason per item, or its answer was another error,
// which b.sent then holds).
func (b *acquireBatch) send(ctx context.Context, chunk []int) (again, fail []int) {
	s := b.s
	var items []types.TransactWriteItem
	var steps []acquireStep
	var keys []int
	for _, i := range chunk {
		w, err := s.acquireWrite(b.reqs[i], b.owners[i], b.seen[i])
		switch {
		case err != nil:
			b.errs[i] = err
			continue
		case w.done:
			b.results[i] = w.res
			continue
		}
		items = append(items, types.TransactWriteItem{Update: &types.Update{
			TableName:                           aws.String(s.cfg.Table),
			Key:                                 keyAttr(s.cfg.Prefix, b.reqs[i].Key),
			UpdateExpression:                    aws.String("SET " + w.u.set),
			ConditionExpression:                 aws.String(w.cond),
			ExpressionAttributeNames:            w.u.names,
			ExpressionAttributeValues:           w.u.values,
			ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
		}})
		steps, keys = append(steps, w), append(keys, i)
	}
	if len(items) == 0 {
		return nil, nil
	}
	_, err := s.client.TransactWriteItems(ctx, &dynamodb.TransactWriteItemsInput{TransactItems: items})
	if err == nil {
		for j, i := range keys {
			b.results[i] = acquired(b.reqs[i], steps[j].next, steps[j].start)
		}
		return nil, nil
	}
	var tce *types.TransactionCanceledException
	if errors.As(err, &tce) && len(tce.CancellationReasons) == len(items) {
		// Cancelled: nothing was written. Each key is decided again on
		// the item its failed condition saw, or, where its own write
		// would have passed (or met a conflict), as it was.
		for j, r := range tce.CancellationReasons {
			if aws.ToString(r.Code) == "ConditionalCheckFailed" {
				b.seen[keys[j]] = r.Item // nil: the item is gone since
			}
		}
		return keys, nil
	}
	if errors.As(err, &tce) {
		// Cancelled, nothing written, but with no reason per item: each
		// key is taken on its own.
		return nil, keys
	}
	err = fmt.Errorf("dynamostore: acquire batch of %d: %w", len(items), classify(err))
	for _, i := range keys {
		b.sent[i] = err
	}
	return nil, keys
}

// oneByOne takes the keys of idx one at a time, at most
// Config.ExtendConcurrency at once, with Acquire's conditional writes and
// retries (lock.RetryAcquire) from the item last seen, with the same owner
// token; a key whose transaction answered an error counts that as its
// first try.
func (b *acquireBatch) oneByOne(ctx context.Context, idx []int) {
	sem := make(chan struct{}, b.s.cfg.ExtendConcurrency)
	var wg sync.WaitGroup
	for _, i := range idx {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			first := b.sent[i]
			b.results[i], b.errs[i] = lock.RetryAcquire(ctx, func(ctx context.Context) (lock.Result, error) {
				if err := first; err != nil {
					first = nil
					return lock.Result{}, err
				}
				return b.s.acquire(ctx, b.reqs[i], b.owners[i], b.seen[i])
			}, answered)
		}()
	}
	wg.Wait()
}
