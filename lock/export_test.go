package lock

import "time"

// DisableNative makes s take every lease through the acquire script, as
// it does on a Cluster or a server older than Redis 7.0, so that tests can
// run both paths.
func DisableNative(s *RedisStore) { s.batch.noNative.Store(true) }

// NativeEnabled reports whether s still takes leases natively where the
// server allows.
func NativeEnabled(s *RedisStore) bool { return !s.batch.noNative.Load() }

// Decoded returns l without the mark of a lease whose record the native
// Acquire made: its outcome is written by decoding the record, as for a
// lease the acquire script granted.
func Decoded(l Lease) Lease {
	l.made, l.fp = false, ""
	return l
}

// Made reports whether l carries the mark of a lease whose record the
// native Acquire made.
func Made(l Lease) bool { return l.made }

// NativeLease returns the lease a native Acquire of key with owner, ttl,
// retention and fingerprint gets for a record made with fence, as
// newLease makes it.
func NativeLease(key, owner string, fence int64, ttl, retention time.Duration, fingerprint string) Lease {
	return Lease{Key: key, Owner: owner, Fence: fence, Attempt: 1, TTL: ttl, Retention: retention,
		Deadline: time.Now().Add(ttl - DeadlineSlack), made: true, fp: fingerprint}
}

// RecordKey is the Redis key of key's record under prefix.
func RecordKey(prefix, key string) string { return recordKey(prefix, key) }
