package lock

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
)

// recordKey maps a user key to the Redis key of its record:
//
//	<prefix>:{<32 hex digits of SHA-256(prefix, 0x00, key)>}
//
// Hashing makes the key's length and bytes irrelevant to Redis: braces or
// binary in a user key cannot pick the Cluster hash slot (no hot slot), and
// the prefix is part of the hash, so namespaces cannot collide. The hash tag
// covers the whole digest, so every key of one record shares its slot.
func recordKey(prefix, key string) string {
	var stack [maxPrefixLen + 3 + 32]byte // a Config's prefix fits
	return string(appendRecordKey(stack[:0], prefix, key))
}

// appendRecordKey appends recordKey(prefix, key) to dst.
func appendRecordKey(dst []byte, prefix, key string) []byte {
	h := sha256.New()
	h.Write([]byte(prefix))
	h.Write([]byte{0})
	h.Write([]byte(key))
	var sum [sha256.Size]byte
	digest := h.Sum(sum[:0])

	dst = append(dst, prefix...)
	dst = append(dst, ":{"...)
	dst = hex.AppendEncode(dst, digest[:16])
	return append(dst, '}')
}

// ownerString returns the owner token b as Lease.Owner holds it: s when
// the caller made that string already (AcquireBatch makes one string of a
// batch's tokens), else a new one.
func ownerString(b *[32]byte, s string) string {
	if s != "" {
		return s
	}
	return string(b[:])
}

// NewOwner returns a random 128-bit owner token, 32 hex digits: what a
// Store puts in Lease.Owner for each Acquire call.
func NewOwner() string {
	var b [32]byte
	newOwner(&b)
	return string(b[:])
}

// newOwner writes a new owner token, as NewOwner returns it, into dst.
func newOwner(dst *[32]byte) {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+).
	hex.Encode(dst[:], b[:])
}
