package lock

import "context"

// BatchAcquirer is a Store that takes the leases of many keys in one call
// (pgstore's Store does, in one statement; RedisStore in one pipeline, two
// when some keys need the acquire script; MemoryStore under one lock). amqpidem's batch consumers
// use it, when the store has it, to take the leases of a batch's
// deliveries together.
type BatchAcquirer interface {
	// AcquireBatch is Acquire for each of reqs, in as few round trips as
	// the store allows: results[i] and errs[i] are what Acquire would
	// answer for reqs[i]. Both slices have len(reqs) entries. An error
	// for the whole call is every entry's error; a lease it may have
	// taken then blocks its key for its TTL, as with Acquire.
	AcquireBatch(ctx context.Context, reqs []Request) (results []Result, errs []error)
}

// BatchCompleter is a Store that completes the records of many leases in
// one call (RedisStore does, in one pipeline). amqpidem's batch consumers
// use it, when the store has it and the batch handler does not complete
// records itself, to complete a batch's records together.
type BatchCompleter interface {
	// CompleteBatch is Complete for each of leases with results[i], in
	// as few round trips as the store allows: errs[i] is what Complete
	// would answer for leases[i], and errs has len(leases) entries.
	CompleteBatch(ctx context.Context, leases []Lease, results [][]byte) (errs []error)
}
