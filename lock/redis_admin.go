package lock

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed scripts/inspect.lua
	inspectLua    string
	inspectScript = redis.NewScript(recordLua + inspectLua)

	//go:embed scripts/forget.lua
	forgetLua    string
	forgetScript = redis.NewScript(recordLua + forgetLua)
)

var _ Admin = (*RedisStore)(nil)

// Inspect reads key's record in one atomic script, with the lease time
// left and the expiry by the server's clock. Location is the record's
// Redis key.
func (s *RedisStore) Inspect(ctx context.Context, key string) (Record, error) {
	if err := checkKey(key); err != nil {
		return Record{}, err
	}
	rkey := recordKey(s.cfg.Prefix, key)
	reply, err := inspectScript.Run(ctx, s.client, []string{rkey}, key).Slice()
	if err != nil {
		return Record{}, fmt.Errorf("lock: inspect %q: %w", key, adminError(err))
	}
	switch {
	case len(reply) == 0:
		return Record{}, fmt.Errorf("%w: key %q (redis key %s)", ErrNotFound, key, rkey)
	case len(reply) == 1:
		return Record{}, fmt.Errorf("%w: key %q (redis key %s)", ErrKeyCollision, key, rkey)
	case len(reply) != 11:
		return Record{}, fmt.Errorf("%w: key %q: inspect answered %d fields", ErrBadRecord, key, len(reply))
	}
	str := func(v any) string { s, _ := v.(string); return s }
	num := func(v any) int64 { n, _ := v.(int64); return n }
	ms := func(v any) time.Time {
		if n := num(v); n > 0 {
			return time.UnixMilli(n)
		}
		return time.Time{}
	}
	r := Record{
		Key:         key,
		Owner:       str(reply[2]),
		Fence:       num(reply[3]),
		LeaseLeft:   time.Duration(num(reply[4])) * time.Millisecond,
		Attempts:    int(num(reply[5])),
		Fingerprint: str(reply[6]),
		Created:     ms(reply[7]),
		Ended:       ms(reply[8]),
		ExpiresIn:   time.Duration(max(num(reply[10]), 0)) * time.Millisecond,
		Location:    "redis key " + rkey,
	}
	if st := str(reply[1]); len(st) == 1 {
		r.State = stateOf(st[0])
	} else {
		r.State = State(fmt.Sprintf("unknown(%q)", st))
	}
	switch r.State {
	case StateCompleted:
		r.Value = []byte(str(reply[9]))
	case StateFailed:
		r.Error = str(reply[9])
	}
	return r, nil
}

// Forget deletes key's record if it is still in state with fence, in one
// atomic script. The record becomes a tombstone that lasts one second and
// keeps only the key and the fence, so that a record made again at once
// still gets a higher fence; Inspect, Forget and Acquire see no record.
func (s *RedisStore) Forget(ctx context.Context, key string, state State, fence int64) error {
	if err := checkKey(key); err != nil {
		return err
	}
	letter := state.Letter()
	if letter == 0 {
		return fmt.Errorf("lock: forget %q: %q is not a record state", key, state)
	}
	rkey := recordKey(s.cfg.Prefix, key)
	n, err := forgetScript.Run(ctx, s.client, []string{rkey}, key, string(letter), fence).Int()
	switch {
	case err != nil:
		return fmt.Errorf("lock: forget %q: %w", key, adminError(err))
	case n == 0:
		return fmt.Errorf("%w: key %q (redis key %s)", ErrNotFound, key, rkey)
	case n == -1:
		return fmt.Errorf("%w: key %q is no longer %s with fence %d; inspect it again", ErrChanged, key, state, fence)
	case n == -2:
		return fmt.Errorf("%w: key %q (redis key %s)", ErrKeyCollision, key, rkey)
	}
	return nil
}

// adminError classifies an Inspect or Forget error: ErrUnavailable when the
// server did not answer, ErrBadRecord for a script's error about the
// record, else err itself.
func adminError(err error) error {
	var re redis.Error
	if errors.As(err, &re) && !isUnavailable(err) {
		return keyError(err)
	}
	return classify(err)
}
