package lock

import (
	"context"
	"fmt"
)

var (
	_ BatchAcquirer  = (*MemoryStore)(nil)
	_ BatchCompleter = (*MemoryStore)(nil)
)

// AcquireBatch is Acquire for each of reqs, in order: a key that comes
// twice is taken by its first request and answered InProgress for the
// second.
func (m *MemoryStore) AcquireBatch(ctx context.Context, reqs []Request) ([]Result, []error) {
	results := make([]Result, len(reqs))
	errs := make([]error, len(reqs))
	for i, req := range reqs {
		results[i], errs[i] = m.Acquire(ctx, req)
	}
	return results, errs
}

// CompleteBatch is Complete for each of leases with results[i], in order.
func (m *MemoryStore) CompleteBatch(ctx context.Context, leases []Lease, results [][]byte) []error {
	errs := make([]error, len(leases))
	for i, l := range leases {
		if len(results) != len(leases) {
			errs[i] = fmt.Errorf("lock: complete batch: %d results for %d leases", len(results), len(leases))
			continue
		}
		errs[i] = m.Complete(ctx, l, results[i])
	}
	return errs
}
