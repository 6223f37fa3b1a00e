package lock

// DisableNative makes s take every lease through the acquire script, as
// it does on a Cluster or a server older than Redis 7.0, so that tests can
// run both paths.
func DisableNative(s *RedisStore) { s.batch.noNative.Store(true) }

// NativeEnabled reports whether s still takes leases natively where the
// server allows.
func NativeEnabled(s *RedisStore) bool { return !s.batch.noNative.Load() }
