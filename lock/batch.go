package lock

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxInFlight bounds the pipelines one store has on the wire at once. Calls
// that arrive while they are all busy wait and go out together in the next
// one, so the busier the store, the bigger its batches and the fewer its
// round trips per call; an idle store sends each call at once.
const maxInFlight = 4

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

	mu      sync.Mutex
	waiting []*call
	running int
}

type call struct {
	script *redis.Script
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

// send runs batch as one pipeline and answers each call.
func (b *batcher) send(batch []*call) {
	ctx, cancel := context.WithTimeout(context.Background(), batchTimeout)
	defer cancel()
	cmds := make([]*redis.Cmd, len(batch))
	pipe := b.client.Pipeline()
	for i, c := range batch {
		cmds[i] = c.script.EvalSha(ctx, pipe, c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx) // errors are read per command

	// A restart or failover may have emptied the script cache: load what
	// is missing and send those calls again, still as one pipeline.
	var again []int
	loaded := map[*redis.Script]error{}
	for i, cmd := range cmds {
		if !isNoScript(cmd.Err()) {
			continue
		}
		s := batch[i].script
		if _, ok := loaded[s]; !ok {
			loaded[s] = s.Load(ctx, b.client).Err()
		}
		if loaded[s] == nil {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		pipe = b.client.Pipeline()
		for _, i := range again {
			cmds[i] = batch[i].script.EvalSha(ctx, pipe, batch[i].keys, batch[i].args...)
		}
		_, _ = pipe.Exec(ctx)
	}

	for i, c := range batch {
		c.val, c.err = cmds[i].Val(), cmds[i].Err()
		if c.turn == nil {
			close(c.ready)
		}
	}
}
