package lock

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// replies returns the replies of g's command: one per call, or for a
// native group two per call, SET's and PEXPIRETIME's; or the error of
// them all.
func (g *group) replies() ([]any, error) {
	replies, err := g.cmd.Slice()
	if g.script == nil {
		// A transaction refused as a whole (EXECABORT) is answered with
		// the reason a queued command was refused (READONLY during a
		// failover, OOM, an ACL), when there is one. A refused MULTI
		// leaves the SETs run one by one, outside a transaction: a record
		// one of them made is the caller's own, which the acquire script,
		// run next, finds and answers as such.
		if err != nil {
			if qerr := queuedErr(g.multi); qerr != nil {
				return nil, qerr
			}
			for _, c := range g.calls {
				if qerr := queuedErr(c.setCmd); qerr != nil {
					return nil, qerr
				}
				if qerr := queuedErr(c.pexpCmd); qerr != nil {
					return nil, qerr
				}
			}
			return nil, err
		}
		if len(replies) != 2*len(g.calls) {
			return nil, fmt.Errorf("lock: EXEC answered %d replies for %d keys", len(replies), len(g.calls))
		}
		return replies, nil
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

// groupCalls appends to groups one script call per call, or, with merge,
// one per script for up to maxKeysPerScript calls. A group is kept in the
// call that opens it.
func groupCalls(groups []*group, calls []*call, merge bool) []*group {
	open := map[*redis.Script]*group{}
	for _, c := range calls {
		g := open[c.script]
		if g == nil || !merge || len(g.calls) == maxKeysPerScript {
			c.one[0] = c
			g = &c.lead
			*g = group{script: c.script, calls: c.one[:1:1]}
			groups = append(groups, g)
			open[c.script] = g
			continue
		}
		g.calls = append(g.calls, c)
	}
	return groups
}

// pipe is a pipeline kept for reuse with the slice its commands are
// gathered in.
type pipe struct {
	redis.Pipeliner
	cmds []redis.Cmder
}

// getPipe returns a pipeline of b's client, reused when the client's
// pipelines are go-redis's own (*redis.Pipeline, empty again after Exec).
func (b *batcher) getPipe() *pipe {
	if p, _ := b.pipes.Get().(*pipe); p != nil {
		return p
	}
	return &pipe{Pipeliner: b.client.Pipeline()}
}

// putPipe keeps p for getPipe, emptied, if it can be reused.
func (b *batcher) putPipe(p *pipe) {
	clear(p.cmds)
	p.cmds = p.cmds[:0]
	if _, ok := p.Pipeliner.(*redis.Pipeline); ok && p.Len() == 0 {
		b.pipes.Put(p)
	}
}

// runGroups sends groups as one pipeline. A restart or failover may have emptied
// the script cache: it loads what is missing (on every master of a
// Cluster) and sends those calls again, still as one pipeline.
func (b *batcher) runGroups(ctx context.Context, groups []*group) {
	send := func(gs []*group) {
		p := b.getPipe()
		cmds := p.cmds
		for _, g := range gs {
			if g.script == nil {
				cmds = g.queueNative(ctx, cmds)
				continue
			}
			g.cmd = redis.NewCmd(ctx, g.evalArgs()...)
			g.cmd.SetFirstKeyPos(3)
			cmds = append(cmds, g.cmd)
		}
		var wait *redis.Cmd
		if b.replicas > 0 {
			// WAIT waits for this connection's writes, the pipeline's:
			// a pipeline is sent on one connection (not on a Cluster
			// client, which NewRedisStore refuses with replicas).
			wait = redis.NewCmd(ctx, "WAIT", b.replicas, b.replicaTimeout.Milliseconds())
			cmds = append(cmds, wait)
		}
		_ = p.BatchProcess(ctx, cmds...)
		_, _ = p.Exec(ctx) // errors are read per command
		p.cmds = cmds
		b.putPipe(p)
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

// shaArgs are the store's scripts' SHA1 digests, boxed once.
var shaArgs = map[*redis.Script]any{
	acquireScript: acquireScript.Hash(),
	extendScript:  extendScript.Hash(),
	finishScript:  finishScript.Hash(),
	amendScript:   amendScript.Hash(),
}

// evalArgs returns the arguments of g's EVALSHA: a call alone in its group
// sends the ones it holds in argBuf.
func (g *group) evalArgs() []any {
	sha, ok := shaArgs[g.script]
	if !ok {
		sha = g.script.Hash()
	}
	if c := g.calls[0]; len(g.calls) == 1 && len(c.args) <= len(c.argBuf)-4 {
		c.argBuf[0], c.argBuf[1], c.argBuf[2], c.argBuf[3] = "evalsha", sha, 1, c.keyArg
		return c.argBuf[:4+len(c.args)]
	}
	n := 0
	for _, c := range g.calls {
		n += len(c.args)
	}
	args := make([]any, 3, 3+len(g.calls)+n)
	args[0], args[1], args[2] = "evalsha", sha, len(g.calls)
	for _, c := range g.calls {
		args = append(args, c.keyArg)
	}
	for _, c := range g.calls {
		args = append(args, c.args...)
	}
	return args
}

// The commands of a native group that take no argument.
var (
	multiArgs = []any{"MULTI"}
	execArgs  = []any{"EXEC"}
)

// queueNative appends a native group to cmds as one transaction: for each
// call, SET key record NX PX keep GET and PEXPIRETIME key (see
// nativeAcquire). MULTI makes each key's two commands see the same
// record: nothing runs between them.
func (g *group) queueNative(ctx context.Context, cmds []redis.Cmder) []redis.Cmder {
	g.multi = redis.NewCmd(ctx, multiArgs...)
	cmds = append(cmds, g.multi)
	for _, c := range g.calls {
		c.setArgs = [7]any{"SET", c.keyArg, c.args[0], "NX", "PX", c.args[1], "GET"}
		c.pexpArgs = [2]any{"PEXPIRETIME", c.keyArg}
		c.setCmd = redis.NewCmd(ctx, c.setArgs[:]...)
		c.pexpCmd = redis.NewCmd(ctx, c.pexpArgs[:]...)
		cmds = append(cmds, c.setCmd, c.pexpCmd)
	}
	g.cmd = redis.NewCmd(ctx, execArgs...)
	return append(cmds, g.cmd)
}

// queuedErr is the error a queued command of a native group was answered,
// if any: nil for none or a nil reply.
func queuedErr(cmd *redis.Cmd) error {
	if err := cmd.Err(); err != nil && err != redis.Nil {
		return err
	}
	return nil
}
