package lock_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/storetest"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

func newRedisStore(t *testing.T, client redis.UniversalClient, cfg lock.Config) *lock.RedisStore {
	t.Helper()
	s, err := lock.NewRedisStore(client, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestRedisStore(t *testing.T) {
	client := testenv.RedisClient(t)
	storetest.Run(t, func(t *testing.T, cfg lock.Config) lock.Store {
		return newRedisStore(t, client, cfg)
	})
}

// The same suite with every Acquire through the acquire script, as on a
// Cluster or a Redis older than 7.0: the script path stays a full store on
// its own, and reads the format 2 records the native path leaves.
func TestRedisStoreScriptOnly(t *testing.T) {
	client := testenv.RedisClient(t)
	storetest.Run(t, func(t *testing.T, cfg lock.Config) lock.Store {
		s := newRedisStore(t, client, cfg)
		lock.DisableNative(s)
		return s
	})
}

func TestRedisStoreCluster(t *testing.T) {
	client := testenv.RedisCluster(t).Client(t)
	storetest.Run(t, func(t *testing.T, cfg lock.Config) lock.Store {
		s := newRedisStore(t, client, cfg)
		if err := s.Check(context.Background()); err != nil {
			t.Fatal(err)
		}
		return s
	})
}

// A client whose clock is wrong cannot take a live lease: expiry is judged
// by the server's clock alone.
func TestRedisClientClockIsNotTrusted(t *testing.T) {
	client := testenv.RedisClient(t)
	prefix := testenv.Name(t)
	honest := newRedisStore(t, client, lock.Config{Prefix: prefix})
	ahead := newRedisStore(t, client, lock.Config{Prefix: prefix,
		Now: func() time.Time { return time.Now().Add(time.Hour) }})

	ctx := context.Background()
	held, err := honest.Acquire(ctx, lock.Request{Key: "k", TTL: 400 * time.Millisecond})
	if err != nil || held.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", held.Status, err)
	}
	res, err := ahead.Acquire(ctx, lock.Request{Key: "k", TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != lock.InProgress {
		t.Fatalf("client an hour ahead: got %v, want in_progress", res.Status)
	}
	// Once the server says the lease expired, anyone may take over.
	time.Sleep(500 * time.Millisecond)
	res, err = ahead.Acquire(ctx, lock.Request{Key: "k", TTL: time.Minute})
	if err != nil || res.Status != lock.Acquired || res.Lease.Fence <= held.Lease.Fence {
		t.Fatalf("after server-side expiry: %+v %v", res, err)
	}
}

// flakyConn loses the reply of the first command written after arm(): the
// server executes the command, the client sees a broken connection, and
// go-redis retries on a new connection.
type flakyConn struct {
	net.Conn
	armed *atomic.Bool
	lose  bool
}

func (c *flakyConn) Write(b []byte) (int, error) {
	if c.armed.CompareAndSwap(true, false) {
		c.lose = true
	}
	return c.Conn.Write(b)
}

func (c *flakyConn) Read(b []byte) (int, error) {
	if c.lose {
		// Wait for the reply so the command has surely run, then drop it.
		_ = c.Conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, _ = c.Conn.Read(b)
		c.Conn.Close()
		return 0, net.ErrClosed
	}
	return c.Conn.Read(b)
}

// wrapDialer dials as go-redis does and wraps each connection for fault
// injection.
func wrapDialer(wrap func(net.Conn) net.Conn) func(context.Context, string, string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return wrap(c), nil
	}
}

func TestRedisAcquireRetryAfterLostReply(t *testing.T) {
	addr := testenv.RedisAddr(t)
	var armed atomic.Bool
	client := redis.NewClient(&redis.Options{
		Addr:       addr,
		MaxRetries: 3,
		Dialer:     wrapDialer(func(c net.Conn) net.Conn { return &flakyConn{Conn: c, armed: &armed} }),
	})
	t.Cleanup(func() { client.Close() })
	s := newRedisStore(t, client, lock.Config{Prefix: testenv.Name(t)})
	if err := s.Check(context.Background()); err != nil { // loads the scripts
		t.Fatal(err)
	}

	for _, op := range []string{"acquire", "complete"} {
		key := "retry-" + op
		var res lock.Result
		var err error
		if op == "acquire" {
			armed.Store(true)
		}
		res, err = s.Acquire(context.Background(), lock.Request{Key: key})
		if err != nil {
			t.Fatalf("%s: Acquire: %v", op, err)
		}
		if res.Status != lock.Acquired || res.Lease.Attempt != 1 {
			t.Fatalf("%s: retried Acquire: got %v attempt %d, want acquired attempt 1", op, res.Status, res.Lease.Attempt)
		}
		if op == "complete" {
			armed.Store(true)
		}
		if err := s.Complete(context.Background(), res.Lease, []byte("ok")); err != nil {
			t.Fatalf("%s: Complete: %v", op, err)
		}
		if armed.Load() {
			t.Fatalf("%s: the fault was never injected", op)
		}
	}
}

func TestRedisExtendIsOnePipeline(t *testing.T) {
	client := testenv.RedisClient(t)
	var pipelines, commands atomic.Int64
	client.AddHook(countHook{pipelines: &pipelines, commands: &commands})
	s := newRedisStore(t, client, lock.Config{Prefix: testenv.Name(t)})
	ctx := context.Background()
	var leases []lock.Lease
	for i := range 100 {
		res, err := s.Acquire(ctx, lock.Request{Key: "k" + strings.Repeat("x", i)})
		if err != nil {
			t.Fatal(err)
		}
		leases = append(leases, res.Lease)
	}
	pipelines.Store(0)
	commands.Store(0)
	for i, err := range s.Extend(ctx, leases...) {
		if err != nil {
			t.Fatalf("lease %d: %v", i, err)
		}
	}
	if p, c := pipelines.Load(), commands.Load(); p != 1 || c != 0 {
		t.Fatalf("Extend of 100 leases: %d pipelines and %d single commands, want 1 and 0", p, c)
	}

	// After the server forgets its scripts (a restart or failover), the
	// batch still works.
	if err := client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	pipelines.Store(0)
	commands.Store(0)
	for i, err := range s.Extend(ctx, leases...) {
		if err != nil {
			t.Fatalf("after SCRIPT FLUSH, lease %d: %v", i, err)
		}
	}
	if p, c := pipelines.Load(), commands.Load(); p != 2 || c != 0 {
		t.Fatalf("Extend after SCRIPT FLUSH: %d pipelines and %d single commands, want 2 (NOSCRIPT, then again) and 0", p, c)
	}
}

// countHook counts script round trips: pipelines and single commands.
type countHook struct{ pipelines, commands *atomic.Int64 }

func (h countHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScript(cmd) {
			h.commands.Add(1)
		}
		return next(ctx, cmd)
	}
}
func (h countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && isScript(cmds[0]) {
			h.pipelines.Add(1)
		}
		return next(ctx, cmds)
	}
}

