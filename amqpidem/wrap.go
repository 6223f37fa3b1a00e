package amqpidem

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

// Wrapper makes one handler idempotent inside a delivery loop the user
// keeps. Its Handle method takes a delivery and settles it: ack, delayed
// requeue or dead letter, all on the delivery's own channel for acks and on
// confirm-mode channels of its own for the copies it publishes.
//
// Wrapper is safe for concurrent use: call Handle from as many goroutines
// as the loop wants to run handlers in.
type Wrapper struct {
	proc processor
	pub  *publisher

	base     context.Context // cancelled to stop in-flight handlers
	cancel   context.CancelFunc
	inflight sync.WaitGroup
	running  atomic.Int64 // handlers in flight, for Shutdown's log
	mu       sync.Mutex
	closed   bool
	once     sync.Once
	wake     chan struct{} // closed by Shutdown: ends DelayInProcess waits
}

// Wrap returns a Wrapper running h for cfg.Queue with store. conn opens the
// channels the Wrapper publishes on (an *amqp.Connection will do). Give it
// a connection of its own, not the one your loop consumes on, as RabbitMQ
// advises: when the broker blocks publishers (a memory or disk alarm), it
// blocks the whole connection, and the acks of a consuming channel on it
// with it. Handle acks each delivery on the delivery's own channel. A
// connection with amqp091-go's automatic recovery on is refused
// (ErrAutoRecovery), and do not turn it on for the connection your loop
// consumes on either: a recovered channel numbers its deliveries from 1
// again, and Handle's ack of a delivery from before the recovery would
// ack the new delivery that has its tag. It starts
// one heartbeat keeper for all in-flight leases; stop it with Shutdown (a
// Wrapper dropped without Shutdown stops its keeper once it is garbage
// collected).
func Wrap(conn ChannelOpener, store lock.Store, cfg Config, h Handler) (*Wrapper, error) {
	if conn == nil {
		return nil, errors.New("amqpidem: Wrap: nil connection")
	}
	if c, ok := conn.(*amqp.Connection); ok {
		if err := refuseRecovery(c, "amqpidem: Wrap"); err != nil {
			return nil, err
		}
	}
	proc, err := newProcessor(store, cfg, h)
	if err != nil {
		return nil, err
	}
	base, cancel := context.WithCancel(context.Background())
	pub := newPublisher(conn, proc.cfg.QueueType)
	pub.delayArgs = proc.cfg.DelayQueueArgs
	w := &Wrapper{proc: proc, pub: pub, base: base, cancel: cancel, wake: make(chan struct{})}
	w.proc.wake = w.wake
	cleanUpWhenUnreachable(w, proc.keeper, w.pub)
	return w, nil
}

// cleanUpWhenUnreachable shuts k down, and closes pub's idle channels if
// pub is not nil, once owner is garbage: a Wrapper or Consumer dropped
// without Shutdown must not leave the keeper's goroutines or publish
// channels behind. Neither k nor pub refers to owner.
func cleanUpWhenUnreachable[T any](owner *T, k *heartbeat.Keeper, pub *publisher) {
	runtime.AddCleanup(owner, func(l leftovers) {
		if l.pub != nil {
			l.pub.close()
		}
		_ = l.k.Shutdown(context.Background())
	}, leftovers{k, pub})
}

// leftovers is what cleanUpWhenUnreachable stops.
type leftovers struct {
	k   *heartbeat.Keeper
	pub *publisher
}

// Handle processes d once per idempotency key and settles it; see the
// package documentation for what each case does. It returns what happened.
// When ctx is cancelled (or the Wrapper shut down) while the handler runs,
// the handler's context is cancelled, its lease released and a copy of d
// published straight back to the queue (d nacked with requeue if that
// fails), so that it is delivered again.
func (w *Wrapper) Handle(ctx context.Context, d amqp.Delivery) Event {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		// Nothing can be published any more. A nack at once would have the
		// broker redeliver at once to a loop that is still consuming: a hot
		// loop that a quorum queue counts against its delivery limit.
		// Hold it for UnavailableDelay (less if ctx ends) first.
		t := time.NewTimer(w.proc.cfg.UnavailableDelay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		ev := Event{Queue: w.proc.cfg.Queue}
		nackRequeue(&d, &ev, "shutdown", errors.New("amqpidem: wrapper shut down"))
		return ev
	}
	w.inflight.Add(1)
	w.running.Add(1)
	w.mu.Unlock()
	defer w.inflight.Done()
	defer w.running.Add(-1)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(w.base, cancel)
	defer stop()
	return w.proc.process(ctx, w.pub, &d, nil)
}

// Shutdown stops accepting deliveries (later Handle calls hold theirs for
// UnavailableDelay, less if their context ends, then nack them with
// requeue: stop consuming before calling Shutdown), waits for the handlers in flight to finish until ctx is done,
// then cancels the ones still running (their messages go back to the queue
// and their leases are released) and stops the keeper. It returns
// ctx.Err() if handlers had to be cancelled. Shutdown is idempotent. The
// Wrapper's publish channels are closed in the background: on a
// connection the broker has blocked (a resource alarm), their close ends
// when the broker unblocks it or the connection closes. The first call
// logs its start and end at info level, as Consumer.Shutdown does.
func (w *Wrapper) Shutdown(ctx context.Context) error {
	w.mu.Lock()
	first := !w.closed
	if first {
		w.closed = true
		close(w.wake) // requeue delays waited in process end now
		w.proc.cfg.Logger.InfoContext(ctx, "amqpidem: shutting down", "queue", w.proc.cfg.Queue, "in_flight", w.running.Load())
	}
	w.mu.Unlock()
	err := waitGroup(ctx, &w.inflight)
	if err != nil {
		w.cancel()
		w.inflight.Wait() // handlers see a cancelled context and settle
	}
	w.once.Do(func() {
		w.cancel()
		w.pub.close()
		kctx, cancel := settleContext(ctx)
		defer cancel()
		err = errors.Join(err, w.proc.keeper.Shutdown(kctx))
	})
	if first {
		logShutDown(ctx, w.proc.cfg.Logger, w.proc.cfg.Queue, err)
	}
	return err
}

// waitGroup waits for wg until ctx is done.
func waitGroup(ctx context.Context, wg *sync.WaitGroup) error {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
