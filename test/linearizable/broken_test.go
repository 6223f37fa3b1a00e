package linearizable_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// bugs are the defects a brokenStore can have.
type bugs struct {
	noFenceRaise  bool // a takeover keeps the old lease's fence
	noOwnerCheck  bool // Complete, Fail, Release, Cancel check neither owner nor fence
	earlyTakeover bool // a lease is taken over half way through its TTL
	amendNoCAS    bool // Amend ignores the old value it was given
}

// brokenStore is a small store of its own, for the mutation check: with
// no bugs it is a correct store (TestMutations runs it so, and wants ok),
// and each bug is one a real store could have.
type brokenStore struct {
	bugs bugs

	mu      sync.Mutex
	records map[string]*brokenRecord
	fences  map[string]int64 // the last fence of each key, across records
}

type brokenRecord struct {
	state       byte
	owner       string
	fence       int64
	deadline    time.Time
	attempts    int
	fingerprint string
	value       []byte
}

func newBrokenStore(b bugs) *brokenStore {
	return &brokenStore{bugs: b, records: map[string]*brokenRecord{}, fences: map[string]int64{}}
}

func (s *brokenStore) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	var b [8]byte
	_, _ = rand.Read(b[:])
	owner := hex.EncodeToString(b[:])
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	r := s.records[req.Key]
	if r == nil {
		r = &brokenRecord{fingerprint: req.Fingerprint}
		s.records[req.Key] = r
	} else {
		res := lock.Result{Fence: r.fence, Attempts: r.attempts}
		live := r.deadline.After(now)
		if s.bugs.earlyTakeover {
			live = r.deadline.Add(-req.TTL / 2).After(now)
		}
		switch {
		case req.Fingerprint != "" && r.fingerprint != "" && r.fingerprint != req.Fingerprint:
			res.Status = lock.Conflict
			return res, nil
		case r.state == 'c':
			res.Status, res.Value = lock.Completed, bytes.Clone(r.value)
			return res, nil
		case r.state == 'f':
			res.Status, res.Error = lock.Failed, string(r.value)
			return res, nil
		case r.state == 'p' && live:
			res.Status, res.Remaining = lock.InProgress, r.deadline.Sub(now)
			return res, nil
		}
	}
	takeover := r.state == 'p'
	r.state, r.owner, r.deadline = 'p', owner, now.Add(req.TTL)
	if !(s.bugs.noFenceRaise && takeover) {
		r.fence = max(s.fences[req.Key]+1, now.UnixMicro())
	}
	s.fences[req.Key] = r.fence
	r.attempts++
	l := lock.Lease{Key: req.Key, Owner: owner, Fence: r.fence, Attempt: r.attempts, TTL: req.TTL, Retention: req.Retention, Deadline: r.deadline}
	return lock.Result{Status: lock.Acquired, Lease: l, Fence: r.fence, Attempts: r.attempts}, nil
}

func (s *brokenStore) held(l lock.Lease) *brokenRecord {
	r := s.records[l.Key]
	if r == nil || (!s.bugs.noOwnerCheck && (r.owner != l.Owner || r.fence != l.Fence)) {
		return nil
	}
	return r
}

func (s *brokenStore) Extend(ctx context.Context, leases ...lock.Lease) []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	errs := make([]error, len(leases))
	for i, l := range leases {
		r := s.records[l.Key]
		if r == nil || r.owner != l.Owner || r.fence != l.Fence || r.state != 'p' {
			errs[i] = lock.ErrLeaseLost
			continue
		}
		r.deadline = time.Now().Add(l.TTL)
	}
	return errs
}

func (s *brokenStore) finish(l lock.Lease, state byte, value []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.held(l)
	switch {
	case r != nil && r.state == state && !s.bugs.noOwnerCheck:
		return nil
	case r == nil || r.state != 'p' && !s.bugs.noOwnerCheck:
		return fmt.Errorf("%w: key %q", lock.ErrLeaseLost, l.Key)
	}
	r.state, r.deadline = state, time.Time{}
	switch state {
	case 'c', 'f':
		r.value = value
	case 'x':
		r.attempts = max(r.attempts-1, 0)
	}
	return nil
}

func (s *brokenStore) Complete(ctx context.Context, l lock.Lease, result []byte) error {
	return s.finish(l, 'c', bytes.Clone(result))
}

func (s *brokenStore) Fail(ctx context.Context, l lock.Lease, reason string) error {
	return s.finish(l, 'f', []byte(reason))
}

func (s *brokenStore) Release(ctx context.Context, l lock.Lease) error { return s.finish(l, 'r', nil) }

func (s *brokenStore) Cancel(ctx context.Context, l lock.Lease) error { return s.finish(l, 'x', nil) }

func (s *brokenStore) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.records[key]
	switch {
	case r != nil && r.state == 'c' && r.fence == fence && bytes.Equal(r.value, value):
		return nil
	case r == nil || r.state != 'c' || r.fence != fence || (!s.bugs.amendNoCAS && !bytes.Equal(r.value, old)):
		return fmt.Errorf("%w: key %q", lock.ErrChanged, key)
	}
	r.value = bytes.Clone(value)
	return nil
}

func (s *brokenStore) Inspect(ctx context.Context, key string) (lock.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.records[key]
	if r == nil {
		return lock.Record{}, fmt.Errorf("%w: key %q", lock.ErrNotFound, key)
	}
	rec := lock.Record{Key: key, State: lock.StateOf(r.state), Owner: r.owner, Fence: r.fence, Attempts: r.attempts, Fingerprint: r.fingerprint}
	switch r.state {
	case 'p':
		rec.LeaseLeft = max(time.Until(r.deadline), 0)
	case 'c':
		rec.Value = bytes.Clone(r.value)
	case 'f':
		rec.Error = string(r.value)
	}
	return rec, nil
}

func (s *brokenStore) Forget(ctx context.Context, key string, state lock.State, fence int64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.records[key]
	switch {
	case r == nil:
		return fmt.Errorf("%w: key %q", lock.ErrNotFound, key)
	case r.state != state.Letter() || r.fence != fence:
		return fmt.Errorf("%w: key %q", lock.ErrChanged, key)
	}
	delete(s.records, key)
	return nil
}

// TestMutations is the mutation check: the checker must find each
// deliberately broken store not linearizable, and the same store without
// its bug linearizable (so that the verdict is the bug's).
func TestMutations(t *testing.T) {
	for _, tc := range []struct {
		name string
		bugs bugs
		want string
	}{
		{"correct", bugs{}, "ok"},
		{"no-fence-raise", bugs{noFenceRaise: true}, "violation"},
		{"no-owner-check", bugs{noOwnerCheck: true}, "violation"},
		{"early-takeover", bugs{earlyTakeover: true}, "violation"},
		{"amend-no-cas", bugs{amendNoCAS: true}, "violation"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("LINEARIZABLE_DIR", t.TempDir()) // expected violations: not kept
			w := linearizable.Workload{Clients: 4, Keys: 6, Ops: 1500, Duration: 5 * time.Second, TTL: 20 * time.Millisecond, Timeout: time.Second, Seed: seed()}
			run := linearizable.Start(newBrokenStore(tc.bugs), w)
			res := check(t, "mutant-"+tc.name, linearizable.Params{Early: lock.DeadlineSlack, Late: time.Millisecond}, w, run.History())
			if got := res.Verdict(); got != tc.want {
				t.Errorf("%s: result=%s, want %s (seed %d)", tc.name, got, tc.want, w.Seed)
			}
		})
	}
}
