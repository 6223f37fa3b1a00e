package lock

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
)

var (
	// recordLua reads and writes records; every script that touches one
	// starts with it.
	//go:embed scripts/record.lua
	recordLua string

	//go:embed scripts/acquire.lua
	acquireLua    string
	acquireScript = redis.NewScript(recordLua + acquireLua)

	//go:embed scripts/extend.lua
	extendLua    string
	extendScript = redis.NewScript(recordLua + extendLua)

	//go:embed scripts/finish.lua
	finishLua    string
	finishScript = redis.NewScript(recordLua + finishLua)

	//go:embed scripts/amend.lua
	amendLua    string
	amendScript = redis.NewScript(recordLua + amendLua)
)

// Record states as the scripts write them.
const (
	stateCompleted = "c"
	stateFailed    = "f"
	stateReleased  = "r"
	stateCancelled = "x" // released, and the attempt its Acquire counted taken back
)

// RedisStore is a Store on Redis: one string value per idempotency key,
// made by one atomic transaction or a Lua script and changed only by Lua
// scripts, so that every transition is atomic and judged by the server's
// clock. It works with any redis.UniversalClient: a standalone
// server, a Sentinel failover client or a Cluster client.
//
// A record is binary: a MessagePack sequence of a format version (1, or 2
// for a record Acquire made without a script), state, owner, fence, lease
// deadline, attempts, fingerprint, the caller's key, created and ended
// times (server ms) and the stored value, written with SET ... PX so that
// record and expiry change in one command, or with SET ... KEEPTTL by
// Amend, which keeps the expiry (scripts/record.lua documents the layout;
// the package doc says when each format is written). Inspect one with GET
// and a MessagePack decoder; HGETALL does not apply. A record of another
// format version, or an old-style hash, is an error for its key alone.
//
// RedisStore is safe for concurrent use.
type RedisStore struct {
	client redis.UniversalClient
	cfg    Config
	batch  batcher // Acquire, Complete, Fail, Release, Cancel and Amend calls

	// warnedMu guards warned: per server address, what Check last warned
	// about ("" while nothing), so that a Check that finds the same again
	// (a Consumer's Run checks after the user's own Check, each member of
	// a Group too) does not repeat it.
	warnedMu sync.Mutex
	warned   map[string]string
}

var _ Store = (*RedisStore)(nil)

