package lock

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// pipelineCounter counts the pipelines that carry script calls or native
// Acquires, and the records they work on.
type pipelineCounter struct{ pipelines, scripts atomic.Int64 }

func (h *pipelineCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *pipelineCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return next
}
func (h *pipelineCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		store := false
		for _, cmd := range cmds {
			switch cmd.Name() {
			case "evalsha":
				h.scripts.Add(int64(cmd.Args()[2].(int))) // records worked on
				store = true
			case "pexpiretime": // one per native Acquire
				h.scripts.Add(1)
				store = true
			}
		}
		if store {
			h.pipelines.Add(1)
		}
		return next(ctx, cmds)
	}
}

// Concurrent calls share pipelines, and each gets its own answer: a script
// error on one key does not fail the others in its pipeline.
func TestBatcherCoalescesAndIsolates(t *testing.T) {
	client := testenv.RedisClient(t)
	var hook pipelineCounter
	client.AddHook(&hook)
	s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// A record key holding the wrong type (a hash, as records were before
	// format 1) makes its script fail.
	poisoned := recordKey(s.cfg.Prefix, "poisoned")
	if err := client.HSet(ctx, poisoned, "s", "p").Err(); err != nil {
		t.Fatal(err)
	}
	if err := client.Expire(ctx, poisoned, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}

	const n = 400
	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make([]error, n)
	results := make([]Result, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			key := fmt.Sprint("k", i)
			if i == n/2 {
				key = "poisoned"
			}
			results[i], errs[i] = s.Acquire(ctx, Request{Key: key})
			if errs[i] == nil {
				errs[i] = s.Complete(ctx, results[i].Lease, []byte(key))
			}
		}()
	}
	close(start)
	wg.Wait()
	for i := range n {
		if i == n/2 {
			if errs[i] == nil || !strings.Contains(errs[i].Error(), "WRONGTYPE") {
				t.Errorf("poisoned key: got %v, want its own WRONGTYPE error", errs[i])
			}
			continue
		}
		if errs[i] != nil || results[i].Status != Acquired {
			t.Fatalf("call %d: %v %v", i, results[i].Status, errs[i])
		}
	}
	for i := range n {
		if i == n/2 {
			continue
		}
		res, err := s.Acquire(ctx, Request{Key: fmt.Sprint("k", i)})
		if err != nil || res.Status != Completed || string(res.Value) != fmt.Sprint("k", i) {
			t.Fatalf("key k%d afterwards: %v %q %v", i, res.Status, res.Value, err)
		}
	}
	p, c := hook.pipelines.Load(), hook.scripts.Load()
	t.Logf("%d records worked on in %d pipelines", c, p)
	if c < 2*n-1 || p >= c {
		t.Fatalf("%d calls in %d pipelines: want them coalesced", c, p)
	}
}

// A caller whose context ends while it waits for a turn gets ctx.Err() and
// is never sent; the others go on.
func TestBatcherWaiterGivesUp(t *testing.T) {
	// A server of its own: the test blocks it on purpose.
	client := testenv.RedisServer(t).Client(t)
	s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	// Fill every slot with a script that blocks the server for a moment.
	slow := redis.NewScript(`local t = redis.call('TIME') local stop = tonumber(t[1]) * 1000000 + tonumber(t[2]) + 200000
		repeat t = redis.call('TIME') until tonumber(t[1]) * 1000000 + tonumber(t[2]) >= stop return {1}`)
	var wg sync.WaitGroup
	for range maxInFlight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.batch.run(context.Background(), slow, []string{"slow"}); err != nil {
				t.Error(err)
			}
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		s.batch.mu.Lock()
		full := s.batch.running == maxInFlight
		s.batch.mu.Unlock()
		if full || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err = s.Acquire(ctx, Request{Key: "impatient"})
	if err == nil || ctx.Err() == nil {
		t.Fatalf("Acquire with an expired context while all slots are busy: %v", err)
	}
	wg.Wait()
	res, err := s.Acquire(context.Background(), Request{Key: "impatient"})
	if err != nil || res.Status != Acquired || res.Lease.Attempt != 1 {
		t.Fatalf("the abandoned call was sent anyway: %v attempt %d %v", res.Status, res.Lease.Attempt, err)
	}
	s.batch.mu.Lock()
	defer s.batch.mu.Unlock()
	if s.batch.running != 0 || len(s.batch.waiting) != 0 {
		t.Fatalf("batcher left running=%d waiting=%d", s.batch.running, len(s.batch.waiting))
	}
}

// A first Acquire whose context is already cancelled does not make the
// store give up merging and the native path for good: the server is asked
// again next time.
func TestBatcherAsksAgainAfterCancel(t *testing.T) {
	// ContextTimeoutEnabled: go-redis heeds the context, as lock's doc
	// advises.
	client := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t), ContextTimeoutEnabled: true})
	t.Cleanup(func() { client.Close() })
	s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	_, _ = s.Acquire(cancelled, Request{Key: "k"})
	if !s.batch.merging(context.Background()) || !s.batch.native(context.Background()) {
		t.Fatal("merging or the native path turned off by a cancelled context")
	}
}