// isScript tells the store's commands from the ones go-redis sends on its
// own (HELLO and CLIENT SETINFO on each new connection).
func isScript(cmd redis.Cmder) bool {
	return cmd.Name() == "evalsha" || cmd.Name() == "eval"
}

func TestRedisCheckWarnsOnEviction(t *testing.T) {
	srv := testenv.RedisServer(t, "--maxmemory-policy", "allkeys-lru")
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { client.Close() })

	var mu sync.Mutex
	var logs bytes.Buffer
	logger := slog.New(slog.NewTextHandler(&lockedWriter{mu: &mu, w: &logs}, nil))
	s := newRedisStore(t, client, lock.Config{Logger: logger})
	if err := s.Check(context.Background()); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	got := logs.String()
	mu.Unlock()
	if !strings.Contains(got, "level=WARN") || !strings.Contains(got, "allkeys-lru") {
		t.Fatalf("Check with allkeys-lru logged %q, want a warning naming the policy", got)
	}

	// warnings counts the WARN lines Check logs with the policy set (""
	// leaves it as it is).
	warnings := func(policy string) int {
		t.Helper()
		if policy != "" {
			if err := client.ConfigSet(context.Background(), "maxmemory-policy", policy).Err(); err != nil {
				t.Fatal(err)
			}
		}
		mu.Lock()
		logs.Reset()
		mu.Unlock()
		if err := s.Check(context.Background()); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		defer mu.Unlock()
		return strings.Count(logs.String(), "level=WARN")
	}
	// A Consumer's Run checks again after its user's Check: the same
	// finding is not warned about twice, a changed one is.
	if n := warnings(""); n != 0 {
		t.Fatalf("a second Check with allkeys-lru logged %d warnings, want 0 (logged once already)", n)
	}
	if n := warnings("volatile-lru"); n != 1 {
		t.Fatalf("Check after the policy changed to volatile-lru logged %d warnings, want 1", n)
	}
	if n := warnings("noeviction"); n != 0 {
		t.Fatalf("Check with noeviction logged %d warnings (%q), want none", n, logs.String())
	}
	if n := warnings("volatile-lru"); n != 1 {
		t.Fatalf("Check after the policy went back from noeviction to volatile-lru logged %d warnings, want 1", n)
	}

	srv.Stop()
	if err := s.Check(context.Background()); err == nil {
		t.Fatal("Check against a stopped server: got nil error")
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.w.Write(b)
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name  string
		cfg   lock.Config
		field string
	}{
		{"zero is valid", lock.Config{}, ""},
		{"brace in prefix", lock.Config{Prefix: "a{b"}, "Prefix"},
		{"long prefix", lock.Config{Prefix: strings.Repeat("p", 65)}, "Prefix"},
		{"negative TTL", lock.Config{LeaseTTL: -1}, "LeaseTTL"},
		{"sub-ms TTL", lock.Config{LeaseTTL: time.Microsecond}, "LeaseTTL"},
		{"negative retention", lock.Config{Retention: -time.Hour}, "Retention"},
		{"negative result size", lock.Config{MaxResultSize: -1}, "MaxResultSize"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if tc.field == "" {
				if err != nil {
					t.Fatalf("got %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), "Config."+tc.field) {
				t.Fatalf("got %v, want an error naming Config.%s", err, tc.field)
			}
			if _, err := lock.NewRedisStore(redis.NewClient(&redis.Options{}), tc.cfg); err == nil {
				t.Fatal("NewRedisStore accepted the config")
			}
			if _, err := lock.NewMemoryStore(tc.cfg); err == nil {
				t.Fatal("NewMemoryStore accepted the config")
			}
		})
	}
	if _, err := lock.NewRedisStore(nil, lock.Config{}); err == nil {
		t.Fatal("NewRedisStore(nil): got nil error")
	}
}

