package dynamostore

import (
	"context"
	"fmt"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/lock"
)

// Inspect returns key's record, read with a strongly consistent GetItem,
// or an error wrapping lock.ErrNotFound when it has none (never made,
// expired, forgotten). Its Location names the table and the item's
// partition key.
func (s *Store) Inspect(ctx context.Context, key string) (lock.Record, error) {
	if _, err := s.cfg.CheckRequest(lock.Request{Key: key}); err != nil {
		return lock.Record{}, err
	}
	out, err := s.client.GetItem(ctx, &dynamodb.GetItemInput{
		TableName:      aws.String(s.cfg.Table),
		Key:            keyAttr(s.cfg.Prefix, key),
		ConsistentRead: aws.Bool(true),
	})
	if err != nil {
		return lock.Record{}, fmt.Errorf("dynamostore: inspect %q: %w", key, classify(err))
	}
	_, nowMs := s.now()
	if out.Item == nil {
		return lock.Record{}, fmt.Errorf("%w: key %q", lock.ErrNotFound, key)
	}
	r, err := decode(key, out.Item)
	if err != nil {
		return lock.Record{}, err
	}
	if r.gone(nowMs) {
		return lock.Record{}, fmt.Errorf("%w: key %q", lock.ErrNotFound, key)
	}
	rec := lock.Record{
		Key:         key,
		State:       lock.StateOf(r.state[0]),
		Owner:       r.owner,
		Fence:       r.fence,
		Attempts:    int(r.attempts),
		Fingerprint: r.fingerprint,
		Created:     time.UnixMilli(r.created),
		ExpiresIn:   time.Duration(r.expires-nowMs) * time.Millisecond,
		Location:    fmt.Sprintf("DynamoDB table %s, item pk=%q", s.cfg.Table, pk(s.cfg.Prefix, key)),
	}
	if r.ended > 0 {
		rec.Ended = time.UnixMilli(r.ended)
	}
	switch r.state {
	case stateInProgress:
		rec.LeaseLeft = max(0, time.Duration(r.deadline-nowMs)*time.Millisecond)
	case stateCompleted:
		rec.Value = r.value
	case stateFailed:
		rec.Error = string(r.value)
	}
	return rec, nil
}

// Forget deletes key's record if it is still in state with fence:
// compare-and-set, in one conditional UpdateItem. The item stays as a
// tombstone that keeps only the fence, until its TTL deletes it, so that a
// record made again gets a higher fence whatever the clocks; to every
// method it is no record.
func (s *Store) Forget(ctx context.Context, key string, state lock.State, fence int64) error {
	if _, err := s.cfg.CheckRequest(lock.Request{Key: key}); err != nil {
		return err
	}
	letter := state.Letter()
	if letter == 0 {
		return fmt.Errorf("dynamostore: forget %q: state %q is not one of lock's", key, state)
	}
	_, nowMs := s.now()
	// The tombstone: the fence, and nothing else of the record.
	u := newUpdate().all(s, record{state: stateForgotten, fence: fence, expires: nowMs}).
		cond(nil, map[string]types.AttributeValue{
			":seen_st": str(string(letter)), ":seen_fe": num(fence), ":now": num(nowMs),
		})
	_, err := s.client.UpdateItem(ctx, &dynamodb.UpdateItemInput{
		TableName:                           aws.String(s.cfg.Table),
		Key:                                 keyAttr(s.cfg.Prefix, key),
		UpdateExpression:                    aws.String("SET " + u.set),
		ConditionExpression:                 aws.String("#st = :seen_st AND #fe = :seen_fe AND #ex > :now"),
		ExpressionAttributeNames:            u.names,
		ExpressionAttributeValues:           u.values,
		ReturnValuesOnConditionCheckFailure: types.ReturnValuesOnConditionCheckFailureAllOld,
	})
	if item, failed := conditionFailed(err); failed {
		if item == nil {
			return fmt.Errorf("%w: key %q", lock.ErrNotFound, key)
		}
		r, err := decode(key, item)
		if err != nil {
			return err
		}
		if r.gone(nowMs) {
			return fmt.Errorf("%w: key %q", lock.ErrNotFound, key)
		}
		return fmt.Errorf("%w: key %q is %s with fence %d, not %s with fence %d",
			lock.ErrChanged, key, lock.StateOf(r.state[0]), r.fence, state, fence)
	}
	if err != nil {
		return fmt.Errorf("dynamostore: forget %q: %w", key, classify(err))
	}
	return nil
}
