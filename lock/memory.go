package lock

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// MemoryStore is a Store in this process's memory, with the same state
// machine and answers as RedisStore. It suits unit tests and single-process
// consumers; its records die with the process, so it gives no protection
// across restarts or between processes. Time is Config.Now.
//
// MemoryStore is safe for concurrent use.
type MemoryStore struct {
	cfg Config

	mu      sync.Mutex
	records map[string]*memRecord
	writes  int // writes since the last sweep of expired records
}

type memRecord struct {
	state       byte // 'p' in progress, 'c' completed, 'f' failed, 'r' released, 'x' cancelled
	owner       string
	fence       int64
	deadline    time.Time
	attempts    int
	fingerprint string
	value       []byte
	expires     time.Time
	created     time.Time
	ended       time.Time // zero until the first outcome
}

var _ Store = (*MemoryStore)(nil)

// NewMemoryStore returns an empty in-memory store.
func NewMemoryStore(cfg Config) (*MemoryStore, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Replicas != 0 {
		return nil, errors.New("lock: Config.Replicas is for a RedisStore; a MemoryStore has no replicas")
	}
	return &MemoryStore{cfg: cfg.WithDefaults(), records: make(map[string]*memRecord)}, nil
}

// Ping answers nil: the store is in memory.
func (m *MemoryStore) Ping(ctx context.Context) error { return nil }

// MaxResultSize is the largest result Complete accepts, in bytes.
func (m *MemoryStore) MaxResultSize() int { return m.cfg.MaxResultSize }

// get returns the live record of key, dropping it if it expired.
func (m *MemoryStore) get(key string, now time.Time) *memRecord {
	r := m.records[key]
	if r != nil && !now.Before(r.expires) {
		delete(m.records, key)
		return nil
	}
	return r
}

// wrote counts a write and, every so often, sweeps expired records so
// that nothing outlives its retention even if never read again.
func (m *MemoryStore) wrote(now time.Time) {
	m.writes++
	if m.writes < 1024 || m.writes < len(m.records) {
		return
	}
	m.writes = 0
	for k, r := range m.records {
		if !now.Before(r.expires) {
			delete(m.records, k)
		}
	}
}

// Acquire takes a lease on req.Key.
func (m *MemoryStore) Acquire(ctx context.Context, req Request) (Result, error) {
	req, err := m.cfg.CheckRequest(req)
	if err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	var owner [32]byte // as NewOwner's; a string only in a lease granted
	newOwner(&owner)
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.cfg.Now()
	r := m.get(req.Key, now)
	if r == nil {
		r = &memRecord{fingerprint: req.Fingerprint, created: now}
		m.records[req.Key] = r
	} else {
		res := Result{Fence: r.fence, Attempts: r.attempts}
		switch {
		case req.Fingerprint != "" && r.fingerprint != "" && r.fingerprint != req.Fingerprint:
			res.Status = Conflict
			return res, nil
		case r.state == 'c':
			res.Status, res.Value = Completed, append([]byte(nil), r.value...)
			return res, nil
		case r.state == 'f':
			res.Status, res.Error = Failed, string(r.value)
			return res, nil
		case r.state == 'p' && r.deadline.After(now):
			res.Status, res.Remaining = InProgress, r.deadline.Sub(now)
			return res, nil
		}
	}
	r.state, r.owner, r.deadline = 'p', string(owner[:]), now.Add(req.TTL)
	r.fence = max(r.fence+1, now.UnixMicro()) // as RedisStore: above a lost record's
	r.attempts++
	r.expires = r.deadline.Add(req.Retention)
	m.wrote(now)
	lease := Lease{Key: req.Key, Owner: r.owner, Fence: r.fence, Attempt: r.attempts,
		TTL: req.TTL, Retention: req.Retention, Deadline: now.Add(req.TTL)}
	return Result{Status: Acquired, Lease: lease, Fence: r.fence, Attempts: r.attempts}, nil
}

// Extend renews each lease.
func (m *MemoryStore) Extend(ctx context.Context, leases ...Lease) []error {
	errs := make([]error, len(leases))
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.cfg.Now()
	for i, l := range leases {
		if errs[i] = CheckLease(l); errs[i] != nil {
			continue
		}
		if errs[i] = ctx.Err(); errs[i] != nil {
			continue
		}
		r := m.held(l, now)
		if r == nil || r.state != 'p' {
			errs[i] = fmt.Errorf("%w: extend key %q fence %d", ErrLeaseLost, l.Key, l.Fence)
			continue
		}
		r.deadline = now.Add(l.TTL)
		r.expires = r.deadline.Add(l.Retention)
	}
	return errs
}