func TestStatusString(t *testing.T) {
	for s, want := range map[lock.Status]string{
		lock.Acquired: "acquired", lock.Completed: "completed", lock.Failed: "failed",
		lock.InProgress: "in_progress", lock.Conflict: "conflict", 0: "status(0)",
	} {
		if got := s.String(); got != want {
			t.Errorf("Status(%d): got %q, want %q", int(s), got, want)
		}
	}
}

// Nothing lives forever: every record has an expiry, TTL+Retention while
// a lease is held, Retention after the outcome.
func TestRedisRecordsExpire(t *testing.T) {
	client := testenv.RedisClient(t)
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: 10 * time.Second, Retention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	keys, err := client.Keys(ctx, prefix+":*").Result()
	if err != nil || len(keys) != 1 {
		t.Fatalf("record keys: %v %v", keys, err)
	}
	ttl := client.PTTL(ctx, keys[0]).Val()
	if ttl <= time.Hour || ttl > time.Hour+10*time.Second {
		t.Fatalf("in progress: PTTL %v, want about 1h10s", ttl)
	}
	if err := s.Complete(ctx, res.Lease, nil); err != nil {
		t.Fatal(err)
	}
	ttl = client.PTTL(ctx, keys[0]).Val()
	if ttl <= time.Hour-time.Minute || ttl > time.Hour {
		t.Fatalf("completed: PTTL %v, want about 1h", ttl)
	}
}