// NewRedisStore returns a store that keeps its records in client. It makes
// no network call; call Check once at start.
func NewRedisStore(client redis.UniversalClient, cfg Config) (*RedisStore, error) {
	if client == nil {
		return nil, errors.New("lock: nil redis client")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if _, cluster := client.(*redis.ClusterClient); cluster && cfg.Replicas > 0 {
		return nil, errors.New("lock: Config.Replicas is not supported on a Redis Cluster client (WAIT applies to one connection's node)")
	}
	cfg = cfg.WithDefaults()
	return &RedisStore{client: client, cfg: cfg, batch: batcher{client: client, replicas: cfg.Replicas, replicaTimeout: cfg.ReplicaTimeout}}, nil
}

// Check pings the server, loads the scripts and reads maxmemory-policy on
// every master. A policy other than noeviction is logged as a warning: an
// evicted record is a duplicate execution waiting to happen. A server that
// refuses CONFIG GET (some managed services do) is logged too. Each of
// these is logged once per server by a store, and again only when what
// Check finds there changes (the policy set to another, or back): a
// Consumer's Run checks too, after the Check its user made. Check
// returns an error only when the server cannot be reached or the scripts
// cannot be loaded.
func (s *RedisStore) Check(ctx context.Context) error {
	check := func(ctx context.Context, c *redis.Client) error {
		if err := c.Ping(ctx).Err(); err != nil {
			return fmt.Errorf("lock: redis %s: %w", c.Options().Addr, err)
		}
		for _, sc := range []*redis.Script{acquireScript, extendScript, finishScript, amendScript} {
			if err := sc.Load(ctx, c).Err(); err != nil {
				return fmt.Errorf("lock: redis %s: loading script: %w", c.Options().Addr, err)
			}
		}
		addr := c.Options().Addr
		policy, err := c.ConfigGet(ctx, "maxmemory-policy").Result()
		switch {
		case err != nil:
			if s.warnOnce(addr, "unreadable") {
				s.cfg.Logger.WarnContext(ctx, "lock: cannot read maxmemory-policy; make sure it is noeviction",
					"addr", addr, "error", err)
			}
		case policy["maxmemory-policy"] != "noeviction":
			if s.warnOnce(addr, "policy "+policy["maxmemory-policy"]) {
				s.cfg.Logger.WarnContext(ctx, "lock: maxmemory-policy is not noeviction: evicted records cause duplicate executions",
					"addr", addr, "maxmemory-policy", policy["maxmemory-policy"])
			}
		default:
			s.warnOnce(addr, "")
		}
		return nil
	}
	switch c := s.client.(type) {
	case *redis.ClusterClient:
		return c.ForEachMaster(ctx, check)
	case *redis.Client:
		return check(ctx, c)
	default:
		// A Ring or a wrapper: check what can be checked through the interface.
		if err := c.Ping(ctx).Err(); err != nil {
			return fmt.Errorf("lock: redis: %w", err)
		}
		return nil
	}
}

// warnOnce records what Check found at addr (what, "" for nothing to
// warn of) and reports whether it differs from what it found last, so
// that a warning is logged once until it changes.
func (s *RedisStore) warnOnce(addr, what string) bool {
	s.warnedMu.Lock()
	defer s.warnedMu.Unlock()
	if s.warned[addr] == what {
		return false
	}
	if s.warned == nil {
		s.warned = make(map[string]string)
	}
	s.warned[addr] = what
	return true
}

// Ping checks that the server answers (every master of a Cluster), for a
// readiness check: cheaper than Check, and silent.
func (s *RedisStore) Ping(ctx context.Context) error {
	ping := func(ctx context.Context, c *redis.Client) error {
		if err := c.Ping(ctx).Err(); err != nil {
			return fmt.Errorf("lock: redis %s: %w", c.Options().Addr, classify(err))
		}
		return nil
	}
	if c, ok := s.client.(*redis.ClusterClient); ok {
		return c.ForEachMaster(ctx, ping)
	}
	if err := s.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("lock: redis: %w", classify(err))
	}
	return nil
}

// Acquire takes a lease on req.Key in one round trip, shared with the
// concurrent calls of other goroutines, or two when the record is in
// progress, released or expired (a native transaction, then the acquire
// script; see the package doc).
//
// An Acquire whose reply is lost may have taken the lease: it is sent again
// with the same owner token, which the script answers with that same lease
// (no second attempt counted). go-redis resends after a broken connection
// or a timeout (unless its MaxRetries is -1); when the error still comes
// through (ErrUnavailable), Acquire itself tries again up to 3 times over
// about 350 ms, within ctx. A per-key error (ErrBadRecord), an answer, or
// ctx ending is not retried, nor is an error saying the call never left
// the client (a failed dial, a pool timeout) while no earlier try may
// have reached the server, so that a dead store fails fast; go-redis's own
// resends can hide such an earlier send. If the tries all fail, Acquire
// returns an error wrapping ErrUnavailable, and a lease it may have taken
// blocks the key for its TTL, with its attempt counted.
func (s *RedisStore) Acquire(ctx context.Context, req Request) (Result, error) {
	req, err := s.cfg.CheckRequest(req)
	if err != nil {
		return Result{}, err
	}
	var owner [32]byte // hex digits; a string only in a lease granted
	newOwner(&owner)
	return RetryAcquire(ctx, func(ctx context.Context) (Result, error) { return s.acquire(ctx, req, &owner) }, notSent)
}

// MaxResultSize is the largest result Complete accepts, in bytes.
func (s *RedisStore) MaxResultSize() int { return s.cfg.MaxResultSize }

