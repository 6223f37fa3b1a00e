package dynamostore

import (
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/lock"
)

// The attributes of a record's item (the package doc has the table).
const (
	attrPK          = "pk" // B: prefix, a zero byte, the key
	attrState       = "st" // S: one letter, as lock.State.Letter, or 'd' for a forgotten record
	attrOwner       = "ow" // S: the latest lease's owner token
	attrFence       = "fe" // N: the latest lease's fence (µs)
	attrDeadline    = "dl" // N: the latest lease's deadline (Unix ms)
	attrAttempts    = "at" // N: leases granted
	attrFingerprint = "fp" // B: a zero byte, then the fingerprint
	attrCreated     = "cr" // N: when the record was made (Unix ms)
	attrEnded       = "en" // N: when it got its latest outcome (Unix ms), 0 until then
	attrExpires     = "ex" // N: when the record expires (Unix ms), judged by the conditions
	attrValue       = "v"  // B: a zero byte, then the result or error text
	attrTTL         = "ttl"
)

// Record states as the store writes them.
const (
	stateInProgress = "p"
	stateCompleted  = "c"
	stateFailed     = "f"
	stateReleased   = "r"
	stateCancelled  = "x"
	stateForgotten  = "d" // a tombstone that keeps the fence; no record to any method
)

// record is a record's item, decoded.
type record struct {
	key         string
	state       string
	owner       string
	fence       int64
	deadline    int64 // ms
	attempts    int64
	fingerprint string
	created     int64 // ms
	ended       int64 // ms
	expires     int64 // ms
	value       []byte
}

// gone reports whether r is no record at nowMs: expired, or forgotten.
func (r record) gone(nowMs int64) bool {
	return r.state == stateForgotten || r.expires <= nowMs
}

// pk returns the partition key of key's record in namespace prefix.
func pk(prefix, key string) []byte {
	b := make([]byte, 0, len(prefix)+1+len(key))
	b = append(b, prefix...)
	b = append(b, 0)
	return append(b, key...)
}

// keyAttr returns the item key of key's record in namespace prefix.
func keyAttr(prefix, key string) map[string]types.AttributeValue {
	return map[string]types.AttributeValue{attrPK: &types.AttributeValueMemberB{Value: pk(prefix, key)}}
}

// num and bin make attribute values. Binary values carry a zero byte in
// front, so that none is ever empty: DynamoDB takes empty binary values,
// but some emulators do not, and an empty value could not be SET.
func num(n int64) types.AttributeValue {
	return &types.AttributeValueMemberN{Value: strconv.FormatInt(n, 10)}
}

func str(s string) types.AttributeValue { return &types.AttributeValueMemberS{Value: s} }

func bin(b []byte) types.AttributeValue {
	return &types.AttributeValueMemberB{Value: append([]byte{0}, b...)}
}

// ttlOf is the item's TTL attribute (Unix seconds) for a record that
// expires at expiresMs.
func (s *Store) ttlOf(expiresMs int64) types.AttributeValue {
	return num(expiresMs/1000 + int64(s.cfg.TTLDelay/time.Second) + 1)
}

// decode reads an item; key is the caller's key, for errors.
func decode(key string, item map[string]types.AttributeValue) (record, error) {
	r := record{key: key}
	var err error
	getS := func(name string) string {
		v, ok := item[name].(*types.AttributeValueMemberS)
		if !ok && err == nil {
			err = fmt.Errorf("attribute %s is not a string", name)
		}
		if !ok {
			return ""
		}
		return v.Value
	}
	getN := func(name string) int64 {
		v, ok := item[name].(*types.AttributeValueMemberN)
		if !ok {
			if err == nil {
				err = fmt.Errorf("attribute %s is not a number", name)
			}
			return 0
		}
		n, perr := parseInt(v.Value)
		if perr != nil && err == nil {
			err = fmt.Errorf("attribute %s: %w", name, perr)
		}
		return n
	}
	getB := func(name string) []byte {
		v, ok := item[name].(*types.AttributeValueMemberB)
		if !ok || len(v.Value) == 0 || v.Value[0] != 0 {
			if err == nil {
				err = fmt.Errorf("attribute %s is not a binary value of this store", name)
			}
			return nil
		}
		return v.Value[1:]
	}
	r.state = getS(attrState)
	r.fence = getN(attrFence)
	r.expires = getN(attrExpires)
	if r.state != stateForgotten { // a tombstone keeps only these
		r.owner = getS(attrOwner)
		r.deadline = getN(attrDeadline)
		r.attempts = getN(attrAttempts)
		r.fingerprint = string(getB(attrFingerprint))
		r.created = getN(attrCreated)
		r.ended = getN(attrEnded)
		r.value = getB(attrValue)
	}
	switch {
	case err != nil, r.state == stateForgotten:
	case len(r.state) != 1 || lock.StateOf(r.state[0]).Letter() == 0:
		err = fmt.Errorf("state %q unknown", r.state)
	}
	if err != nil {
		return record{}, fmt.Errorf("%w: key %q: %w", lock.ErrBadRecord, key, err)
	}
	return r, nil
}

// parseInt reads a DynamoDB number that holds an integer. Emulators may
// write one in exponent form (1.7e+15) after arithmetic.
func parseInt(s string) (int64, error) {
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return n, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return 0, fmt.Errorf("number %q is not an integer", s)
	}
	return int64(f), nil
}

// update is an UpdateItem's SET clause and its values, built attribute by
// attribute, each value named after its attribute (":st" for st).
type update struct {
	set    string
	names  map[string]string
	values map[string]types.AttributeValue
}

func newUpdate() *update {
	return &update{names: map[string]string{}, values: map[string]types.AttributeValue{}}
}

// put sets attribute name to v.
func (u *update) put(name string, v types.AttributeValue) *update {
	if u.set != "" {
		u.set += ", "
	}
	u.set += "#" + name + " = :" + name
	u.names["#"+name] = name
	u.values[":"+name] = v
	return u
}

// expr adds the set clause "#name = expr" with its values (named
// ":<anything>" by the caller).
func (u *update) expr(name, expr string, values map[string]types.AttributeValue) *update {
	if u.set != "" {
		u.set += ", "
	}
	u.set += "#" + name + " = " + expr
	u.names["#"+name] = name
	for k, v := range values {
		u.values[k] = v
	}
	return u
}

// cond adds the names and values a condition uses.
func (u *update) cond(names []string, values map[string]types.AttributeValue) *update {
	for _, n := range names {
		u.names["#"+n] = n
	}
	for k, v := range values {
		u.values[k] = v
	}
	return u
}

// all sets every attribute of r but the key.
func (u *update) all(s *Store, r record) *update {
	return u.put(attrState, str(r.state)).
		put(attrOwner, str(r.owner)).
		put(attrFence, num(r.fence)).
		put(attrDeadline, num(r.deadline)).
		put(attrAttempts, num(r.attempts)).
		put(attrFingerprint, bin([]byte(r.fingerprint))).
		put(attrCreated, num(r.created)).
		put(attrEnded, num(r.ended)).
		put(attrExpires, num(r.expires)).
		put(attrValue, bin(r.value)).
		put(attrTTL, s.ttlOf(r.expires))
}
