package dynamostore

import (
	"errors"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/dynamodb/types"

	"github.com/amqpidem/amqpidem/lock"
)

// FuzzDecode feeds decode items as a damaged or forged table could hold
// them: each attribute a string, a number (any text) or a binary value, or
// missing, as kinds picks. decode must not panic, must refuse with
// lock.ErrBadRecord whatever it cannot read, and must accept only a known
// state.
func FuzzDecode(f *testing.F) {
	f.Add("c", "owner", "1700000000000000", "1700000000000", "1700000000000", "3", []byte("\x00fp"),
		"1700000000000", "0", []byte("\x00result"), uint32(0))
	f.Add("d", "", "17", "1e3", "", "", []byte(nil), "", "", []byte(nil), uint32(0))
	f.Add("p", "o", "1.5", "-1", "9007199254740993", "x", []byte("fp"), "1", "2", []byte{}, uint32(0x5555))
	f.Fuzz(func(t *testing.T, state, owner, fence, expires, deadline, attempts string, fp []byte,
		created, ended string, value []byte, kinds uint32) {
		item := map[string]types.AttributeValue{}
		// Two bits per attribute: 0 as the store writes it, 1 a string,
		// 2 a number, 3 missing.
		set := func(i int, name string, s string, b []byte, natural int) {
			kind := int(kinds>>(2*i)) & 3
			if kind == 0 {
				kind = natural
			}
			switch kind {
			case 1:
				item[name] = &types.AttributeValueMemberS{Value: s}
			case 2:
				item[name] = &types.AttributeValueMemberN{Value: s}
			case 4:
				item[name] = &types.AttributeValueMemberB{Value: b}
			}
		}
		set(0, attrState, state, nil, 1)
		set(1, attrOwner, owner, nil, 1)
		set(2, attrFence, fence, nil, 2)
		set(3, attrExpires, expires, nil, 2)
		set(4, attrDeadline, deadline, nil, 2)
		set(5, attrAttempts, attempts, nil, 2)
		set(6, attrFingerprint, string(fp), fp, 4)
		set(7, attrCreated, created, nil, 2)
		set(8, attrEnded, ended, nil, 2)
		set(9, attrValue, string(value), value, 4)
		r, err := decode("k", item)
		if err != nil {
			if !errors.Is(err, lock.ErrBadRecord) {
				t.Fatalf("decode(%v) = %v: not lock.ErrBadRecord", item, err)
			}
			return
		}
		if r.state != stateForgotten && (len(r.state) != 1 || lock.StateOf(r.state[0]).Letter() == 0) {
			t.Fatalf("decode accepted the state %q", r.state)
		}
	})
}