// acquire takes a lease for a checked request and owner token: natively
// where it can, with the acquire script where it must.
func (s *RedisStore) acquire(ctx context.Context, req Request, owner *[32]byte) (Result, error) {
	start := s.cfg.Now()
	rkey := recordKey(s.cfg.Prefix, req.Key)
	if s.batch.native(ctx) {
		res, done, err := s.nativeAcquire(ctx, req, owner, rkey, start)
		switch {
		case done:
			return res, nil
		case err == nil:
			// The record needs the server's clock: the script decides.
		case scriptCannotHelp(err):
			return Result{}, err
		default:
			// The transaction was refused where a script may not be
			// (a write refused under OOM still lets the script answer
			// a duplicate; an ACL or a proxy may refuse MULTI).
			s.nativeRefused(ctx, err)
			// A refused MULTI leaves its SET run alone: it may have
			// made a record of this owner's, which only the script
			// tells. It runs whatever ctx says, or that record would
			// block the key for a TTL, its Acquire answered with the
			// refusal.
			ctx = context.WithoutCancel(ctx)
		}
	}
	c := scriptCall(req, owner, rkey)
	s.batch.do(ctx, c)
	reply, err := c.val, c.err
	putCall(c)
	return scriptReply(req, owner, "", rkey, start, reply, err)
}

// scriptCall returns the acquire script's call for a checked request, from
// the pool.
func scriptCall(req Request, owner *[32]byte, rkey string) *call {
	c := getCall(acquireScript, rkey, 5)
	c.str(0, string(owner[:]))
	c.int(1, req.TTL.Milliseconds())
	c.int(2, req.Retention.Milliseconds())
	c.str(3, req.Fingerprint)
	c.str(4, req.Key)
	return c
}

// scriptReply turns the acquire script's reply (or err) for req into
// Acquire's answer; start is the local time before the call was sent.
func scriptReply(req Request, owner *[32]byte, ownerStr string, rkey string, start time.Time, reply any, err error) (Result, error) {
	if err != nil {
		return Result{}, fmt.Errorf("lock: acquire %q: %w", req.Key, classify(err))
	}
	vals, _ := reply.([]any)
	if len(vals) != 5 {
		return Result{}, fmt.Errorf("lock: acquire %q: unexpected reply %v", req.Key, vals)
	}
	status, _ := vals[0].(int64)
	fence, _ := vals[1].(int64)
	attempts, _ := vals[2].(int64)
	remaining, _ := vals[3].(int64)
	value, _ := vals[4].(string)

	res := Result{Status: Status(status), Fence: fence, Attempts: int(attempts)}
	switch res.Status {
	case Acquired:
		res.Lease = newLease(req, ownerString(owner, ownerStr), fence, int(attempts), start, rkey)
	case Completed:
		res.Value = []byte(value)
	case Failed:
		res.Error = value
	case InProgress:
		res.Remaining = time.Duration(remaining) * time.Millisecond
	case Conflict:
	case 6:
		return Result{}, fmt.Errorf("%w: key %q", ErrKeyCollision, req.Key)
	default:
		return Result{}, fmt.Errorf("lock: acquire %q: unexpected status %d", req.Key, status)
	}
	return res, nil
}

func newLease(req Request, owner string, fence int64, attempt int, start time.Time, rkey string) Lease {
	return Lease{
		Key:       req.Key,
		Owner:     owner,
		Fence:     fence,
		Attempt:   attempt,
		TTL:       req.TTL,
		Retention: req.Retention,
		Deadline:  start.Add(req.TTL - DeadlineSlack), // the server rounds its start down
		rkey:      rkey,
	}
}

// nativeAcquire is Acquire without a script, for the two commonest cases:
// an absent key, and a completed or failed record (a duplicate). In one
// transaction, SET rkey <format 2 record> NX PX TTL+retention GET creates
// the record if there is none and otherwise returns the one there, and
// PEXPIRETIME reads the key's expiry, from which the server's times and a
// new record's fence follow (scripts/record.lua). A record in progress,
// released, cancelled or forgotten needs the server's clock to decide:
// done is false and the caller runs the acquire script. The decisions
// are the script's, in the same order: collision, conflict, outcome.
func (s *RedisStore) nativeAcquire(ctx context.Context, req Request, owner *[32]byte, rkey string, start time.Time) (res Result, done bool, err error) {
	c := nativeCall(req, owner, rkey)
	s.batch.do(ctx, c)
	set, exp, err := c.val, c.exp, c.err
	putCall(c)
	return nativeReply(req, owner, "", rkey, start, set, exp, err)
}