// A record is one string, a MessagePack sequence led by its format
// version, with its expiry set by the same SET: format 2 as the native
// Acquire writes it, format 1 once a script rewrote it. A record of an
// unknown version is an error for its key alone, never read as something
// else.
func TestRedisRecordFormat(t *testing.T) {
	client := testenv.RedisClient(t)
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k", TTL: 10 * time.Second, Retention: time.Hour})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	keys, err := client.Keys(ctx, prefix+":*").Result()
	if err != nil || len(keys) != 1 {
		t.Fatalf("record keys: %v %v", keys, err)
	}
	rkey := keys[0]
	if typ := client.Type(ctx, rkey).Val(); typ != "string" {
		t.Fatalf("record type %q, want string", typ)
	}
	// Format 2: fence 0, the TTL and the PX in place of the deadline
	// and the created time; the fence is the first µs after the ms the
	// key's expiry counts from.
	raw := []byte(client.Get(ctx, rkey).Val())
	const ttl, keep = 10_000, 10_000 + 3_600_000
	v2 := append([]byte{0x02, 0xa1, 'p', 0xd9, 0x20}, res.Lease.Owner...)
	v2 = append(v2, 0x00, 0xcd, ttl>>8, ttl&0xff, 0x01, 0xa0, 0xa1, 'k', 0xce, 0, keep>>16, keep>>8&0xff, keep&0xff, 0x00, 0xa0)
	if !bytes.Equal(raw, v2) {
		t.Fatalf("record %x, want format 2 %x", raw, v2)
	}
	expireAt := client.PExpireTime(ctx, rkey).Val().Milliseconds()
	if want := (expireAt - keep + 1) * 1000; res.Lease.Fence != want {
		t.Fatalf("format 2 fence %d, want %d from PEXPIRETIME %d", res.Lease.Fence, want, expireAt)
	}
	if err := s.Extend(ctx, res.Lease)[0]; err != nil {
		t.Fatal(err)
	}
	raw = []byte(client.Get(ctx, rkey).Val())
	if len(raw) == 0 || raw[0] != 0x01 {
		t.Fatalf("record %q after Extend: want a msgpack sequence led by version 1", raw)
	}
	// The fence (server µs, about 1.8e15) is packed as a MessagePack
	// uint64, exact, not as a float: after version 0x01, state "p" (fixstr
	// 0xa1 'p') and the 32-byte owner (str8 0xd9 0x20 ...).
	const at = 1 + 2 + 2 + 32
	if len(raw) < at+9 || raw[at] != 0xcf || int64(binary.BigEndian.Uint64(raw[at+1:])) != res.Lease.Fence {
		t.Fatalf("record %x: want fence %d packed as uint64 (0xcf) at byte %d", raw, res.Lease.Fence, at)
	}
	// set overwrites field i (1-based: 1 version ... 6 attempts) of the record.
	set := func(i, v int) {
		t.Helper()
		err := client.Eval(ctx, `local r = {cmsgpack.unpack(redis.call('GET', KEYS[1]))}
			r[tonumber(ARGV[1])] = tonumber(ARGV[2])
			return redis.call('SET', KEYS[1], cmsgpack.pack(unpack(r)), 'KEEPTTL')`,
			[]string{rkey}, i, v).Err()
		if err != nil {
			t.Fatal(err)
		}
	}

	// Attempts never go below zero.
	set(6, 0)
	if err := s.Cancel(ctx, res.Lease); err != nil {
		t.Fatal(err)
	}
	res, err = s.Acquire(ctx, lock.Request{Key: "k", TTL: 10 * time.Second, Retention: time.Hour})
	if err != nil || res.Status != lock.Acquired || res.Attempts != 1 || res.Lease.Fence < 2 {
		t.Fatalf("after Cancel at 0 attempts: %+v %v, want attempt 1 and a higher fence", res, err)
	}

	other, err := s.Acquire(ctx, lock.Request{Key: "other"})
	if err != nil || other.Status != lock.Acquired {
		t.Fatalf("Acquire other: %v %v", other.Status, err)
	}
	set(1, 3)
	if _, err := s.Acquire(ctx, lock.Request{Key: "k"}); !errors.Is(err, lock.ErrBadRecord) || !strings.Contains(err.Error(), "version 3") {
		t.Fatalf("Acquire of a version 3 record: got %v, want a format error", err)
	}
	errs := s.Extend(ctx, res.Lease, other.Lease)
	if errs[0] == nil || errors.Is(errs[0], lock.ErrLeaseLost) || errs[1] != nil {
		t.Fatalf("Extend of a version 3 record and a good one: %v", errs)
	}
	for name, err := range map[string]error{
		"Complete": s.Complete(ctx, res.Lease, nil),
		"Cancel":   s.Cancel(ctx, res.Lease),
		"Amend":    s.Amend(ctx, "k", res.Lease.Fence, nil, []byte("v")),
	} {
		if err == nil || errors.Is(err, lock.ErrLeaseLost) || !strings.Contains(err.Error(), "version 3") {
			t.Fatalf("%s of a version 3 record: got %v, want a format error", name, err)
		}
	}
}

