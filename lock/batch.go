package lock

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxInFlight bounds the pipelines one store has on the wire at once. Calls
// that arrive while they are all busy wait and go out together in the next
// one, so the busier the store, the bigger its batches and the fewer its
// round trips per call; an idle store sends each call at once. With 32
// handlers, 2 gave fewer round trips and less CPU per message than 4 in
// make bench, with no loss of throughput, and 1 fewer again than 2: Redis
// CPU per duplicate 8.1-8.8 µs against 11.7-13.5, per unique message
// 26.6-30.2 against 33.0-34.4 (issue 26, runs alternated in one session).
const maxInFlight = 1

// batchTimeout bounds one pipeline. No caller's context is used for it, so
// that one caller giving up cannot fail the others' calls.
const batchTimeout = 30 * time.Second

// batcher coalesces concurrent script calls into pipelines. There is no
// goroutine of its own: a caller that finds a free slot sends its call with
// every waiting one; when a pipeline returns and calls are waiting, the
// oldest waiter is handed the slot and sends the next pipeline.
//
// Each call gets its own reply: a pipeline is a transport, and one script's
// error does not touch another's answer. A transport error (the connection
// broke) fails every call of that pipeline alike; go-redis resends a
// pipeline after a network error, which the scripts make safe.
type batcher struct {
	client redis.UniversalClient
	// replicas, when above zero, adds WAIT replicas replicaTimeout to
	// every pipeline (see Config.Replicas).
	replicas       int
	replicaTimeout time.Duration

	noMerge    atomic.Bool  // a merged script call was refused where single ones went through
	standalone atomic.Int32 // 0 not known yet, 1 a standalone server (merge), 2 not (never merge)
	redis7     atomic.Bool  // the standalone server is Redis 7.0 or later (SET NX GET, PEXPIRETIME)
	noNative   atomic.Bool  // every Acquire through the script: set by tests, or once the server refused the native one

	mu      sync.Mutex
	waiting []*call
	running int

	pipes sync.Pool             // *pipe, see getPipe
	epoch atomic.Pointer[epoch] // see pipelineCtx
}

type call struct {
	script *redis.Script // nil: a native Acquire (see nativeAcquire)
	// keyArg is the record's Redis key for every command that names it:
	// a pointer to key, which boxes without an allocation; key holds a
	// copy of the key's bytes in the call's own buffer (kept by the pool).
	// go-redis sends it as the bytes (MarshalBinary), and prints it and
	// reads a Cluster slot's key through String: a *string would be sent
	// right but printed as a pointer's address to hooks that log or
	// trace commands (TestRedisBatchCommandsPrintTheirKeys).
	keyArg any
	key    bytesArg
	// args are the script's arguments for key; for a native Acquire the
	// record and its PX in ms. A call from getCall holds them in argBuf.
	args []any

	// ready receives one token when the call is answered, or handed the
	// turn (see do); it is buffered, so that a pooled call reuses it.
	ready chan struct{}
	turn  []*call // set before the token: the pipeline this call must send
	val   any     // the script's reply; a native Acquire's SET reply
	exp   any     // a native Acquire's PEXPIRETIME reply
	err   error

	setCmd, pexpCmd *redis.Cmd // a native Acquire's commands, once queued

	// Storage a pooled call brings, so that a call alone in its pipeline
	// allocates little: the group it opens, when it is the first of one,
	// and the arguments of its commands.
	lead     group
	one      [1]*call // the call alone: a batch or a group of one
	argBuf   [12]any  // for a script: evalsha, sha, 1, key, args...
	setArgs  [7]any
	pexpArgs [2]any
	slots    [8]bytesArg // arguments written by str, int and bytes
	ref      bytesArg    // an argument of the caller's, by reference
}

// bytesArg is a command argument kept in its call: go-redis sends an
// encoding.BinaryMarshaler's bytes as a bulk string, as it sends a string or
// an integer's digits, and a pointer to one is boxed without an allocation.
type bytesArg []byte

// MarshalBinary returns the argument's bytes, as sent.
func (a *bytesArg) MarshalBinary() ([]byte, error) { return *a, nil }

// String returns the argument as text, for hooks that print commands.
func (a *bytesArg) String() string { return string(*a) }

// str makes s the call's argument i, copied into the call's slot i.
func (c *call) str(i int, s string) {
	c.slots[i] = append(c.slots[i][:0], s...)
	c.args[i] = &c.slots[i]
}

// int makes n's decimal digits the call's argument i.
func (c *call) int(i int, n int64) {
	c.slots[i] = strconv.AppendInt(c.slots[i][:0], n, 10)
	c.args[i] = &c.slots[i]
}

// bytes makes b the call's argument i, by reference: b must not change
// until the call is answered.
func (c *call) bytes(i int, b []byte) {
	c.ref = b
	c.args[i] = &c.ref
}

// callPool recycles the calls of getCall.
var callPool = sync.Pool{New: func() any { return &call{ready: make(chan struct{}, 1)} }}

// getCall returns a call of script on key, from the pool, whose n (at
// most 8) arguments the caller puts in args (args has length n).
func getCall(script *redis.Script, key string, n int) *call {
	c := callPool.Get().(*call)
	c.script, c.key = script, append(c.key[:0], key...)
	c.keyArg = &c.key
	c.args = c.argBuf[4 : 4+n]
	return c
}

// newCall returns a call of script on key with args, not from the pool.
func newCall(script *redis.Script, key string, args ...any) *call {
	c := &call{script: script, key: bytesArg(key), ready: make(chan struct{}, 1)}
	c.keyArg = &c.key
	c.args = append(c.argBuf[4:4], args...) // in argBuf when they fit
	return c
}

