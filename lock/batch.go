package lock

import (
	"context"
	"errors"
	"fmt"
	"strings"
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
// make bench, with no loss of throughput.
const maxInFlight = 2

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
}

type call struct {
	script *redis.Script // nil: a native Acquire (see nativeAcquire)
	keys   []string
	args   []any

	ready chan struct{} // closed when answered, or when handed the turn
	turn  []*call       // set before ready closes: the pipeline this call must send
	val   any
	err   error
}

// run sends one script call, possibly with others in one pipeline, and
// returns its reply. ctx bounds only the wait for a turn.
func (b *batcher) run(ctx context.Context, script *redis.Script, keys []string, args ...any) (any, error) {
	c := &call{script: script, keys: keys, args: args, ready: make(chan struct{})}
	b.mu.Lock()
	if b.running < maxInFlight {
		b.running++
		batch := append(b.waiting, c)
		b.waiting = nil
		b.mu.Unlock()
		b.send(batch)
		b.next()
		return c.val, c.err
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
				return nil, ctx.Err()
			}
		}
		b.mu.Unlock()
		<-c.ready // already in a pipeline, or handed one: see it through
	}
	if c.turn != nil {
		b.send(c.turn)
		b.next()
	}
	return c.val, c.err
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
	close(batch[0].ready)
}

// maxKeysPerScript bounds the records one script call works on, so that
// no single call blocks the server for long.
const maxKeysPerScript = 64

// group is one script call for one or more calls of the same script.
type group struct {
	script *redis.Script
	calls  []*call
	cmd    *redis.Cmd
	queued []*redis.Cmd // a native group's MULTI and the commands it queued
	// unreplicated is set when the pipeline that sent cmd waited for
	// replicas and fewer acknowledged it than the batcher asks for.
	unreplicated error
}

// send runs batch as one pipeline, answers each call, and hands the turn on
// if a waiter was given it.
func (b *batcher) send(batch []*call) {
	ctx, cancel := context.WithTimeout(context.Background(), batchTimeout)
	defer cancel()
	b.exec(ctx, batch)
	for _, c := range batch {
		if c.turn == nil {
			close(c.ready)
		}
	}
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
	groups := groupCalls(calls, b.merging(ctx))
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
			if e, ok := replies[i].(error); ok {
				c.err = keyError(e)
				continue
			}
			if g.unreplicated != nil {
				c.err = g.unreplicated
				continue
			}
			c.val = replies[i]
		}
	}
}

// replies returns one reply per call of g, or the error of them all.
func (g *group) replies() ([]any, error) {
	replies, err := g.cmd.Slice()
	if g.script == nil {
		// A native group's EXEC answers two replies per call: SET's and
		// PEXPIRETIME's. A transaction refused as a whole (EXECABORT)
		// is answered with the reason a queued command was refused
		// (READONLY during a failover, OOM, an ACL), when there is one.
		// A refused MULTI leaves the SETs run one by one, outside a
		// transaction: a record one of them made is the caller's own, which
		// the acquire script, run next, finds and answers as such.
		if err != nil {
			for _, q := range g.queued {
				if qerr := q.Err(); qerr != nil && qerr != redis.Nil {
					return nil, qerr
				}
			}
			return nil, err
		}
		if len(replies) != 2*len(g.calls) {
			return nil, fmt.Errorf("lock: EXEC answered %d replies for %d keys", len(replies), len(g.calls))
		}
		out := make([]any, len(g.calls))
		for i := range out {
			if e, ok := replies[2*i].(error); ok {
				out[i] = e
				continue
			}
			out[i] = replies[2*i : 2*i+2]
		}
		return out, nil
	}
	if err == nil && len(replies) != len(g.calls) && len(g.calls) > 0 {
		err = fmt.Errorf("lock: script answered %d of %d keys", len(replies), len(g.calls))
	}
	return replies, err
}

// merging reports whether script calls may be merged: only on a
// *redis.Client whose server says, once, that it is a real standalone
// Redis (INFO server: redis_mode:standalone; a proxy in front of a
// cluster answers otherwise or not at all, and could run a merged call on
// the shard of its first key), and never after a merged call was refused.
func (b *batcher) merging(ctx context.Context) bool {
	c, ok := b.client.(*redis.Client)
	if !ok || b.noMerge.Load() {
		return false
	}
	switch b.standalone.Load() {
	case 1:
		return true
	case 2:
		return false
	}
	info, err := c.Info(ctx, "server").Result()
	switch {
	case err != nil && (isUnavailable(err) || errors.Is(err, context.Canceled)):
		return false // ask again next time (ctx may be a caller's, cancelled)
	case err == nil && strings.Contains(info, "redis_mode:standalone"):
		b.redis7.Store(majorVersion(info) >= 7)
		b.standalone.Store(1)
		return true
	}
	b.standalone.Store(2)
	return false
}

