package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// A Consumer's sessions: one per connection, from the dial to the
// connection's end, and what happens to the deliveries it consumed.

// job is one delivery of a session, with its ticket of the gate and its
// flight through the processor: one allocation for the three.
type job struct {
	d amqp.Delivery
	t ticket
	f flight // its way through the processor (processor.fly)
}

// soloJob and batchJob are a job with the part of its flight that only
// its kind of processor uses (see flight.acq), in one allocation: 1,576
// and 1,560 bytes, allocated as 1,792, where a job that held both took
// 1,856, allocated as 2,048.
type (
	soloJob struct {
		job
		hd amqp.Delivery
	}
	batchJob struct {
		job
		acq acquireCall
	}
)

// newJob returns a job for d, with its flight's hd or its acq.
func (p *processor) newJob(d amqp.Delivery) *job {
	if p.batchesLeases() {
		j := &batchJob{job: job{d: d}}
		j.f.acq = &j.acq
		return &j.job
	}
	j := &soloJob{job: job{d: d}}
	j.f.hd = &j.hd
	return &j.job
}

// session runs one connection: it returns when the connection or channel
// closes, or when the consumer stops. When it stops (Shutdown, ctx done),
// it waits for its handlers, whose acks need its channel, before it
// returns. When its channel dies, it returns at once: its handlers run on,
// as tasks of c, and its deliveries still waiting for a slot are dropped
// (see work). base is the handlers' parent context.
func (c *Consumer) session(ctx, base context.Context) error {
	s, err := c.connect(ctx)
	if err != nil {
		return err
	}
	conn, ch, deliveries, connClosed, chClosed := s.conn, s.ch, s.deliveries, s.connClosed, s.chClosed
	defer conn.Close()
	if c.ownDial {
		base = withServer(base, serverOf(c.cfg.URL, conn))
	} else {
		base = withServer(base, serverOf("", conn))
	}
	logBlockedIn(&c.tasks, c.proc.cfg.Logger, c.cfg.Queue, "consume", s.blocked)
	c.consuming.Store(true)
	defer c.consuming.Store(false)
	c.proc.cfg.Logger.InfoContext(ctx, "amqpidem: consuming", "queue", c.cfg.Queue,
		"prefetch", c.cfg.Prefetch, "concurrency", c.cfg.Concurrency)

	// Acks go through acks, which folds them into multiple acks on this
	// channel; what it holds is sent once the handlers are done.
	acks := newAcker(ch, c.cfg.Prefetch)
	// dead is closed when the channel died.
	dead := make(chan struct{})
	acks.dead = dead // deliveries held for a delay (DelayInProcess) let go
	// The processor's gate lets Concurrency deliveries in at a time, in
	// delivery order; a delivery waits for its slot as a ticket in the
	// gate, with no goroutine of its own, and the gate starts it on one of
	// w's workers once it has one (see workers).
	w := &workers{c: c, base: base, calm: context.WithoutCancel(base), dead: dead, work: make(chan *job)}
	g := c.proc.gate
	// requeueWaiting sends the deliveries still waiting for a slot to
	// process all the same, which sends them back to their queue unrun:
	// the consumer is stopping.
	requeueWaiting := func() {
		for _, j := range g.abandon(w) {
			w.start(j)
		}
	}
	// end ends the session. alive: the channel works, and the handlers
	// finish before it closes. Otherwise they finish on their own, and the
	// deliveries still waiting for a slot give it up.
	end := func(alive bool) {
		if alive {
			requeueWaiting()
			close(w.work) // the gate starts none of w's deliveries any more
			w.wg.Wait()
			acks.flush()
			return
		}
		close(dead)
		for _, j := range g.abandon(w) {
			c.dropped(base, j)
		}
		close(w.work)
		c.tasks.Add(1)
		go func() {
			defer c.tasks.Done()
			w.wg.Wait()
			acks.flush() // stops its timers; the writes fail
		}()
	}
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				end(false)
				return c.closedErr(connClosed, chClosed)
			}
			j := c.proc.newJob(d)
			j.d.Acknowledger = acks
			if c.isStopping() {
				requeueWaiting()
				c.giveBack(base, &j.d)
				c.drain(base, ch, acks, deliveries)
				end(true)
				return nil
			}
			j.t.workers, j.t.job = w, j
			g.submit(&j.t) // tickets in delivery order
		case <-c.stopping:
			requeueWaiting()
			c.drain(base, ch, acks, deliveries)
			end(true)
			return nil
		case <-ctx.Done():
			requeueWaiting()
			c.drain(base, ch, acks, deliveries)
			end(true)
			return ctx.Err()
		}
	}
}