// nativeCall returns the native Acquire's call for a checked request, from
// the pool: the record it makes if there is none, and its expiry in ms.
func nativeCall(req Request, owner *[32]byte, rkey string) *call {
	ttl := req.TTL.Milliseconds()
	keep := ttl + req.Retention.Milliseconds()
	c := getCall(nil, rkey, 2)
	c.slots[0] = appendRecord(c.slots[0][:0], string(owner[:]), ttl, keep, req.Fingerprint, req.Key)
	c.args[0] = &c.slots[0]
	c.int(1, keep)
	return c
}

// nativeReply turns a native Acquire's replies (SET's and PEXPIRETIME's,
// or err) for req into Acquire's answer, or done false when the acquire
// script must decide (see nativeAcquire).
func nativeReply(req Request, owner *[32]byte, ownerStr string, rkey string, start time.Time, set, exp any, err error) (res Result, done bool, _ error) {
	if err != nil {
		return Result{}, false, fmt.Errorf("lock: acquire %q: %w", req.Key, classify(err))
	}
	keep := req.TTL.Milliseconds() + req.Retention.Milliseconds()
	expireAt, _ := exp.(int64)
	if expireAt == 0 {
		return Result{}, false, fmt.Errorf("lock: acquire %q: unexpected reply %v", req.Key, []any{set, exp})
	}
	if set == nil {
		fence := firstFence(expireAt, keep)
		l := newLease(req, ownerString(owner, ownerStr), fence, 1, start, rkey)
		l.made, l.fp = true, req.Fingerprint
		return Result{Status: Acquired, Fence: fence, Attempts: 1, Lease: l}, true, nil
	}
	raw, _ := set.(string)
	r, err := decodeRecord(raw, expireAt)
	switch {
	case err != nil:
		return Result{}, false, nil // the script reads it, or says what is wrong with it
	case r.key != req.Key:
		return Result{}, false, fmt.Errorf("%w: key %q", ErrKeyCollision, req.Key)
	}
	res = Result{Fence: r.fence, Attempts: int(r.attempts)}
	switch {
	case req.Fingerprint != "" && r.fingerprint != "" && r.fingerprint != req.Fingerprint:
		res.Status = Conflict
	case r.state == stateCompleted:
		res.Status, res.Value = Completed, []byte(r.value)
	case r.state == stateFailed:
		res.Status, res.Error = Failed, r.value
	default:
		return Result{}, false, nil
	}
	return res, true, nil
}

// writeRefusals start the error replies of a server that refuses writes
// for now (out of memory, a failed snapshot, too few replicas): the native
// Acquire is refused, the acquire script can still answer a duplicate.
var writeRefusals = []string{"OOM", "MISCONF", "NOREPLICAS"}

// nativeRefused notes that a native Acquire was refused as a whole. For a
// reason other than a refusal of writes (an ACL without MULTI, a proxy, a
// server replaced by an older one), every later Acquire of s runs the
// acquire script, and that is logged once.
func (s *RedisStore) nativeRefused(ctx context.Context, err error) {
	var re redis.Error
	if errors.As(err, &re) && hasPrefix(re.Error(), writeRefusals) {
		return
	}
	if s.batch.noNative.CompareAndSwap(false, true) {
		s.cfg.Logger.WarnContext(ctx, "lock: the server refused a native Acquire transaction; every Acquire now runs the acquire script",
			"error", err)
	}
}

// Extend renews the leases in one pipelined round trip (one per node on a
// Cluster), many leases per script call where the server allows.
func (s *RedisStore) Extend(ctx context.Context, leases ...Lease) []error {
	errs := make([]error, len(leases))
	calls := make([]*call, 0, len(leases))
	index := make([]int, 0, len(leases))
	for i, l := range leases {
		if errs[i] = CheckLease(l); errs[i] != nil {
			continue
		}
		calls = append(calls, newCall(extendScript, s.keyOf(l), extendArgs(l)...))
		index = append(index, i)
	}
	if len(calls) > 0 {
		s.batch.exec(ctx, calls)
	}
	for j, c := range calls {
		n, _ := c.val.(int64)
		errs[index[j]] = leaseReply(leases[index[j]], "extend", int(n), c.err)
	}
	return errs
}