// putCall returns a call of getCall to the pool once its answer is read.
func putCall(c *call) {
	ready, slots, key := c.ready, c.slots, c.key[:0]
	*c = call{ready: ready, slots: slots, key: key}
	callPool.Put(c)
}

// run sends one script call, possibly with others in one pipeline, and
// returns its reply. ctx bounds only the wait for a turn.
func (b *batcher) run(ctx context.Context, script *redis.Script, keys []string, args ...any) (any, error) {
	c := newCall(script, keys[0], args...)
	b.do(ctx, c)
	return c.val, c.err
}

// do sends c, possibly with others in one pipeline, and sets its reply;
// c.err is ctx.Err() when ctx ended before c had a turn (and c was never
// sent). ctx bounds only the wait for a turn.
func (b *batcher) do(ctx context.Context, c *call) {
	b.mu.Lock()
	if b.running < maxInFlight {
		b.running++
		batch := b.waiting
		if len(batch) == 0 {
			c.one[0] = c
			batch = c.one[:]
		} else {
			batch = append(batch, c)
		}
		b.waiting = nil
		b.mu.Unlock()
		b.send(batch, c)
		b.next()
		return
	}
	b.waiting = append(b.waiting, c)
	b.mu.Unlock()

	select {
	case <-c.ready:
	case <-ctx.Done():
		b.mu.Lock()
		for i, w := range b.waiting {
			if w == c {
				b.waiting = append(b.waiting[:i], b.waiting[i+1:]...)
				b.mu.Unlock()
				c.err = ctx.Err()
				return
			}
		}
		b.mu.Unlock()
		<-c.ready // already in a pipeline, or handed one: see it through
	}
	if c.turn != nil {
		b.send(c.turn, c)
		b.next()
	}
}

// next hands the finished pipeline's slot, with every waiting call, to the
// oldest waiter; or frees the slot.
func (b *batcher) next() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.waiting) == 0 {
		b.running--
		return
	}
	batch := b.waiting
	b.waiting = nil
	batch[0].turn = batch
	batch[0].ready <- struct{}{}
}

// maxKeysPerScript bounds the records one script call works on, so that
// no single call blocks the server for long.
const maxKeysPerScript = 64

// group is one script call for one or more calls of the same script.
type group struct {
	script *redis.Script
	calls  []*call
	cmd    *redis.Cmd // the script call, or a native group's EXEC
	multi  *redis.Cmd // a native group's MULTI
	// unreplicated is set when the pipeline that sent cmd waited for
	// replicas and fewer acknowledged it than the batcher asks for.
	unreplicated error
}

// send runs batch as one pipeline, answers each call but self (the
// caller's own), and hands the turn on if a waiter was given it.
func (b *batcher) send(batch []*call, self *call) {
	b.exec(b.pipelineCtx(), batch)
	for _, c := range batch {
		if c != self {
			c.ready <- struct{}{}
		}
	}
}

// epoch is a context that bounds the pipelines sent before until.
type epoch struct {
	ctx    context.Context
	cancel context.CancelFunc // never called: the context ends at its deadline
	until  time.Time
}

// pipelineCtx returns the context that bounds a pipeline sent now. No
// caller's context is used, so that one caller giving up cannot fail the
// others' calls. It ends batchTimeout after it was made and is shared by
// the pipelines sent in the first second of it, so that each pipeline
// gets between batchTimeout-1s and batchTimeout, and a busy store makes one
// context (and timer) a second instead of one a pipeline.
func (b *batcher) pipelineCtx() context.Context {
	now := time.Now()
	if e := b.epoch.Load(); e != nil && now.Before(e.until) {
		return e.ctx
	}
	ctx, cancel := context.WithDeadline(context.Background(), now.Add(batchTimeout))
	b.epoch.Store(&epoch{ctx: ctx, cancel: cancel, until: now.Add(time.Second)})
	return ctx
}

// exec runs calls as one pipeline and sets each call's val and err. On a
// standalone server (or through Sentinel) calls of the same script are
// merged into one script call over many keys; the scripts run each key
// apart, so one key's error is that key's alone. A Cluster gets one script
// call per key, since one call's keys must share a hash slot. A merged
// call refused as a whole (a proxy in front of a cluster answering
// CROSSSLOT, say) is sent again one call per key, so that no call's
// batch-mates decide its answer, and merging stops for this store once a
// call alone went through where the merged one was refused.
func (b *batcher) exec(ctx context.Context, calls []*call) {
	var buf [2]*group
	groups := groupCalls(buf[:0], calls, b.merging(ctx))
	b.runGroups(ctx, groups)

	var alone []*group
	for _, g := range groups {
		if g.script != nil && len(g.calls) > 1 && refusedWhole(g.cmd.Err()) {
			for _, c := range g.calls {
				alone = append(alone, &group{script: g.script, calls: []*call{c}})
			}
			g.calls = nil // answered by alone
		}
	}
	if len(alone) > 0 {
		b.runGroups(ctx, alone)
		for _, g := range alone {
			if !refusedWhole(g.cmd.Err()) {
				b.noMerge.Store(true)
				break
			}
		}
		groups = append(groups, alone...)
	}

	for _, g := range groups {
		replies, err := g.replies()
		for i, c := range g.calls {
			if err != nil {
				c.err = classify(err)
				continue
			}
			reply := replies[i]
			if g.script == nil {
				reply = replies[2*i]
			}
			if e, ok := reply.(error); ok {
				c.err = keyError(e)
				continue
			}
			if g.unreplicated != nil {
				c.err = g.unreplicated
				continue
			}
			c.val = reply
			if g.script == nil {
				c.exp = replies[2*i+1]
			}
		}
	}
}