// A record forgotten and made again at once gets a fence above the
// forgotten one's even when that fence is ahead of the clock (as a
// format 2 record's is, by up to a millisecond): Forget keeps it in a
// tombstone, and Inspect and Forget see no record meanwhile.
func TestRedisForgetKeepsTheFence(t *testing.T) {
	client := testenv.RedisClient(t)
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k"})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	if err := s.Fail(ctx, res.Lease, "no"); err != nil {
		t.Fatal(err)
	}
	// Put the fence an hour ahead, as format 1.
	ahead := time.Now().Add(time.Hour).UnixMicro()
	keys := client.Keys(ctx, prefix+":*").Val()
	if len(keys) != 1 {
		t.Fatalf("record keys: %v", keys)
	}
	err = client.Eval(ctx, `local r = {cmsgpack.unpack(redis.call('GET', KEYS[1]))}
		r[4] = tonumber(ARGV[1])
		return redis.call('SET', KEYS[1], cmsgpack.pack(unpack(r)), 'KEEPTTL')`, keys, ahead).Err()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Forget(ctx, "k", lock.StateFailed, ahead); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Inspect(ctx, "k"); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Inspect after Forget: %v, want ErrNotFound", err)
	}
	if err := s.Forget(ctx, "k", lock.StateFailed, ahead); !errors.Is(err, lock.ErrNotFound) {
		t.Fatalf("Forget after Forget: %v, want ErrNotFound", err)
	}
	again, err := s.Acquire(ctx, lock.Request{Key: "k"})
	if err != nil || again.Status != lock.Acquired || again.Lease.Attempt != 1 || again.Lease.Fence <= ahead {
		t.Fatalf("Acquire after Forget: %v attempt %d fence %d %v, want attempt 1 and a fence above %d",
			again.Status, again.Lease.Attempt, again.Lease.Fence, err, ahead)
	}
	if pttl := client.PTTL(ctx, keys[0]).Val(); pttl < time.Hour {
		t.Fatalf("the new record expires in %v, want its own TTL and retention", pttl)
	}
}

// A native Acquire transaction the server refuses is answered by the
// acquire script instead. Refused writes (OOM) leave the native path on, so
// that duplicates are answered while Redis is full, as the script path
// always did; a refusal of MULTI itself (an ACL) turns it off for good.
func TestRedisNativeRefused(t *testing.T) {
	srv := testenv.RedisServer(t)
	client := srv.Client(t)
	ctx := context.Background()
	s := newRedisStore(t, client, lock.Config{Prefix: "refused"})
	res, err := s.Acquire(ctx, lock.Request{Key: "done"})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	if err := s.Complete(ctx, res.Lease, []byte("result")); err != nil {
		t.Fatal(err)
	}

	// Full: every write refused.
	if err := client.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	dup, err := s.Acquire(ctx, lock.Request{Key: "done"})
	if err != nil || dup.Status != lock.Completed || string(dup.Value) != "result" {
		t.Fatalf("duplicate while Redis is full: %v %q %v, want completed", dup.Status, dup.Value, err)
	}
	if _, err := s.Acquire(ctx, lock.Request{Key: "new"}); err == nil || !strings.Contains(err.Error(), "OOM") {
		t.Fatalf("new key while Redis is full: %v, want the OOM error", err)
	}
	if err := client.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	if !lock.NativeEnabled(s) {
		t.Fatal("native Acquire turned off by refused writes")
	}

	// An ACL without MULTI.
	if err := client.Do(ctx, "ACL", "SETUSER", "nomulti", "on", "nopass", "~*", "+@all", "-multi").Err(); err != nil {
		t.Fatal(err)
	}
	limited := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: "nomulti", Password: "any"})
	t.Cleanup(func() { limited.Close() })
	ls := newRedisStore(t, limited, lock.Config{Prefix: "refused"})
	// MULTI refused, SET runs alone and makes the record: the script
	// finds it the caller's own.
	if res, err := ls.Acquire(ctx, lock.Request{Key: "fresh"}); err != nil || res.Status != lock.Acquired || res.Lease.Attempt != 1 {
		t.Fatalf("new key, MULTI refused: %v attempt %d %v, want acquired, attempt 1", res.Status, res.Lease.Attempt, err)
	}
	for i := range 2 {
		dup, err = ls.Acquire(ctx, lock.Request{Key: "done"})
		if err != nil || dup.Status != lock.Completed {
			t.Fatalf("duplicate %d without MULTI: %v %v, want completed", i, dup.Status, err)
		}
	}
	if lock.NativeEnabled(ls) {
		t.Fatal("native Acquire still on after MULTI was refused")
	}
	if res, err := ls.Acquire(ctx, lock.Request{Key: "other"}); err != nil || res.Status != lock.Acquired {
		t.Fatalf("new key without MULTI: %v %v", res.Status, err)
	}
}