// native reports whether Acquire may take its native path: on a standalone
// server (see merging) of Redis 7.0 or later.
func (b *batcher) native(ctx context.Context) bool {
	return !b.noNative.Load() && b.merging(ctx) && b.redis7.Load()
}

// majorVersion reads redis_version's major number from INFO server; 0 when
// it is not there.
func majorVersion(info string) int {
	_, v, ok := strings.Cut(info, "redis_version:")
	if !ok {
		return 0
	}
	n := 0
	for _, c := range v {
		if c < '0' || c > '9' {
			break
		}
		n = n*10 + int(c-'0')
	}
	return n
}

// unreplicated is the error of the calls of a pipeline whose WAIT
// answered wait: nil when enough replicas acknowledged its writes.
func (b *batcher) unreplicated(wait *redis.Cmd) error {
	n, err := wait.Int64()
	switch {
	case err != nil:
		return fmt.Errorf("%w: waiting for %d replicas: %w", ErrUnavailable, b.replicas, err)
	case n < int64(b.replicas):
		return fmt.Errorf("%w: written on the primary, acknowledged by %d of %d replicas within %v (Config.Replicas)",
			ErrUnavailable, n, b.replicas, b.replicaTimeout)
	}
	return nil
}

// groupCalls makes one script call per call, or, with merge, one per
// script for up to maxKeysPerScript calls.
func groupCalls(calls []*call, merge bool) []*group {
	var groups []*group
	open := map[*redis.Script]*group{}
	for _, c := range calls {
		g := open[c.script]
		if g == nil || !merge || len(g.calls) == maxKeysPerScript {
			g = &group{script: c.script}
			groups = append(groups, g)
			open[c.script] = g
		}
		g.calls = append(g.calls, c)
	}
	return groups
}

// runGroups sends groups as one pipeline. A restart or failover may have emptied
// the script cache: it loads what is missing (on every master of a
// Cluster) and sends those calls again, still as one pipeline.
func (b *batcher) runGroups(ctx context.Context, groups []*group) {
	send := func(gs []*group) {
		pipe := b.client.Pipeline()
		for _, g := range gs {
			if g.script == nil {
				g.queueNative(ctx, pipe)
				continue
			}
			keys := make([]string, 0, len(g.calls))
			args := make([]any, 0, len(g.calls)*len(g.calls[0].args))
			for _, c := range g.calls {
				keys = append(keys, c.keys...)
				args = append(args, c.args...)
			}
			g.cmd = g.script.EvalSha(ctx, pipe, keys, args...)
		}
		var wait *redis.Cmd
		if b.replicas > 0 {
			// WAIT waits for this connection's writes, the pipeline's:
			// a pipeline is sent on one connection (not on a Cluster
			// client, which NewRedisStore refuses with replicas).
			wait = pipe.Do(ctx, "WAIT", b.replicas, b.replicaTimeout.Milliseconds())
		}
		_, _ = pipe.Exec(ctx) // errors are read per command
		if wait != nil {
			err := b.unreplicated(wait)
			for _, g := range gs {
				g.unreplicated = err
			}
		}
	}
	send(groups)

	var again []*group
	loaded := map[*redis.Script]error{}
	for _, g := range groups {
		if !isNoScript(g.cmd.Err()) {
			continue
		}
		if _, ok := loaded[g.script]; !ok {
			loaded[g.script] = g.script.Load(ctx, b.client).Err()
		}
		if loaded[g.script] == nil {
			again = append(again, g)
		}
	}
	if len(again) > 0 {
		send(again)
	}
}

// queueNative adds a native group to pipe as one transaction: for each
// call, SET key record NX PX keep GET and PEXPIRETIME key (see
// nativeAcquire). MULTI makes each key's two commands see the same
// record: nothing runs between them.
func (g *group) queueNative(ctx context.Context, pipe redis.Pipeliner) {
	g.queued = append(g.queued[:0], pipe.Do(ctx, "MULTI"))
	for _, c := range g.calls {
		g.queued = append(g.queued,
			pipe.Do(ctx, "SET", c.keys[0], c.args[0], "NX", "PX", c.args[1], "GET"),
			pipe.Do(ctx, "PEXPIRETIME", c.keys[0]))
	}
	g.cmd = pipe.Do(ctx, "EXEC")
}
