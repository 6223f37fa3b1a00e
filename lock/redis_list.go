package lock

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

var _ Lister = (*RedisStore)(nil)

// List reads one SCAN step of the store's records (MATCH "<prefix>:{*",
// COUNT req.Scan) and, in one pipeline, each record found and the
// server's clock; the cursor is SCAN's. Record keys are hashes: the
// caller's key is read from the record, which holds it, and req.Prefix is
// applied to it after reading. Records that are in no state (a forgotten
// record's one-second tombstone) and values that do not decode as a
// record are passed over.
//
// On a Redis Cluster client it lists the masters one after the other, in
// the order of their addresses, each as above; the cursor is the master's
// place in that order and its SCAN cursor ("2:1536"). A cluster whose
// masters change during a listing may skip or repeat records.
func (s *RedisStore) List(ctx context.Context, req ListRequest) (ListPage, error) {
	req, err := req.Check()
	if err != nil {
		return ListPage{}, err
	}
	cc, cluster := s.client.(*redis.ClusterClient)
	if !cluster {
		var cursor uint64
		if req.Cursor != "" {
			if cursor, err = strconv.ParseUint(req.Cursor, 10, 64); err != nil || cursor == 0 {
				return ListPage{}, fmt.Errorf("%w: %q", ErrBadCursor, req.Cursor)
			}
		}
		page, next, err := s.listNode(ctx, s.client, req, cursor)
		if next != 0 {
			page.Next = strconv.FormatUint(next, 10)
		}
		return page, err
	}
	node, cursor := 0, uint64(0)
	if req.Cursor != "" {
		n, c, ok := strings.Cut(req.Cursor, ":")
		node, err = strconv.Atoi(n)
		if err == nil {
			cursor, err = strconv.ParseUint(c, 10, 64)
		}
		if !ok || err != nil || node < 0 {
			return ListPage{}, fmt.Errorf("%w: %q", ErrBadCursor, req.Cursor)
		}
	}
	var mu sync.Mutex
	var masters []*redis.Client
	err = cc.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		masters = append(masters, c)
		return nil
	})
	if err != nil {
		return ListPage{}, fmt.Errorf("lock: list: %w", classify(err))
	}
	slices.SortFunc(masters, func(a, b *redis.Client) int { return strings.Compare(a.Options().Addr, b.Options().Addr) })
	if node >= len(masters) {
		return ListPage{}, fmt.Errorf("%w: %q names master %d of %d", ErrBadCursor, req.Cursor, node, len(masters))
	}
	page, next, err := s.listNode(ctx, masters[node], req, cursor)
	switch {
	case next != 0:
		page.Next = strconv.Itoa(node) + ":" + strconv.FormatUint(next, 10)
	case node+1 < len(masters):
		page.Next = strconv.Itoa(node+1) + ":0"
	}
	return page, err
}

// listNode is one SCAN step of client, a server (or a cluster's master),
// from cursor, with the records it found; next is SCAN's next cursor.
func (s *RedisStore) listNode(ctx context.Context, client redis.Cmdable, req ListRequest, cursor uint64) (ListPage, uint64, error) {
	keys, next, err := client.Scan(ctx, cursor, globEscape(s.cfg.Prefix)+":{*", int64(req.Scan)).Result()
	if err != nil {
		return ListPage{}, 0, fmt.Errorf("lock: list: %w", classify(err))
	}
	page := ListPage{Scanned: len(keys)}
	if len(keys) == 0 {
		return page, next, nil
	}
	pipe := client.Pipeline()
	clock := pipe.Time(ctx)
	gets := make([]*redis.StringCmd, len(keys))
	exps := make([]*redis.DurationCmd, len(keys))
	for i, k := range keys {
		gets[i] = pipe.Get(ctx, k)
		exps[i] = pipe.PExpireTime(ctx, k)
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		// A key that expired between SCAN and GET is redis.Nil in its
		// own command; any other error is the pipeline's.
		if !isNilOnly(gets, err) {
			return ListPage{}, 0, fmt.Errorf("lock: list: %w", classify(err))
		}
	}
	now := clock.Val()
	nowMs := now.UnixMilli()
	for i, k := range keys {
		raw, err := gets[i].Result()
		if err != nil { // gone meanwhile, or not a string
			continue
		}
		expireAt := int64(exps[i].Val() / time.Millisecond)
		if exps[i].Val() < 0 {
			expireAt = -1
		}
		r, err := decodeRecord(raw, expireAt)
		if err != nil || len(r.state) != 1 || stateOf(r.state[0]).Letter() == 0 || !req.Keep(r.key, r.state[0]) {
			continue
		}
		rec := Record{Key: r.key, State: stateOf(r.state[0]), Owner: r.owner, Fence: r.fence, Attempts: int(r.attempts),
			Fingerprint: r.fingerprint, Location: "redis key " + k}
		if r.created > 0 {
			rec.Created = time.UnixMilli(r.created)
		}
		if r.ended > 0 {
			rec.Ended = time.UnixMilli(r.ended)
		}
		if expireAt > 0 {
			rec.ExpiresIn = time.Duration(max(expireAt-nowMs, 0)) * time.Millisecond
		}
		switch rec.State {
		case StateInProgress:
			rec.LeaseLeft = time.Duration(max(r.deadline-nowMs, 0)) * time.Millisecond
		case StateCompleted:
			if req.Values {
				rec.Value = []byte(r.value)
			}
		case StateFailed:
			rec.Error = r.value
		}
		page.Records = append(page.Records, rec)
	}
	return page, next, nil
}

// isNilOnly reports whether err, a pipeline's error, is only a GET of a
// key that was gone (redis.Nil) or held another type.
func isNilOnly(gets []*redis.StringCmd, err error) bool {
	for _, g := range gets {
		if e := g.Err(); e != nil && e != redis.Nil && !strings.HasPrefix(e.Error(), "WRONGTYPE") {
			return false
		}
	}
	return err == redis.Nil || strings.HasPrefix(err.Error(), "WRONGTYPE")
}

// globEscape escapes the characters of s that SCAN's MATCH reads as a
// pattern.
func globEscape(s string) string {
	var b strings.Builder
	for _, c := range []byte(s) {
		switch c {
		case '*', '?', '[', ']', '\\', '^', '-':
			b.WriteByte('\\')
		}
		b.WriteByte(c)
	}
	return b.String()
}
