package dynamostore

import (
	"context"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb"
	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/lock"
)

// Scanner is the Scan of a DynamoDB client, which List needs besides a
// Client's methods; *dynamodb.Client has it.
type Scanner interface {
	Scan(ctx context.Context, in *dynamodb.ScanInput, opts ...func(*dynamodb.Options)) (*dynamodb.ScanOutput, error)
}

var _ lock.Lister = (*Store)(nil)

// List reads one page of a Scan of the table, its Limit req.Scan (the
// items DynamoDB reads, before its filter), with a filter keeping the
// Store's namespace (Config.Prefix), req.Prefix, req.State and records
// that have not expired or been forgotten; the cursor is the page's
// LastEvaluatedKey in hex. The Scan is eventually consistent and reads
// the whole table (every namespace in it) over its pages: each call costs
// what its Scan says, the listing what the table holds. A client that is
// not a Scanner is an error wrapping lock.ErrListUnsupported.
func (s *Store) List(ctx context.Context, req lock.ListRequest) (lock.ListPage, error) {
	req, err := req.Check()
	if err != nil {
		return lock.ListPage{}, err
	}
	sc, ok := s.client.(Scanner)
	if !ok {
		return lock.ListPage{}, fmt.Errorf("%w: the DynamoDB client %T has no Scan", lock.ErrListUnsupported, s.client)
	}
	_, nowMs := s.now()
	in := &dynamodb.ScanInput{
		TableName:        aws.String(s.cfg.Table),
		Limit:            aws.Int32(int32(req.Scan)),
		FilterExpression: aws.String("begins_with(#pk, :pre) AND #ex > :now AND #st <> :gone"),
		ExpressionAttributeNames: map[string]string{
			"#pk": attrPK, "#ex": attrExpires, "#st": attrState,
		},
		ExpressionAttributeValues: map[string]types.AttributeValue{
			":pre":  &types.AttributeValueMemberB{Value: pk(s.cfg.Prefix, req.Prefix)},
			":now":  num(nowMs),
			":gone": str(stateForgotten),
		},
	}
	if req.State != "" {
		*in.FilterExpression += " AND #st = :st"
		in.ExpressionAttributeValues[":st"] = str(string(req.State.Letter()))
	}
	if req.Cursor != "" {
		b, err := hex.DecodeString(req.Cursor)
		if err != nil || len(b) == 0 {
			return lock.ListPage{}, fmt.Errorf("%w: %q", lock.ErrBadCursor, req.Cursor)
		}
		in.ExclusiveStartKey = map[string]types.AttributeValue{attrPK: &types.AttributeValueMemberB{Value: b}}
	}
	out, err := sc.Scan(ctx, in)
	if err != nil {
		return lock.ListPage{}, fmt.Errorf("dynamostore: list: %w", classify(err))
	}
	// ScannedCount is DynamoDB's; an emulator that leaves it 0 read at
	// least the items it returned.
	page := lock.ListPage{Scanned: max(int(out.ScannedCount), len(out.Items))}
	if v, ok := out.LastEvaluatedKey[attrPK].(*types.AttributeValueMemberB); ok && len(v.Value) > 0 {
		page.Next = hex.EncodeToString(v.Value)
	}
	ns := len(s.cfg.Prefix) + 1
	for _, item := range out.Items {
		p, ok := item[attrPK].(*types.AttributeValueMemberB)
		if !ok || len(p.Value) < ns {
			continue
		}
		key := string(p.Value[ns:])
		r, err := decode(key, item)
		if err != nil || r.gone(nowMs) || !req.Keep(key, r.state[0]) {
			continue
		}
		rec := lock.Record{Key: key, State: lock.StateOf(r.state[0]), Owner: r.owner, Fence: r.fence, Attempts: int(r.attempts),
			Fingerprint: r.fingerprint, Created: time.UnixMilli(r.created),
			ExpiresIn: time.Duration(r.expires-nowMs) * time.Millisecond,
			Location:  fmt.Sprintf("DynamoDB table %s, item pk=%q", s.cfg.Table, p.Value)}
		if r.ended > 0 {
			rec.Ended = time.UnixMilli(r.ended)
		}
		switch r.state {
		case stateInProgress:
			rec.LeaseLeft = max(0, time.Duration(r.deadline-nowMs)*time.Millisecond)
		case stateCompleted:
			if req.Values {
				rec.Value = r.value
			}
		case stateFailed:
			rec.Error = string(r.value)
		}
		page.Records = append(page.Records, rec)
	}
	return page, nil
}
