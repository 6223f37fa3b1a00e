package amqpidem

import (
	"context"
	"errors"
	"sync"
	"time"
)

// ErrGroupClosed is what Group.Run returns after Shutdown.
var ErrGroupClosed = errors.New("amqpidem: group closed")

// groupFailGrace is how long the handlers of a Group's other consumers
// get to finish when one consumer's Run failed.
const groupFailGrace = 30 * time.Second

// Group runs several Consumers, one per queue, as one (asynq's Server
// with its ServeMux, watermill's Router): one Run, one graceful Shutdown
// and one readiness check. Give its consumers the same
// Observer (one promamqpidem.Metrics, say) for one metrics registry.
//
// Group is safe for concurrent use; Run once, Shutdown any number of
// times.
type Group struct {
	consumers []*Consumer
	runOnce   sync.Once
	stopOnce  sync.Once
	stopping  chan struct{}
}

// NewGroup returns a Group running consumers, each made with
// NewConsumer and not run elsewhere.
func NewGroup(consumers ...*Consumer) *Group {
	return &Group{consumers: append([]*Consumer(nil), consumers...), stopping: make(chan struct{})}
}

// Run runs every consumer (Consumer.Run, each in a goroutine of its own)
// and returns once all have returned: ErrGroupClosed after Shutdown;
// ctx.Err() when ctx ends (the handlers in flight are cancelled, as with
// Consumer.Run); or, when a consumer's Run fails (a refusal by the
// broker, say), that error, after the other consumers were shut down as
// by Shutdown, their handlers given up to 30 s. A Group is not half
// running: an orchestrator restarts the process. Run may be called once.
func (g *Group) Run(ctx context.Context) error {
	first := false
	g.runOnce.Do(func() { first = true })
	if !first {
		return errors.New("amqpidem: Group.Run called twice")
	}
	errs := make(chan error, len(g.consumers))
	for _, c := range g.consumers {
		go func() { errs <- c.Run(ctx) }()
	}
	var (
		failed   error
		shutdown sync.WaitGroup // the shutdown a failure started
	)
	defer shutdown.Wait()
	for range g.consumers {
		err := <-errs
		if err == nil || errors.Is(err, ErrConsumerClosed) || failed != nil {
			continue
		}
		failed = err
		if ctx.Err() == nil && !g.isStopping() {
			// The others stop within the grace period; their Runs then
			// return ErrConsumerClosed, which the loop waits for.
			shutdown.Go(func() {
				gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), groupFailGrace)
				defer cancel()
				_ = g.Shutdown(gctx)
			})
		}
	}
	switch {
	case failed != nil:
		return failed
	case g.isStopping():
		return ErrGroupClosed
	}
	return ctx.Err()
}

func (g *Group) isStopping() bool {
	select {
	case <-g.stopping:
		return true
	default:
		return false
	}
}

// Shutdown shuts every consumer down at once (Consumer.Shutdown: stop
// consuming, let the handlers in flight finish until ctx is done, then
// cancel the rest) and returns when all have, with their errors joined.
// It is idempotent and may be called before, during or after Run.
func (g *Group) Shutdown(ctx context.Context) error {
	g.stopOnce.Do(func() { close(g.stopping) })
	errs := make([]error, len(g.consumers))
	var wg sync.WaitGroup
	for i, c := range g.consumers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.Shutdown(ctx)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Ready reports whether every consumer can take work now (Consumer.Ready):
// nil, or the errors of those that cannot, joined, each wrapping
// ErrNotReady and naming its queue. Serve it as the process's readiness
// check.
func (g *Group) Ready(ctx context.Context) error {
	errs := make([]error, len(g.consumers))
	for i, c := range g.consumers {
		errs[i] = c.Ready(ctx)
	}
	return errors.Join(errs...)
}
