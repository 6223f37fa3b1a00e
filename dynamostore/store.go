package dynamostore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/lock"
)

// Client is what a Store needs of a DynamoDB client; *dynamodb.Client has
// it. Its retries (the SDK's retryer: 3 attempts by default, for
// throttling and server errors) run within the caller's context.
type Client interface {
	GetItem(ctx context.Context, in *dynamodb.GetItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.GetItemOutput, error)
	UpdateItem(ctx context.Context, in *dynamodb.UpdateItemInput, opts ...func(*dynamodb.Options)) (*dynamodb.UpdateItemOutput, error)
	TransactWriteItems(ctx context.Context, in *dynamodb.TransactWriteItemsInput, opts ...func(*dynamodb.Options)) (*dynamodb.TransactWriteItemsOutput, error)
	DescribeTable(ctx context.Context, in *dynamodb.DescribeTableInput, opts ...func(*dynamodb.Options)) (*dynamodb.DescribeTableOutput, error)
}

// acquireRounds bounds the conditional writes of one Acquire: each failed
// one returns the item that made it fail, and the next decides on it.
const acquireRounds = 8

// Store is a lock.Store on DynamoDB: one item per idempotency key,
// written only by conditional writes that check what the writer saw
// (owner and fence, state, deadline), so that of two writers one wins and
// the other reads the winner's item in the same answer. It also
// implements lock.Admin and lock.Amender, and TxHandler joins a handler's
// own writes to the record's completion in one TransactWriteItems.
//
// Store is safe for concurrent use.
type Store struct {
	client Client
	cfg    Config
}

var (
	_ lock.Store   = (*Store)(nil)
	_ lock.Admin   = (*Store)(nil)
	_ lock.Amender = (*Store)(nil)
)

// New returns a store that keeps its records in cfg.Table through client.
// It makes no network call; the table must exist (CreateTable), which
// Check verifies.
func New(client Client, cfg Config) (*Store, error) {
	if client == nil {
		return nil, errors.New("dynamostore: nil client")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Store{client: client, cfg: cfg.withDefaults()}, nil
}

// MaxResultSize is the largest result Complete accepts, in bytes.
func (s *Store) MaxResultSize() int { return s.cfg.MaxResultSize }

// Table is the name of the records table.
func (s *Store) Table() string { return s.cfg.Table }

// Ping checks that the table answers, for a readiness check: one
// eventually consistent GetItem of a key no record has.
func (s *Store) Ping(ctx context.Context) error {
	_, err := s.client.GetItem(ctx, &dynamodb.GetItemInput{
		TableName: aws.String(s.cfg.Table),
		Key:       map[string]types.AttributeValue{attrPK: &types.AttributeValueMemberB{Value: []byte{0}}},
	})
	if err != nil {
		return fmt.Errorf("dynamostore: ping %s: %w", s.cfg.Table, classify(err))
	}
	return nil
}

// Check verifies that the table exists with the key schema CreateTable
// makes. amqpidem's Consumer calls it once when Run starts.
func (s *Store) Check(ctx context.Context) error {
	out, err := s.client.DescribeTable(ctx, &dynamodb.DescribeTableInput{TableName: aws.String(s.cfg.Table)})
	if err != nil {
		return fmt.Errorf("dynamostore: check %s: %w", s.cfg.Table, classify(err))
	}
	return checkSchema(out.Table)
}

func (s *Store) now() (time.Time, int64) {
	t := s.cfg.Now()
	return t, t.UnixMilli()
}

// Acquire takes a lease on req.Key: one conditional UpdateItem for a new
// key and for a duplicate (the failed condition returns the item), two
// for a takeover.
//
// An Acquire whose answer is lost is sent again with the same owner
// token, which finds its own lease and answers it (no second attempt
// counted), up to 3 times over about 350 ms within ctx (see
// lock.RetryAcquire). If the tries all fail, Acquire returns an error
// wrapping lock.ErrUnavailable, and a lease it may have taken blocks the
// key for its TTL.
func (s *Store) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	req, err := s.cfg.CheckRequest(req)
	if err != nil {
		return lock.Result{}, err
	}
	owner := lock.NewOwner()
	return lock.RetryAcquire(ctx, func(ctx context.Context) (lock.Result, error) { return s.acquire(ctx, req, owner, nil) }, answered)
}

