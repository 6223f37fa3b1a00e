package amqpidem

import "crypto/sha256"

// StoreKey is the key under which amqpidem keeps, in its lock.Store, the
// record of the message key key for endpoint (Config.Endpoint, by default
// the queue): the endpoint, a NUL byte, then the key. Use it to look a
// record up with the store's own tools; handlers see the message key alone
// (Info.Key).
func StoreKey(endpoint, key string) string {
	return endpoint + "\x00" + key
}

// ResultOverhead is the most bytes amqpidem adds to a handler's result
// when it stores it, besides the messages the handler staged (see Stage):
// a version byte, a flags byte and a 16-byte digest of the message's
// ReplyTo.
const ResultOverhead = 2 + replyDigestLen

const (
	resultVersion  = 1
	flagReplyTo    = 1
	replyDigestLen = 16
)

// decodeResult splits a stored value into the result and whether its
// reply belongs to replyTo. A value of another form (written by something
// other than amqpidem) is a result whose reply belongs nowhere; a value
// whose outbox is damaged has no result.
func decodeResult(v []byte, replyTo string) (result []byte, replyOK bool) {
	s, err := splitValue(v)
	if err != nil {
		return nil, false
	}
	return s.result, replyTo != "" && s.replyDigest != nil && string(s.replyDigest) == string(replyDigest(replyTo))
}

// StoredResult is the handler's result inside the value of a completed
// record (lock.Record.Value): amqpidem stores it after ResultOverhead
// bytes of its own at most, and the messages the handler staged, if any
// (StoredOutbox). A value amqpidem did not write is returned whole.
func StoredResult(value []byte) []byte {
	result, _ := decodeResult(value, "")
	return result
}

func replyDigest(replyTo string) []byte {
	sum := sha256.Sum256([]byte(replyTo))
	return sum[:replyDigestLen]
}