// held returns the record if lease l still owns it.
func (m *MemoryStore) held(l Lease, now time.Time) *memRecord {
	r := m.get(l.Key, now)
	if r == nil || r.owner != l.Owner || r.fence != l.Fence {
		return nil
	}
	return r
}

// Complete stores result and marks the record completed.
func (m *MemoryStore) Complete(ctx context.Context, lease Lease, result []byte) error {
	if len(result) > m.cfg.MaxResultSize {
		return fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", ErrResultTooLarge, lease.Key, len(result), m.cfg.MaxResultSize)
	}
	return m.finish(ctx, lease, "complete", 'c', append([]byte(nil), result...))
}

// Fail marks the record failed with reason, cut to MaxResultSize bytes.
func (m *MemoryStore) Fail(ctx context.Context, lease Lease, reason string) error {
	return m.finish(ctx, lease, "fail", 'f', []byte(CutText(reason, m.cfg.MaxResultSize)))
}

// Release gives the lease up, keeping the attempt count.
func (m *MemoryStore) Release(ctx context.Context, lease Lease) error {
	return m.finish(ctx, lease, "release", 'r', nil)
}

// Cancel gives the lease up and takes back the attempt its Acquire counted.
func (m *MemoryStore) Cancel(ctx context.Context, lease Lease) error {
	return m.finish(ctx, lease, "cancel", 'x', nil)
}

func (m *MemoryStore) finish(ctx context.Context, l Lease, op string, state byte, value []byte) error {
	if err := CheckLease(l); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.cfg.Now()
	r := m.held(l, now)
	switch {
	case r != nil && r.state == state:
		return nil // a retry of this same call
	case r == nil || r.state != 'p':
		return fmt.Errorf("%w: %s key %q fence %d", ErrLeaseLost, op, l.Key, l.Fence)
	}
	r.state, r.deadline, r.ended = state, time.Time{}, now
	switch state {
	case 'c', 'f':
		r.value = value
	case 'x':
		r.attempts = max(r.attempts-1, 0)
	}
	r.expires = now.Add(l.Retention)
	m.wrote(now)
	return nil
}

// Amend replaces the value of key's completed record with value if its
// fence is fence and its value is old (see Amender), under the store's
// lock. The record's expiry and every other field stay as they were.
func (m *MemoryStore) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if len(value) > m.cfg.MaxResultSize {
		return fmt.Errorf("%w: amend key %q: %d bytes, at most %d allowed", ErrResultTooLarge, key, len(value), m.cfg.MaxResultSize)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.cfg.Now()
	r := m.get(key, now)
	switch {
	case r != nil && r.state == 'c' && r.fence == fence && bytes.Equal(r.value, value):
		return nil // a retry of this same call, or the same bytes written by another
	case r == nil || r.state != 'c' || r.fence != fence || !bytes.Equal(r.value, old):
		return fmt.Errorf("%w: amend key %q fence %d", ErrChanged, key, fence)
	}
	r.value = append([]byte(nil), value...)
	m.wrote(now)
	return nil
}

var _ Admin = (*MemoryStore)(nil)

// Inspect returns key's record. Location is "memory".
func (m *MemoryStore) Inspect(ctx context.Context, key string) (Record, error) {
	if err := checkKey(key); err != nil {
		return Record{}, err
	}
	if err := ctx.Err(); err != nil {
		return Record{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.cfg.Now()
	r := m.get(key, now)
	if r == nil {
		return Record{}, fmt.Errorf("%w: key %q", ErrNotFound, key)
	}
	rec := Record{Key: key, State: stateOf(r.state), Owner: r.owner, Fence: r.fence, Attempts: r.attempts,
		Fingerprint: r.fingerprint, Created: r.created, Ended: r.ended, ExpiresIn: r.expires.Sub(now), Location: "memory"}
	switch r.state {
	case 'p':
		rec.LeaseLeft = max(r.deadline.Sub(now), 0)
	case 'c':
		rec.Value = append([]byte(nil), r.value...)
	case 'f':
		rec.Error = string(r.value)
	}
	return rec, nil
}

// Forget deletes key's record if it is still in state with fence.
func (m *MemoryStore) Forget(ctx context.Context, key string, state State, fence int64) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r := m.get(key, m.cfg.Now())
	switch {
	case r == nil:
		return fmt.Errorf("%w: key %q", ErrNotFound, key)
	case r.state != state.Letter() || r.fence != fence:
		return fmt.Errorf("%w: key %q is no longer %s with fence %d; inspect it again", ErrChanged, key, state, fence)
	}
	delete(m.records, key)
	return nil
}