// acquire decides on the item last seen (seen, nil for none) and writes
// the lease by compare-and-set on it, until a write succeeds or the item
// seen decides without one.
func (s *Store) acquire(ctx context.Context, req lock.Request, owner string, seen map[string]types.AttributeValue) (lock.Result, error) {
	for range acquireRounds {
		w, err := s.acquireWrite(req, owner, seen)
		if err != nil || w.done {
			return w.res, err
		}
		_, err = s.client.UpdateItem(ctx, &dynamodb.UpdateItemInput{
			TableName:                           aws.String(s.cfg.Table),
			Key:                                 keyAttr(s.cfg.Prefix, req.Key),
			UpdateExpression:                    aws.String("SET " + w.u.set),
			ConditionExpression:                 aws.String(w.cond),
			ExpressionAttributeNames:            w.u.names,
			ExpressionAttributeValues:           w.u.values,
			ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
		})
		if item, failed := conditionFailed(err); failed {
			seen = item // nil: the item is gone since; make it anew
			continue
		}
		if err != nil {
			return lock.Result{}, fmt.Errorf("dynamostore: acquire %q: %w", req.Key, classify(err))
		}
		return acquired(req, w.next, w.start), nil
	}
	return lock.Result{}, fmt.Errorf("%w: acquire %q: the record changed under %d conditional writes in a row", lock.ErrUnavailable, req.Key, acquireRounds)
}

// acquireStep is one round of an Acquire: the answer, when the item seen
// decides it (done), or else the conditional write that takes the lease
// (u, cond) and the lease it writes (next, made at start).
type acquireStep struct {
	done  bool
	res   lock.Result
	u     *update
	cond  string
	next  record
	start time.Time
}

// acquireWrite decides req on the item seen (nil: none), or makes the
// write that takes its lease for owner by compare-and-set on that item.
func (s *Store) acquireWrite(req lock.Request, owner string, seen map[string]types.AttributeValue) (acquireStep, error) {
	start, nowMs := s.now()
	next := record{
		key:         req.Key,
		state:       stateInProgress,
		owner:       owner,
		fence:       start.UnixMicro(),
		deadline:    nowMs + req.TTL.Milliseconds(),
		attempts:    1,
		fingerprint: req.Fingerprint,
		created:     nowMs,
		expires:     nowMs + req.TTL.Milliseconds() + req.Retention.Milliseconds(),
	}
	u := newUpdate()
	cond := "attribute_not_exists(#pk)"
	if seen == nil {
		u.cond([]string{attrPK}, nil)
	} else {
		old, err := decode(req.Key, seen)
		if err != nil {
			return acquireStep{}, err
		}
		// A lease in progress is judged by its deadline and the skew
		// even when the item has expired (Retention at most
		// MaxClockSkew): its holder may still hold it.
		if !old.gone(nowMs) || s.mayBeHeld(old, nowMs) {
			if res, done := s.decide(req, owner, old, start, nowMs); done {
				return acquireStep{done: true, res: res}, nil
			}
			// A takeover: the same record, a new lease. The record
			// keeps the fingerprint it was made with, none included,
			// as every store does (Conflict: "first seen with").
			next.attempts = old.attempts + 1
			next.created = old.created
			next.fingerprint = old.fingerprint
		}
		next.fence = max(old.fence+1, next.fence)
		// Compare-and-set on the item as seen: a new lease changes the
		// fence, an outcome the state, an Extend the deadline and expiry.
		cond = "#st = :seen_st AND #fe = :seen_fe AND #dl = :seen_dl AND #ex = :seen_ex"
		u.cond([]string{attrState, attrFence, attrDeadline, attrExpires}, map[string]types.AttributeValue{
			":seen_st": seen[attrState], ":seen_fe": seen[attrFence],
			":seen_dl": seen[attrDeadline], ":seen_ex": seen[attrExpires],
		})
	}
	u.all(s, next)
	return acquireStep{u: u, cond: cond, next: next, start: start}, nil
}

// mayBeHeld reports whether r is a lease that a holder whose clock is
// behind by up to MaxClockSkew may still hold at nowMs: in progress, its
// deadline at most MaxClockSkew past. Acquire never takes such a record
// over, expired item or not.
func (s *Store) mayBeHeld(r record, nowMs int64) bool {
	return r.state == stateInProgress && r.deadline+s.cfg.MaxClockSkew.Milliseconds() >= nowMs
}

