package lock

import (
	"context"
	"slices"
)

var _ Lister = (*MemoryStore)(nil)

// List returns the records after req.Cursor in key order that pass req's
// filters, reading at most req.Scan of them; the cursor is the last key
// read. It goes over every key of the store under its lock to find them
// (a MemoryStore has no ordered index): a store for tests and single
// processes, not for millions of records.
func (m *MemoryStore) List(ctx context.Context, req ListRequest) (ListPage, error) {
	req, err := req.Check()
	if err != nil {
		return ListPage{}, err
	}
	if err := ctx.Err(); err != nil {
		return ListPage{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.cfg.Now()
	keys := make([]string, 0, min(len(m.records), req.Scan+1))
	for k, r := range m.records {
		if k > req.Cursor && now.Before(r.expires) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	var page ListPage
	if len(keys) > req.Scan {
		keys = keys[:req.Scan]
		page.Next = keys[len(keys)-1]
	}
	page.Scanned = len(keys)
	for _, k := range keys {
		r := m.records[k]
		if !req.Keep(k, r.state) {
			continue
		}
		rec := Record{Key: k, State: stateOf(r.state), Owner: r.owner, Fence: r.fence, Attempts: r.attempts,
			Fingerprint: r.fingerprint, Created: r.created, Ended: r.ended, ExpiresIn: r.expires.Sub(now), Location: "memory"}
		switch r.state {
		case 'p':
			rec.LeaseLeft = max(r.deadline.Sub(now), 0)
		case 'c':
			if req.Values {
				rec.Value = append([]byte(nil), r.value...)
			}
		case 'f':
			rec.Error = string(r.value)
		}
		page.Records = append(page.Records, rec)
	}
	return page, nil
}