func extendArgs(l Lease) []any {
	return []any{l.Owner, l.Fence, l.TTL.Milliseconds(), l.Retention.Milliseconds()}
}

// Complete stores result and marks the record completed.
func (s *RedisStore) Complete(ctx context.Context, lease Lease, result []byte) error {
	if len(result) > s.cfg.MaxResultSize {
		return fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", ErrResultTooLarge, lease.Key, len(result), s.cfg.MaxResultSize)
	}
	return s.finish(ctx, lease, "complete", stateCompleted, result, "")
}

// Fail marks the record failed with reason, cut to MaxResultSize bytes.
func (s *RedisStore) Fail(ctx context.Context, lease Lease, reason string) error {
	return s.finish(ctx, lease, "fail", stateFailed, nil, CutText(reason, s.cfg.MaxResultSize))
}

// Release gives the lease up, keeping the attempt count.
func (s *RedisStore) Release(ctx context.Context, lease Lease) error {
	return s.finish(ctx, lease, "release", stateReleased, nil, "")
}

// Cancel gives the lease up and takes back the attempt its Acquire counted.
// A retried Cancel that finds its own write answers nil and takes nothing
// back again.
func (s *RedisStore) Cancel(ctx context.Context, lease Lease) error {
	return s.finish(ctx, lease, "cancel", stateCancelled, nil, "")
}

// finish runs the finish script for l: state, and as the stored value
// result, or else text (both empty for a release or a cancel).
func (s *RedisStore) finish(ctx context.Context, l Lease, op string, state string, result []byte, text string) error {
	if err := CheckLease(l); err != nil {
		return err
	}
	c := s.finishCall(l, state, result, text)
	s.batch.do(ctx, c)
	n, _ := c.val.(int64)
	err := c.err
	putCall(c)
	return leaseReply(l, op, int(n), err)
}

// finishCall returns the finish script's call for l, from the pool: state,
// and as the stored value result, or else text (empty for a release or a
// cancel: the script stores neither). The lease is named by the start of
// the record to write, packed as the script would pack it (see
// finish.lua): its owner and fence, which the script unpacks where it
// must decode the record. For a lease whose record the native Acquire
// made, that start runs up to the new record's created time, and the call
// adds what the script needs to write the outcome without decoding the
// record: the record as that Acquire wrote it and its expiry.
func (s *RedisStore) finishCall(l Lease, state string, result []byte, text string) *call {
	c := getCall(finishScript, s.keyOf(l), 5)
	switch {
	case state == stateReleased || state == stateCancelled:
		c.args[1] = "" // the script writes a made record's value as given
	case text != "":
		c.args[1] = text
	default:
		c.bytes(1, result)
	}
	c.int(2, l.Retention.Milliseconds())
	ttl := l.TTL.Milliseconds()
	keep := ttl + l.Retention.Milliseconds()
	created := l.Fence/1000 - 1 // the ms a format 2 record's fence follows (firstFence)
	// The record's bytes and expiry, which the script compares, say
	// nothing of l.Fence but its ms: a Fence that is not the first µs
	// after one (changed by the caller) is judged by decoding, as any.
	if !l.made || firstFence(created+keep, keep) != l.Fence {
		c.slots[0] = appendLeaseHead(c.slots[0][:0], state, l.Owner, l.Fence)
		c.args[0] = &c.slots[0]
		c.args[3], c.args[4] = "", ""
		return c
	}
	attempts := int64(1) // a format 2 record's, whatever the caller did to l.Attempt
	if state == stateCancelled {
		attempts = 0
	}
	c.slots[0] = appendHead(c.slots[0][:0], state, l.Owner, l.Fence, attempts, l.fp, l.Key, created)
	c.args[0] = &c.slots[0]
	c.slots[3] = appendRecord(c.slots[3][:0], l.Owner, ttl, keep, l.fp, l.Key)
	c.args[3] = &c.slots[3]
	c.int(4, created+keep)
	return c
}

