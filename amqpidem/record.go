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
// when it stores it: a version byte, a flags byte and a 16-byte digest of
// the message's ReplyTo.
const ResultOverhead = 2 + replyDigestLen

const (
	resultVersion  = 1
	flagReplyTo    = 1
	replyDigestLen = 16
)

// encodeResult makes the stored value of a completed message: the result,
// and a digest of the ReplyTo its reply went to, so that a stored reply is
// re-sent to that same ReplyTo only.
func encodeResult(replyTo string, result []byte) []byte {
	if replyTo == "" {
		return append([]byte{resultVersion, 0}, result...)
	}
	v := make([]byte, 0, ResultOverhead+len(result))
	v = append(v, resultVersion, flagReplyTo)
	v = append(v, replyDigest(replyTo)...)
	return append(v, result...)
}

// decodeResult splits a stored value into the result and whether its
// reply belongs to replyTo. A value of another form (written by something
// other than amqpidem) is a result whose reply belongs nowhere.
func decodeResult(v []byte, replyTo string) (result []byte, replyOK bool) {
	switch {
	case len(v) >= 2 && v[0] == resultVersion && v[1] == 0:
		return v[2:], false
	case len(v) >= ResultOverhead && v[0] == resultVersion && v[1] == flagReplyTo:
		return v[ResultOverhead:], replyTo != "" && string(v[2:ResultOverhead]) == string(replyDigest(replyTo))
	}
	return v, false
}

// StoredResult is the handler's result inside the value of a completed
// record (lock.Record.Value): amqpidem stores it after at most
// ResultOverhead bytes of its own. A value amqpidem did not write is
// returned whole.
func StoredResult(value []byte) []byte {
	result, _ := decodeResult(value, "")
	return result
}

func replyDigest(replyTo string) []byte {
	sum := sha256.Sum256([]byte(replyTo))
	return sum[:replyDigestLen]
}