// setup is a session's connection, set up and consuming.
type setup struct {
	conn                 *amqp.Connection
	ch                   *amqp.Channel
	deliveries           <-chan amqp.Delivery
	connClosed, chClosed chan *amqp.Error
	blocked              chan amqp.Blocking
}

// connect dials and sets up a session's connection (setUp) in a
// goroutine, and gives up on it when the consumer begins stopping or ctx
// ends first (errStopping): a broker that accepts the connection and never
// answers does not hold up Shutdown or Run's context. A connection of
// amqpidem's own dial (ConsumerConfig.URL) is then abandoned at once, its
// socket closed, and the goroutine, one of c's tasks, ends with it. A
// Dial of the user's cannot be interrupted: its goroutine is not waited
// for, and closes the connection if one comes.
func (c *Consumer) connect(ctx context.Context) (*setup, error) {
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		s   *setup
		err error
	}
	var (
		mu        sync.Mutex
		abandoned bool
		res       = make(chan result, 1)
	)
	if c.ownDial {
		c.tasks.Add(1)
	}
	go func() {
		if c.ownDial {
			defer c.tasks.Done()
		}
		s, err := c.setUp(dctx)
		mu.Lock()
		defer mu.Unlock()
		if abandoned {
			if s != nil {
				closeAbandoned(s.conn)
			}
			return
		}
		res <- result{s, err}
	}()
	select {
	case r := <-res:
		return r.s, r.err
	case <-c.stopping:
	case <-ctx.Done():
	}
	cancel()
	mu.Lock()
	abandoned = true
	mu.Unlock()
	select {
	case r := <-res: // it came as the consumer stopped
		if r.s != nil {
			closeAbandoned(r.s.conn)
		}
	default:
	}
	return nil, errStopping
}

// setUp dials a connection and sets it up: a channel, QoS, Declare, and
// consuming. A connection that recovers by itself (ErrAutoRecovery), and a
// Dial or Declare that panics, are permanent errors. On an error the
// connection is closed.
func (c *Consumer) setUp(ctx context.Context) (s *setup, err error) {
	conn, keep, err := c.dial(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, errStopping
		}
		var pe *permanentError
		if errors.As(err, &pe) {
			return nil, err
		}
		return nil, dialError(err)
	}
	defer func() {
		if err != nil {
			closeAbandoned(conn)
		}
	}()
	if err := refuseRecovery(conn, "ConsumerConfig.Dial"); err != nil {
		return nil, &permanentError{err: err}
	}
	s = &setup{conn: conn, connClosed: conn.NotifyClose(make(chan *amqp.Error, 1)),
		// Buffered: the connection's reader waits (a while) for a full one.
		blocked: conn.NotifyBlocked(make(chan amqp.Blocking, 2))}
	if s.ch, err = conn.Channel(); err != nil {
		return nil, c.setupError(stepChannel, err)
	}
	s.chClosed = s.ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := s.ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return nil, c.setupError(stepQos, err)
	}
	if err := c.declare(s.ch); err != nil {
		var pe *permanentError
		if errors.As(err, &pe) {
			return nil, err
		}
		return nil, c.setupError(stepDeclare, err)
	}
	if s.deliveries, err = s.ch.Consume(c.cfg.Queue, c.cfg.ConsumerTag, false, false, false, false, nil); err != nil {
		return nil, c.setupError(stepConsume, err)
	}
	if !keep() {
		return nil, errStopping // its socket was closed as ctx ended
	}
	return s, nil
}

// declare runs ConsumerConfig.Declare; a panic is a permanent error.
func (c *Consumer) declare(ch *amqp.Channel) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &permanentError{err: fmt.Errorf("amqpidem: ConsumerConfig.Declare panicked: %v", v)}
		}
	}()
	return c.cfg.Declare(ch)
}