// Amend replaces the value of key's completed record with value if its
// fence is fence and its value is old (see Amender), in one script call
// (scripts/amend.lua) that keeps the key's expiry as the completion set
// it (SET ... KEEPTTL) and writes the record in format 1, as every script
// does. The call goes through the store's batcher: concurrent Amends share
// pipelines, and on a standalone server one script call over many keys,
// each key answered apart. go-redis resends a call whose reply was lost,
// which the script answers nil once it finds value there.
func (s *RedisStore) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if len(value) > s.cfg.MaxResultSize {
		return fmt.Errorf("%w: amend key %q: %d bytes, at most %d allowed", ErrResultTooLarge, key, len(value), s.cfg.MaxResultSize)
	}
	// A pooled call, as Complete's: the outbox amends once per delivery
	// that staged messages, and batcher.run's call and boxed arguments
	// were 8 of its heap objects.
	c := getCall(amendScript, recordKey(s.cfg.Prefix, key), 4)
	c.str(0, key)
	c.int(1, fence)
	c.bytes(2, old)
	// The call refers to one argument of the caller's only (ref): value
	// is copied into its slot, as str copies a string.
	c.slots[3] = append(c.slots[3][:0], value...)
	c.args[3] = &c.slots[3]
	s.batch.do(ctx, c)
	reply, err := c.val, c.err
	putCall(c)
	return amendReply(key, fence, reply, err)
}

// amendReply turns the amend script's reply for one key into an error.
func amendReply(key string, fence int64, reply any, err error) error {
	if err != nil {
		return fmt.Errorf("lock: amend %q: %w", key, classify(err))
	}
	switch n, ok := reply.(int64); {
	case !ok:
	case n == 1:
		return nil
	case n == 0:
		return fmt.Errorf("%w: amend key %q fence %d", ErrChanged, key, fence)
	case n == -1:
		return fmt.Errorf("%w: key %q", ErrKeyCollision, key)
	}
	return fmt.Errorf("lock: amend %q: unexpected reply %v", key, reply)
}

// leaseReply turns a compare-and-set script's reply into an error.
func leaseReply(l Lease, op string, n int, err error) error {
	switch {
	case err != nil:
		return fmt.Errorf("lock: %s %q: %w", op, l.Key, classify(err))
	case n != 1:
		return fmt.Errorf("%w: %s key %q fence %d", ErrLeaseLost, op, l.Key, l.Fence)
	}
	return nil
}

func isNoScript(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT")
}

// CutText cuts s to at most n bytes, ending it with "…(truncated)" when
// it was cut: how Fail shortens an error text longer than MaxResultSize.
// It cuts at the start of a rune, never in the middle of one, so that
// valid UTF-8 stays valid. Store implementations use it so that every
// store stores the same text.
func CutText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "…(truncated)"
	if n <= len(mark) {
		return s[:runeCut(s, n)]
	}
	return s[:runeCut(s, n-len(mark))] + mark
}

// runeCut returns where to cut s to at most n bytes (n < len(s)): n, or
// less so that the cut falls at the start of a rune. Where s is not
// UTF-8 (no rune starts within utf8.UTFMax bytes), it cuts at n.
func runeCut(s string, n int) int {
	for i := n; i >= 0 && i > n-utf8.UTFMax; i-- {
		if utf8.RuneStart(s[i]) {
			return i
		}
	}
	return n
}

// keyOf returns the Redis key of l's record, computed once by Acquire.
func (s *RedisStore) keyOf(l Lease) string {
	// Prefixes hold no '{', so "<prefix>:{" names this store's records only.
	if n := len(s.cfg.Prefix); len(l.rkey) > n+2 && l.rkey[:n] == s.cfg.Prefix && l.rkey[n:n+2] == ":{" {
		return l.rkey
	}
	return recordKey(s.cfg.Prefix, l.Key)
}
