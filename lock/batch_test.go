package lock

import (
	"context"
	"errors"
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
	// The one-time INFO probe first: made by the Acquire below, it would
	// wait behind the slow scripts on this client (which does not heed
	// contexts) until they were done and a slot free again, and the
	// Acquire would then be sent (3 runs in 20 with -race failed so).
	if !s.batch.merging(context.Background()) {
		t.Fatal("a standalone test server is not merged")
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

// amendCounter records the most keys one amend script call carried.
type amendCounter struct{ most atomic.Int64 }

func (h *amendCounter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *amendCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return next
}
func (h *amendCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if a := cmd.Args(); cmd.Name() == "evalsha" && a[1] == amendScript.Hash() {
				if n := int64(a[2].(int)); n > h.most.Load() {
					h.most.Store(n)
				}
			}
		}
		return next(ctx, cmds)
	}
}

// Amends that wait for a turn together go out as one script call over
// all their keys, and each key gets its own answer: a record amended, one
// already holding the value, one of another fence, value or state, none,
// another key's record (a hash collision) and a key holding a hash are
// answered apart, and only the first two change.
func TestBatcherMergesAmends(t *testing.T) {
	// A server of its own: the test blocks it on purpose.
	client := testenv.RedisServer(t).Client(t)
	var hook amendCounter
	client.AddHook(&hook)
	s, err := NewRedisStore(client, Config{Prefix: testenv.Name(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	complete := func(key, value string) Lease {
		t.Helper()
		res, err := s.Acquire(ctx, Request{Key: key})
		if err != nil || res.Status != Acquired {
			t.Fatalf("Acquire(%s): %v %v", key, res.Status, err)
		}
		if err := s.Complete(ctx, res.Lease, []byte(value)); err != nil {
			t.Fatalf("Complete(%s): %v", key, err)
		}
		return res.Lease
	}
	type amend struct {
		key          string
		fence        int64
		old, value   string
		want         error  // nil, or the sentinel the answer wraps
		stored       string // the record's value afterwards, when completed
		noRecordKept bool   // the key has no record of its own
	}
	var cases []amend
	for i := range 4 {
		key := fmt.Sprint("ok-", i)
		l := complete(key, "v0")
		cases = append(cases, amend{key: key, fence: l.Fence, old: "v0", value: fmt.Sprint("v1-", i), stored: fmt.Sprint("v1-", i)})
	}
	l := complete("already", "v1")
	cases = append(cases, amend{key: "already", fence: l.Fence, old: "v0", value: "v1", stored: "v1"})
	l = complete("other-fence", "v0")
	cases = append(cases, amend{key: "other-fence", fence: l.Fence - 1, old: "v0", value: "v1", want: ErrChanged, stored: "v0"})
	l = complete("other-value", "v2")
	cases = append(cases, amend{key: "other-value", fence: l.Fence, old: "v0", value: "v1", want: ErrChanged, stored: "v2"})
	res, err := s.Acquire(ctx, Request{Key: "running"})
	if err != nil || res.Status != Acquired {
		t.Fatalf("Acquire(running): %v %v", res.Status, err)
	}
	cases = append(cases, amend{key: "running", fence: res.Lease.Fence, old: "", value: "v1", want: ErrChanged})
	cases = append(cases, amend{key: "absent", fence: l.Fence, old: "v0", value: "v1", want: ErrChanged, noRecordKept: true})
	// A collision: the record of "ok-0" at the Redis key of "collided".
	raw, err := client.Get(ctx, recordKey(s.cfg.Prefix, "ok-0")).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := client.Set(ctx, recordKey(s.cfg.Prefix, "collided"), raw, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	cases = append(cases, amend{key: "collided", fence: cases[0].fence, old: "v0", value: "v1", want: ErrKeyCollision, noRecordKept: true})
	// A key holding a hash, as records were before format 1.
	poisoned := recordKey(s.cfg.Prefix, "poisoned")
	if err := client.HSet(ctx, poisoned, "s", "c").Err(); err != nil {
		t.Fatal(err)
	}
	if err := client.Expire(ctx, poisoned, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	cases = append(cases, amend{key: "poisoned", fence: l.Fence, old: "v0", value: "v1", want: ErrBadRecord, noRecordKept: true})

	// Fill every slot with a script that blocks the server for a moment,
	// so that every Amend waits for a turn, and they all go out together.
	slow := redis.NewScript(`local t = redis.call('TIME') local stop = tonumber(t[1]) * 1000000 + tonumber(t[2]) + 200000
		repeat t = redis.call('TIME') until tonumber(t[1]) * 1000000 + tonumber(t[2]) >= stop return {1}`)
	var slowWG sync.WaitGroup
	for range maxInFlight {
		slowWG.Add(1)
		go func() {
			defer slowWG.Done()
			if _, err := s.batch.run(ctx, slow, []string{"slow"}); err != nil {
				t.Error(err)
			}
		}()
	}
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
			s.batch.mu.Lock()
			done := ok()
			s.batch.mu.Unlock()
			if done {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("waiting for %s: timed out", what)
			}
		}
	}
	waitFor("the slow scripts", func() bool { return s.batch.running == maxInFlight })
	errs := make([]error, len(cases))
	var wg sync.WaitGroup
	for i, c := range cases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = s.Amend(ctx, c.key, c.fence, []byte(c.old), []byte(c.value))
		}()
	}
	waitFor("the Amends to wait for a turn", func() bool { return len(s.batch.waiting) == len(cases) })
	wg.Wait()
	slowWG.Wait()

	if got, want := hook.most.Load(), int64(len(cases)); got != want {
		t.Fatalf("the largest amend script call carried %d keys, want all %d in one", got, want)
	}
	for i, c := range cases {
		switch {
		case c.want == nil && errs[i] != nil:
			t.Errorf("%s: got %v, want nil", c.key, errs[i])
		case c.want != nil && !errors.Is(errs[i], c.want):
			t.Errorf("%s: got %v, want %v", c.key, errs[i], c.want)
		case c.want == ErrChanged && (errors.Is(errs[i], ErrBadRecord) || errors.Is(errs[i], ErrKeyCollision)):
			t.Errorf("%s: got %v, want ErrChanged alone", c.key, errs[i])
		}
		if c.noRecordKept {
			continue
		}
		r, err := s.Inspect(ctx, c.key)
		switch {
		case err != nil:
			t.Errorf("%s afterwards: %v", c.key, err)
		case c.stored == "" && r.State != StateInProgress:
			t.Errorf("%s afterwards: %+v, want it still in progress", c.key, r)
		case c.stored != "" && (r.State != StateCompleted || string(r.Value) != c.stored):
			t.Errorf("%s afterwards: state %s value %q, want completed with %q", c.key, r.State, r.Value, c.stored)
		}
	}
	if got := client.Get(ctx, recordKey(s.cfg.Prefix, "collided")).Val(); got != raw {
		t.Error("the collided record changed")
	}
	if n, err := client.Exists(ctx, recordKey(s.cfg.Prefix, "absent")).Result(); err != nil || n != 0 {
		t.Errorf("Amend of an absent key made a record: %d %v", n, err)
	}
}