// Amend rewrites a completed record in format 1 with nothing changed but
// the value, and keeps the key's expiry to the millisecond (SET ...
// KEEPTTL): the retention the completion set, not a new one.
func TestRedisAmendKeepsRecordAndExpiry(t *testing.T) {
	client := testenv.RedisClient(t)
	prefix := testenv.Name(t)
	s := newRedisStore(t, client, lock.Config{Prefix: prefix})
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: "k", Fingerprint: "fp", Retention: time.Hour})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	if err := s.Complete(ctx, res.Lease, []byte("v0")); err != nil {
		t.Fatal(err)
	}
	keys := client.Keys(ctx, prefix+":*").Val()
	if len(keys) != 1 {
		t.Fatalf("record keys: %v", keys)
	}
	before := client.Get(ctx, keys[0]).Val()
	expireAt := client.PExpireTime(ctx, keys[0]).Val()
	time.Sleep(20 * time.Millisecond) // a new expiry would differ
	if err := s.Amend(ctx, "k", res.Lease.Fence, []byte("v0"), []byte("v1")); err != nil {
		t.Fatal(err)
	}
	after := client.Get(ctx, keys[0]).Val()
	// The value is last, packed as a 2-byte fixstr (0xa2): all bytes
	// before it are the same.
	if len(after) != len(before) || after[0] != 0x01 || after[:len(after)-2] != before[:len(before)-2] || after[len(after)-2:] != "v1" {
		t.Fatalf("record after Amend %x, want %x with the value v1", after, before)
	}
	if got := client.PExpireTime(ctx, keys[0]).Val(); got != expireAt {
		t.Fatalf("expiry after Amend %v, want %v as the completion set it", got, expireAt)
	}
}

// An Amend whose reply was lost is resent by go-redis; the resend finds
// the value written and answers nil, not ErrChanged.
func TestRedisAmendRetryAfterLostReply(t *testing.T) {
	var armed atomic.Bool
	client := redis.NewClient(&redis.Options{
		Addr:       testenv.RedisAddr(t),
		MaxRetries: 3,
		Dialer:     wrapDialer(func(c net.Conn) net.Conn { return &flakyConn{Conn: c, armed: &armed} }),
	})
	t.Cleanup(func() { client.Close() })
	s := newRedisStore(t, client, lock.Config{Prefix: testenv.Name(t)})
	ctx := context.Background()
	if err := s.Check(ctx); err != nil { // loads the scripts
		t.Fatal(err)
	}
	res, err := s.Acquire(ctx, lock.Request{Key: "k"})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	if err := s.Complete(ctx, res.Lease, []byte("v0")); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	if err := s.Amend(ctx, "k", res.Lease.Fence, []byte("v0"), []byte("v1")); err != nil {
		t.Fatalf("Amend with its reply lost: %v, want nil", err)
	}
	if armed.Load() {
		t.Fatal("the fault was never injected")
	}
	dup, err := s.Acquire(ctx, lock.Request{Key: "k"})
	if err != nil || dup.Status != lock.Completed || string(dup.Value) != "v1" {
		t.Fatalf("after the retried Amend: %v %q %v, want completed with v1", dup.Status, dup.Value, err)
	}
}
