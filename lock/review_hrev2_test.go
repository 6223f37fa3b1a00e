package lock

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// cmdPrinter records how go-redis prints each command of the store's
// pipelines (cmd.String, what hooks that log or trace commands show).
type cmdPrinter struct {
	mu      sync.Mutex
	printed []string
}

func (h *cmdPrinter) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *cmdPrinter) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *cmdPrinter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.mu.Lock()
		for _, c := range cmds {
			h.printed = append(h.printed, c.String())
		}
		h.mu.Unlock()
		return next(ctx, cmds)
	}
}

// TestRedisBatchCommandsPrintTheirKeys: a hook that logs or traces the
// store's commands (cmd.String, as redisotel and go-redis's own logging
// print them) sees each record's key, on the native path and the
// script's. Since 67e5b8d the key is boxed as a *string, which go-redis's
// AppendArg does not know and prints with fmt.Sprint: a pointer's address
// (0xc000...), not the key.
func TestRedisBatchCommandsPrintTheirKeys(t *testing.T) {
	for _, native := range []bool{true, false} {
		name := map[bool]string{true: "native", false: "script"}[native]
		t.Run(name, func(t *testing.T) {
			client := testenv.RedisClient(t)
			var hook cmdPrinter
			client.AddHook(&hook)
			s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
			if err != nil {
				t.Fatal(err)
			}
			s.batch.noNative.Store(!native)
			ctx := context.Background()
			reqs := []Request{{Key: "a", TTL: time.Minute}, {Key: "b", TTL: time.Minute}}
			_, errs := s.AcquireBatch(ctx, reqs)
			for i, err := range errs {
				if err != nil {
					t.Fatalf("AcquireBatch %d: %v", i, err)
				}
			}
			hook.mu.Lock()
			all := strings.Join(hook.printed, "\n")
			hook.mu.Unlock()
			for _, r := range reqs {
				if rk := recordKey(s.cfg.Prefix, r.Key); !strings.Contains(all, rk) {
					t.Errorf("no command printed with record key %s (of %q); the commands printed:\n%s", rk, r.Key, all)
				}
			}
		})
	}
}

// TestBatchKeysEachRequestItsOwn: newBatchKeys, with requests that failed
// their check between those sent (zeros in their place) and a prefix of
// the longest length allowed, gives each request sent its own owner token
// (the string of its owners bytes) and its own record key, never a
// neighbour's.
func TestBatchKeysEachRequestItsOwn(t *testing.T) {
	for _, prefix := range []string{"", "p", strings.Repeat("x", maxPrefixLen)} {
		reqs := make([]Request, 50)
		var todo []int
		for i := range reqs {
			reqs[i].Key = strings.Repeat("k", i%7) + string(rune('a'+i%26))
			if i%3 != 1 {
				todo = append(todo, i)
			}
		}
		k := newBatchKeys(prefix, reqs, todo)
		owners := map[string]bool{}
		for _, i := range todo {
			o := k.owner(i)
			if o != string(k.owners[i][:]) || owners[o] || len(o) != 32 {
				t.Fatalf("prefix %d bytes, request %d: owner %q (its bytes %q), seen before %v", len(prefix), i, o, k.owners[i][:], owners[o])
			}
			owners[o] = true
			if got, want := k.rkey(i), recordKey(prefix, reqs[i].Key); got != want {
				t.Fatalf("prefix %d bytes, request %d: record key %q, want %q", len(prefix), i, got, want)
			}
		}
	}
}