// decide answers Acquire from a record that has not expired or may still
// be held (mayBeHeld), or says (done false) that the caller may take a new
// lease on it.
func (s *Store) decide(req lock.Request, owner string, old record, start time.Time, nowMs int64) (lock.Result, bool) {
	res := lock.Result{Fence: old.fence, Attempts: int(old.attempts)}
	switch {
	case old.state == stateInProgress && old.owner == owner:
		// A resent Acquire whose first answer was lost: its lease.
		l := acquired(req, old, start)
		l.Lease.Deadline = start.Add(min(req.TTL, time.Duration(old.deadline-nowMs)*time.Millisecond))
		return l, true
	case req.Fingerprint != "" && old.fingerprint != "" && req.Fingerprint != old.fingerprint:
		res.Status = lock.Conflict
	case old.state == stateCompleted:
		res.Status, res.Value = lock.Completed, old.value
	case old.state == stateFailed:
		res.Status, res.Error = lock.Failed, string(old.value)
	case s.mayBeHeld(old, nowMs):
		res.Status = lock.InProgress
		left := old.deadline - nowMs
		if left <= 0 { // expired, but within the clock skew allowed
			left = old.deadline + s.cfg.MaxClockSkew.Milliseconds() - nowMs + 1
		}
		res.Remaining = time.Duration(left) * time.Millisecond
	default:
		return lock.Result{}, false // expired, released or cancelled
	}
	return res, true
}

// acquired is the answer for lease r, written at start.
func acquired(req lock.Request, r record, start time.Time) lock.Result {
	return lock.Result{
		Status:   lock.Acquired,
		Fence:    r.fence,
		Attempts: int(r.attempts),
		Lease: lock.Lease{
			Key:       req.Key,
			Owner:     r.owner,
			Fence:     r.fence,
			Attempt:   int(r.attempts),
			TTL:       req.TTL,
			Retention: req.Retention,
			Deadline:  start.Add(req.TTL),
		},
	}
}

// leaseCond is the condition of every write by a lease: the record is in
// progress under that owner and fence, and has not expired.
const leaseCond = "#ow = :lease_ow AND #fe = :lease_fe AND #st = :lease_st AND #ex > :now"

// byLease adds leaseCond's names and values to u.
func byLease(u *update, l lock.Lease, nowMs int64) *update {
	return u.cond([]string{attrOwner, attrFence, attrState, attrExpires}, map[string]types.AttributeValue{
		":lease_ow": str(l.Owner), ":lease_fe": num(l.Fence), ":lease_st": str(stateInProgress), ":now": num(nowMs),
	})
}

// Extend renews each lease for its TTL, with one conditional UpdateItem
// per lease, at most Config.ExtendConcurrency at once: a lost lease fails
// alone. It returns one error per lease, in order: nil, lock.ErrLeaseLost,
// or the error of its request.
func (s *Store) Extend(ctx context.Context, leases ...lock.Lease) []error {
	errs := make([]error, len(leases))
	sem := make(chan struct{}, s.cfg.ExtendConcurrency)
	var wg sync.WaitGroup
	for i, l := range leases {
		if errs[i] = lock.CheckLease(l); errs[i] != nil {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			errs[i] = s.extend(ctx, l)
		}()
	}
	wg.Wait()
	return errs
}

func (s *Store) extend(ctx context.Context, l lock.Lease) error {
	_, nowMs := s.now()
	expires := nowMs + l.TTL.Milliseconds() + l.Retention.Milliseconds()
	u := newUpdate().put(attrDeadline, num(nowMs+l.TTL.Milliseconds())).put(attrExpires, num(expires)).put(attrTTL, s.ttlOf(expires))
	byLease(u, l, nowMs)
	_, err := s.client.UpdateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                 aws.String(s.cfg.Table),
		Key:                       keyAttr(s.cfg.Prefix, l.Key),
		UpdateExpression:          aws.String("SET " + u.set),
		ConditionExpression:       aws.String(leaseCond),
		ExpressionAttributeNames:  u.names,
		ExpressionAttributeValues: u.values,
	})
	if _, failed := conditionFailed(err); failed {
		return fmt.Errorf("%w: extend key %q fence %d", lock.ErrLeaseLost, l.Key, l.Fence)
	}
	if err != nil {
		return fmt.Errorf("dynamostore: extend %q: %w", l.Key, classify(err))
	}
	return nil
}

// Complete stores result and marks the record completed.
func (s *Store) Complete(ctx context.Context, l lock.Lease, result []byte) error {
	if len(result) > s.cfg.MaxResultSize {
		return fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", lock.ErrResultTooLarge, l.Key, len(result), s.cfg.MaxResultSize)
	}
	return s.finish(ctx, l, "complete", stateCompleted, result)
}

// Fail marks the record failed with reason, cut to MaxResultSize.
func (s *Store) Fail(ctx context.Context, l lock.Lease, reason string) error {
	return s.finish(ctx, l, "fail", stateFailed, []byte(lock.CutText(reason, s.cfg.MaxResultSize)))
}

