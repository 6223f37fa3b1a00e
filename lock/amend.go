package lock

import "context"

// Amender is implemented by stores that can change the stored value of a
// completed record after its completion: amqpidem's outbox records there
// what became of the messages a handler staged. MemoryStore, RedisStore
// and pgstore.Store implement it.
//
// The value is opaque to the store, as Complete's result is. A caller
// learns a record's fence and value from Acquire (Status Completed: Fence
// and Value) or Admin.Inspect, and changes the value by compare-and-set
// on both, so that of two writers that saw the same value, one wins and
// the other is told (ErrChanged) to read the record again.
type Amender interface {
	// Amend replaces the value of key's record with value when the record
	// is completed, its fence is fence and its value is old, byte for byte
	// (compare-and-set; a nil and an empty slice are the same, empty,
	// value). Everything else in the record stays as it was: state,
	// owner, fence, attempts, fingerprint, created and ended times, and its
	// expiry, which stays where the completion put it (Amend does not
	// lengthen the idempotency window), so that Admin.Inspect shows the
	// same record before and after but for the value.
	//
	// It returns nil when it replaced the value, and also when the record
	// already holds exactly value, with that fence, completed: a retry of
	// this same call that landed, or another writer that wrote the same
	// bytes, is the outcome the caller asked for. So writers that must not
	// both win, such as two claimants, must write different bytes (the
	// outbox tags each copy's claim). It returns an error wrapping
	// ErrChanged, naming the key and the fence, when the record
	// is not the completed record with that fence and that value: it is
	// absent (never made, expired, forgotten), not completed (in progress,
	// failed, released, cancelled), of another fence (made again since),
	// or holds a value that is neither old nor value (another writer
	// amended it first). Nothing changed then: read the record again to
	// decide. Of concurrent Amends of one record from the same old value
	// to different values, exactly one answers nil.
	//
	// Other errors: ErrInvalidKey for a key Acquire refuses;
	// ErrResultTooLarge when value is longer than the store's
	// MaxResultSize, before any round trip; ErrUnavailable when the store
	// did not answer, and the value may or may not have changed (call
	// Amend again: nil says it has; ErrChanged may also mean that it did,
	// and another writer changed it since); ErrBadRecord or
	// ErrKeyCollision when the key's record cannot be used, as Acquire
	// answers them.
	Amend(ctx context.Context, key string, fence int64, old, value []byte) error
}

var (
	_ Amender = (*MemoryStore)(nil)
	_ Amender = (*RedisStore)(nil)
)
