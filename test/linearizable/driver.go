package linearizable

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// Workload sizes a run of concurrent clients against one store.
type Workload struct {
	// Clients is how many goroutines call the store at once.
	Clients int
	// Keys is how many idempotency keys they share.
	Keys int
	// Ops is how many operations the run records, at most (a client
	// finishes the operation it is in).
	Ops int
	// Duration bounds the run in time, whatever Ops says.
	Duration time.Duration
	// TTL is every lease's TTL: short, so that leases expire and are
	// taken over during the run.
	TTL time.Duration
	// Timeout bounds every call (its context's deadline): a call that
	// times out is ambiguous.
	Timeout time.Duration
	// Seed seeds the clients' choices (client i uses Seed+i).
	Seed uint64
	// NoLateWrites: a holder never writes once its lease may have
	// expired (the stale holder abandons its lease instead), nor calls
	// Complete again after it succeeded. For pgstore's leases held by
	// transactions, whose late writes are not linearizable (see
	// docs/testing.md and TestPostgresHeldLateWrite), so that their runs
	// check the rest.
	NoLateWrites bool
}

// Retention is the retention of every record of a run: longer than any
// run, so that no record expires during one (the model has no retention:
// a record leaves only by Forget).
const Retention = time.Hour

// Run is a workload running against a store.
type Run struct {
	rec  *Recorder
	done chan struct{}
}

// Start starts w's clients against s and returns at once. The clients
// stop when w.Ops operations are recorded or w.Duration has passed;
// Done is closed then.
func Start(s Store, w Workload) *Run {
	r := &Run{rec: NewRecorder(s), done: make(chan struct{})}
	deadline := time.Now().Add(w.Duration)
	var wg sync.WaitGroup
	for i := range w.Clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &client{Client: r.rec.Client(i), w: w, rng: rand.New(rand.NewPCG(w.Seed, uint64(i)))}
			for n := 0; time.Now().Before(deadline) && r.rec.Len() < w.Ops; n++ {
				c.iteration(n)
			}
		}()
	}
	go func() {
		wg.Wait()
		close(r.done)
	}()
	return r
}

// Done is closed once every client has stopped.
func (r *Run) Done() <-chan struct{} { return r.done }

// History waits for the clients to stop and returns what they did.
func (r *Run) History() []Op {
	<-r.done
	return r.rec.History()
}

// client is one goroutine of a workload.
type client struct {
	*Client
	w   Workload
	rng *rand.Rand
}

// ctx returns a context with the workload's call timeout.
func (c *client) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), c.w.Timeout)
}

// sleep sleeps up to d, at random.
func (c *client) sleep(d time.Duration) {
	if d > 0 {
		time.Sleep(time.Duration(c.rng.Int64N(int64(d))))
	}
}

// iteration does one thing to one key: acquire it and do something with
// the lease, or with the record Acquire reports.
func (c *client) iteration(n int) {
	key := fmt.Sprintf("k%d", c.rng.IntN(c.w.Keys))
	fp := "a"
	switch r := c.rng.IntN(20); {
	case r == 0:
		fp = "b"
	case r < 3:
		fp = ""
	}
	ctx, cancel := c.ctx()
	res, err := c.Acquire(ctx, lock.Request{Key: key, Fingerprint: fp, TTL: c.w.TTL, Retention: Retention})
	cancel()
	if err != nil {
		c.sleep(c.w.TTL / 4)
		return
	}
	tag := fmt.Sprintf("%d.%d", c.id, n)
	switch res.Status {
	case lock.Acquired:
		c.hold(res.Lease, tag)
	case lock.Completed, lock.Failed:
		switch r := c.rng.IntN(100); {
		case r < 30 && res.Status == lock.Completed:
			c.sleep(c.w.TTL / 4) // so that amenders of one value race
			ctx, cancel := c.ctx()
			err := c.Amend(ctx, key, res.Fence, res.Value, []byte("amended "+tag))
			if err == nil && c.rng.IntN(3) == 0 {
				// Again from the same old value: a stale compare-and-set.
				_ = c.Amend(ctx, key, res.Fence, res.Value, []byte("again "+tag))
			}
			cancel()
		case r < 55:
			c.forget(key)
		}
	case lock.InProgress, lock.Conflict:
		c.sleep(c.w.TTL / 2)
	}
}

// hold does something with a granted lease: finishes it one way or
// another, possibly after it expired, or abandons it.
func (c *client) hold(l lock.Lease, tag string) {
	c.sleep(c.w.TTL / 4)
	ctx, cancel := c.ctx()
	defer cancel()
	switch r := c.rng.IntN(100); {
	case r < 40:
		if c.rng.IntN(2) == 0 {
			_ = c.Extend(ctx, l)
			c.sleep(c.w.TTL / 2)
			cancel()
			ctx, cancel = c.ctx()
		}
		err := c.Complete(ctx, l, []byte("result "+tag))
		if err == nil && c.rng.IntN(6) == 0 && !c.w.NoLateWrites {
			// The same call again, as a retry after a lost answer.
			_ = c.Complete(ctx, l, []byte("result "+tag))
		}
	case r < 52:
		_ = c.Fail(ctx, l, "error "+tag)
	case r < 66:
		_ = c.Release(ctx, l)
	case r < 74:
		_ = c.Cancel(ctx, l)
	case r < 90 && c.w.NoLateWrites:
		// A stale holder that never writes: the lease expires.
	case r < 90:
		// A stale holder: paused past its lease, then writes.
		cancel()
		time.Sleep(c.w.TTL + c.w.TTL/2)
		ctx, cancel = c.ctx()
		if c.rng.IntN(2) == 0 {
			_ = c.Extend(ctx, l)
		}
		_ = c.Complete(ctx, l, []byte("late "+tag))
	case r < 95:
		c.forget(l.Key)
	default:
		// Abandoned, as by a crash: the lease expires.
	}
}

// forget inspects key's record and forgets it as seen (compare-and-delete).
func (c *client) forget(key string) {
	ctx, cancel := c.ctx()
	defer cancel()
	rec, err := c.Inspect(ctx, key)
	if err != nil || rec.Live() {
		return
	}
	_ = c.Forget(ctx, key, rec.State, rec.Fence)
}