// Release gives the lease up without an outcome.
func (s *Store) Release(ctx context.Context, l lock.Lease) error {
	return s.finish(ctx, l, "release", stateReleased, nil)
}

// Cancel gives the lease up and takes back the attempt its Acquire
// counted.
func (s *Store) Cancel(ctx context.Context, l lock.Lease) error {
	return s.finish(ctx, l, "cancel", stateCancelled, nil)
}

// finishWrite is the UpdateItem that moves l's record to state with value,
// conditional on l; TxHandler puts it in a transaction.
func (s *Store) finishWrite(l lock.Lease, state string, value []byte, nowMs int64) *update {
	expires := nowMs + l.Retention.Milliseconds()
	u := newUpdate().put(attrState, str(state)).put(attrValue, bin(value)).
		put(attrExpires, num(expires)).put(attrTTL, s.ttlOf(expires))
	switch state {
	case stateCompleted, stateFailed:
		u.put(attrEnded, num(nowMs))
	case stateCancelled:
		u.expr(attrAttempts, "#at - :one", map[string]types.AttributeValue{":one": num(1)})
	}
	return byLease(u, l, nowMs)
}

// finish writes l's outcome. A condition that fails on l's own write
// (a retry whose first answer was lost) answers nil.
func (s *Store) finish(ctx context.Context, l lock.Lease, op, state string, value []byte) error {
	if err := lock.CheckLease(l); err != nil {
		return err
	}
	_, nowMs := s.now()
	u := s.finishWrite(l, state, value, nowMs)
	_, err := s.client.UpdateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                           aws.String(s.cfg.Table),
		Key:                                 keyAttr(s.cfg.Prefix, l.Key),
		UpdateExpression:                    aws.String("SET " + u.set),
		ConditionExpression:                 aws.String(leaseCond),
		ExpressionAttributeNames:            u.names,
		ExpressionAttributeValues:           u.values,
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
	})
	if item, failed := conditionFailed(err); failed {
		return s.refused(l, op, state, item, nowMs)
	}
	if err != nil {
		return fmt.Errorf("dynamostore: %s %q: %w", op, l.Key, classify(err))
	}
	return nil
}

// refused explains a lease's write whose condition failed on item: nil if
// item shows that write done (l's owner and fence, in state), else
// lock.ErrLeaseLost.
func (s *Store) refused(l lock.Lease, op, state string, item map[string]types.AttributeValue, nowMs int64) error {
	if item != nil {
		if r, err := decode(l.Key, item); err == nil && !r.gone(nowMs) && r.owner == l.Owner && r.fence == l.Fence && r.state == state {
			return nil
		}
	}
	return fmt.Errorf("%w: %s key %q fence %d", lock.ErrLeaseLost, op, l.Key, l.Fence)
}

// Amend replaces the value of key's completed record, compare-and-set on
// its fence and value (see lock.Amender), in one conditional UpdateItem
// that leaves every other attribute as it was.
func (s *Store) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	if len(value) > s.cfg.MaxResultSize {
		return fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", lock.ErrResultTooLarge, key, len(value), s.cfg.MaxResultSize)
	}
	if _, err := s.cfg.CheckRequest(lock.Request{Key: key}); err != nil {
		return err
	}
	_, nowMs := s.now()
	u := newUpdate().put(attrValue, bin(value)).cond([]string{attrState, attrFence, attrExpires}, map[string]types.AttributeValue{
		":c": str(stateCompleted), ":seen_fe": num(fence), ":now": num(nowMs), ":old": bin(old),
	})
	_, err := s.client.UpdateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                           aws.String(s.cfg.Table),
		Key:                                 keyAttr(s.cfg.Prefix, key),
		UpdateExpression:                    aws.String("SET " + u.set),
		ConditionExpression:                 aws.String("#st = :c AND #fe = :seen_fe AND #ex > :now AND #v = :old"),
		ExpressionAttributeNames:            u.names,
		ExpressionAttributeValues:           u.values,
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
	})
	if item, failed := conditionFailed(err); failed {
		if item != nil {
			r, err := decode(key, item)
			if err != nil {
				return err
			}
			if !r.gone(nowMs) && r.state == stateCompleted && r.fence == fence && bytes.Equal(r.value, value) {
				return nil
			}
		}
		return fmt.Errorf("%w: amend key %q fence %d", lock.ErrChanged, key, fence)
	}
	if err != nil {
		return fmt.Errorf("dynamostore: amend %q: %w", key, classify(err))
	}
	return nil
}