// workers run a session's deliveries once the gate let them in (start):
// each on a worker that is idle, or else on a new one. Workers live as
// long as the session: a fresh goroutine per delivery would grow its
// stack anew each time, a cost that showed in make bench's CPU profile.
// They are as many as deliveries were in process at once: the broker
// sends at most Prefetch unacked ones, and a delivery waiting for its
// slot takes none.
//
// A delivery goes from the session's goroutine to the gate, and from the
// gate, as a slot frees, straight to a worker: one hand-off between
// goroutines, not one to a worker that then waits for its slot (two).
type workers struct {
	c    *Consumer
	base context.Context // the handlers' parent context
	calm context.Context // base without its cancellation: the settling calls' (processor.fly)
	dead <-chan struct{} // closed when the session's channel died
	work chan *job       // to an idle worker; closed once the gate starts none of the session's deliveries
	wg   sync.WaitGroup  // the workers
}

// start runs j, whose ticket got its slot or left, on a worker. It never
// blocks: the gate calls it with its lock held.
func (w *workers) start(j *job) {
	select {
	case w.work <- j:
		return
	default:
	}
	w.wg.Add(1)
	w.c.tasks.Add(1)
	go func() {
		defer w.c.tasks.Done()
		defer w.wg.Done()
		w.c.work(w, j)
		for j := range w.work {
			w.c.work(w, j)
		}
	}()
}

// work processes j, whose ticket got its slot, or left as the consumer
// began stopping: process then sends it back to its queue unrun. A
// delivery whose channel died first (dead closed) is dropped: its ticket
// given back, its handler not started, nothing acked or published, since
// the broker delivers it again.
func (c *Consumer) work(w *workers, j *job) {
	select {
	case <-w.dead:
		c.dropped(w.base, j)
		return
	default:
	}
	c.proc.fly(&j.f, w.base, w.calm, c.pub, &j.d, &j.t)
}

// dropped drops j, a delivery of a channel that died before its handler
// started: its ticket given up (and the slot it got, if it did).
func (c *Consumer) dropped(base context.Context, j *job) {
	c.proc.gate.leave(&j.t)
	c.proc.cfg.Logger.DebugContext(base, "amqpidem: delivery of a closed channel not started; the broker delivers it again",
		"queue", c.cfg.Queue, "message_id", j.d.MessageId, "delivery_tag", j.d.DeliveryTag)
}

// closedErr explains why the deliveries channel closed.
func (c *Consumer) closedErr(connClosed, chClosed <-chan *amqp.Error) error {
	for _, n := range []<-chan *amqp.Error{chClosed, connClosed} {
		select {
		case e, ok := <-n:
			if ok && e != nil {
				return fmt.Errorf("%w: %v", errConsumed, e)
			}
		default:
		}
	}
	return fmt.Errorf("%w: deliveries closed", errConsumed)
}

// drain cancels the AMQP consumer and hands back, unprocessed, the
// deliveries that were already on their way.
func (c *Consumer) drain(base context.Context, ch *amqp.Channel, acks *acker, deliveries <-chan amqp.Delivery) {
	_ = ch.Cancel(c.cfg.ConsumerTag, false)
	timeout := time.NewTimer(5 * time.Second)
	defer timeout.Stop()
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return
			}
			d.Acknowledger = acks
			c.giveBack(base, &d)
		case <-timeout.C:
			return // closing the channel returns the rest to the queue
		}
	}
}

// giveBack returns a delivery that was never processed to its queue: a
// copy, then an ack, so that a quorum queue does not count the return
// against its delivery limit; a nack with requeue if the copy fails.
func (c *Consumer) giveBack(base context.Context, d *amqp.Delivery) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(base), settleTimeout)
	defer cancel()
	h := c.proc.parseHeaders(d)
	msg := copyOf(d, &h, amqp.Table{HeaderReason: "shutdown"})
	c.proc.sign(&msg)
	if err := c.pub.requeue(ctx, c.cfg.Queue, msg, 0); err != nil {
		_ = d.Nack(false, true)
		return
	}
	_ = d.Ack(false)
}
