package amqpidem

import (
	"context"
	"fmt"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// A Consumer's sessions: one per connection, from the dial to the
// connection's end, and what happens to the deliveries it consumed.

// job is one delivery of a session, with its ticket of the gate.
type job struct {
	d *amqp.Delivery
	t *ticket
}

// session runs one connection: it returns when the connection or channel
// closes, or when the consumer stops. When it stops (Shutdown, ctx done),
// it waits for its handlers, whose acks need its channel, before it
// returns. When its channel dies, it returns at once: its handlers run on,
// as tasks of c, and its deliveries still waiting for a slot are dropped
// (see work). base is the handlers' parent context.
func (c *Consumer) session(ctx, base context.Context) error {
	conn, err := c.cfg.Dial()
	if err != nil {
		return dialError(err)
	}
	defer conn.Close()
	if err := refuseRecovery(conn, "ConsumerConfig.Dial"); err != nil {
		return &permanentError{err: err}
	}
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	watchBlocked(conn, &c.tasks, c.proc.cfg.Logger, c.cfg.Queue, "consume")

	ch, err := conn.Channel()
	if err != nil {
		return c.setupError(stepChannel, err)
	}
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	if err := ch.Qos(c.cfg.Prefetch, 0, false); err != nil {
		return c.setupError(stepQos, err)
	}
	if err := c.cfg.Declare(ch); err != nil {
		return c.setupError(stepDeclare, err)
	}
	deliveries, err := ch.Consume(c.cfg.Queue, c.cfg.ConsumerTag, false, false, false, false, nil)
	if err != nil {
		return c.setupError(stepConsume, err)
	}
	c.consuming.Store(true)
	defer c.consuming.Store(false)
	c.proc.cfg.Logger.InfoContext(ctx, "amqpidem: consuming", "queue", c.cfg.Queue,
		"prefetch", c.cfg.Prefetch, "concurrency", c.cfg.Concurrency)

	// Acks go through acks, which folds them into multiple acks on this
	// channel; what it holds is sent once the handlers are done.
	acks := newAcker(ch, c.cfg.Prefetch)
	// dead is closed when the channel died; sctx ends when the session
	// does, or when the handlers must stop: it bounds the wait for a slot.
	dead := make(chan struct{})
	acks.dead = dead // deliveries held for a delay (DelayInProcess) let go
	sctx, endSession := context.WithCancel(base)
	// Every delivery goes to a worker at once; the processor's gate lets
	// Concurrency of them in at a time, in delivery order. Workers
	// are started as needed, at most Prefetch of them (the broker sends
	// no more unacked deliveries than that), and live as long as the
	// session: a fresh goroutine per delivery would grow its stack anew
	// each time, a cost that showed in make bench's CPU profile.
	work := make(chan job)
	var workers sync.WaitGroup
	nworkers := 0
	dispatch := func(j job) {
		select {
		case work <- j:
			return
		default:
		}
		if nworkers == c.cfg.Prefetch {
			work <- j
			return
		}
		nworkers++
		workers.Add(1)
		c.tasks.Add(1)
		go func() {
			defer c.tasks.Done()
			defer workers.Done()
			c.work(base, sctx, dead, j)
			for j := range work {
				c.work(base, sctx, dead, j)
			}
		}()
	}
	// end ends the session. alive: the channel works, and the handlers
	// finish before it closes. Otherwise they finish on their own, and the
	// deliveries still waiting for a slot give it up.
	end := func(alive bool) {
		close(work)
		if alive {
			workers.Wait()
			acks.flush()
			endSession()
			return
		}
		close(dead)
		endSession()
		c.tasks.Add(1)
		go func() {
			defer c.tasks.Done()
			workers.Wait()
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
			d.Acknowledger = acks
			if c.isStopping() {
				c.giveBack(base, &d)
				c.drain(base, ch, acks, deliveries)
				end(true)
				return nil
			}
			dispatch(job{&d, c.proc.gate.enter()}) // tickets in delivery order
		case <-c.stopping:
			c.drain(base, ch, acks, deliveries)
			end(true)
			return nil
		case <-ctx.Done():
			c.drain(base, ch, acks, deliveries)
			end(true)
			return ctx.Err()
		}
	}
}

// work waits for j's turn at the gate, then processes it. A delivery
// whose channel died first (dead closed) is dropped: its ticket given
// back, its handler not started, nothing acked or published, since the
// broker delivers it again. A delivery that got no slot because the
// consumer is stopping goes to process all the same, which sends it back
// to its queue unrun.
func (c *Consumer) work(base, sctx context.Context, dead <-chan struct{}, j job) {
	g := c.proc.gate
	g.wait(sctx, c.stopping, j.t) // process takes it from here, slot or not
	select {
	case <-dead:
		g.leave(j.t) // gives back the slot wait handed out, if it did
		c.proc.cfg.Logger.DebugContext(base, "amqpidem: delivery of a closed channel not started; the broker delivers it again",
			"queue", c.cfg.Queue, "message_id", j.d.MessageId, "delivery_tag", j.d.DeliveryTag)
		return
	default:
	}
	c.proc.process(base, c.pub, j.d, j.t)
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
	h := parseHeaders(d.Headers, c.proc.cfg.MaxAttempts)
	msg := copyOf(d, &h, amqp.Table{HeaderReason: "shutdown"})
	if err := c.pub.requeue(ctx, c.cfg.Queue, msg, 0); err != nil {
		_ = d.Nack(false, true)
		return
	}
	_ = d.Ack(false)
}
