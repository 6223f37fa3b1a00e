package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrUnroutable means a mandatory publish was returned by the broker: no
// queue was bound to take it.
var ErrUnroutable = errors.New("amqpidem: message unroutable")

// ErrNotConfirmed means a publish was not confirmed: the broker nacked
// it, or its channel closed before the confirm came, closed by the broker
// over that message (the error then wraps the broker's *amqp.Error) or
// with the whole connection. Only the first of those says anything about
// the message; IsRefused tells them apart.
var ErrNotConfirmed = errors.New("amqpidem: publish not confirmed")

// IsRefused reports whether err, the error of a confirmed publish
// (Publisher.Publish, or amqpidem's own publishes of staged messages),
// says that the broker refused that message, so that publishing it again
// meets the same answer until someone acts: it returned the message
// (ErrUnroutable: no queue bound to take it), or closed the channel over
// it (ErrNotConfirmed wrapping the broker's channel-level *amqp.Error, a
// reply code below 500 other than 320 CONNECTION_FORCED: an exchange that
// does not exist, a user id or an expiration it refuses, access refused),
// or would close it (ErrTooLarge: headers over the frame_max, not sent).
//
// Anything else is the broker or the network being unavailable, not a
// verdict on the message, and IsRefused reports false: the connection
// lost or closed (the broker may have taken the message and only its
// confirm was lost), a plain nack (the broker could not take it now: a
// quorum queue electing a leader, a queue full with reject-publish), a
// confirm not awaited to the end, a channel that could not be opened.
// Publish such a message again later; counting those failures toward a
// limit would give up messages for a fault on the way, not in them.
func IsRefused(err error) bool {
	switch {
	case errors.Is(err, ErrUnroutable), errors.Is(err, ErrTooLarge):
		return true
	case !errors.Is(err, ErrNotConfirmed):
		return false
	}
	var ae *amqp.Error
	// Channel-level reply codes are below 500; 320 is a connection's end.
	return errors.As(err, &ae) && ae.Code < 500 && ae.Code != amqp.ConnectionForced
}

// ChannelOpener opens AMQP channels. *amqp.Connection is one; a user with
// their own reconnect logic can pass something that opens a channel on the
// current connection.
type ChannelOpener interface {
	Channel() (*amqp.Channel, error)
}

// maxPubChannels bounds the confirm-mode channels a publisher keeps open,
// and so the publishes waiting for their confirm at once: each channel
// carries one at a time. Channels are opened as publishes need them. With
// 8, a consumer whose handlers each staged a message (make bench, variant
// outbox) spent most of its time waiting for a free channel: 64 doubled
// its rate (0.17 to 0.30 of unique's on classic queues, 0.20 to 0.36 on
// quorum ones), 128 did not add to it.
const maxPubChannels = 64

// publisher publishes confirmed, mandatory copies (requeues, dead letters,
// replies) on channels of its own. One publish at a time per channel, so
// that a basic.return, which the broker sends before the confirm of the
// same message, belongs to the publish that waits on that channel.
type publisher struct {
	conn ChannelOpener
	// queueType is the work queues' type, "classic" or "quorum": it picks
	// the kind of delay queue (see delayQueueArgs).
	queueType string
	// delayArgs are Config.DelayQueueArgs, added to every delay queue's.
	delayArgs amqp.Table
	pool      chan *pubChannel // idle channels
	sem       chan struct{}    // bounds open channels
	// closing counts the channels being closed in the background (see
	// put): a blocked connection answers channel.close only once the
	// broker unblocks it, or never, if the connection closes first.
	closing sync.WaitGroup

	mu       sync.Mutex
	declared map[string]time.Time // queues declared on this connection, and when
	closed   bool
}

// pubChannel is a confirm-mode channel of a publisher, the channel its
// basic.returns arrive on, and the one that says why the broker closed it.
type pubChannel struct {
	ch      *amqp.Channel
	returns chan amqp.Return
	closes  chan *amqp.Error
}

// closeReason says why the broker closed pc's channel (a publish to an
// exchange that does not exist, a user id or expiration it refuses, the
// connection's end): the *amqp.Error it sent, which the caller may tell
// apart by its Code, or amqp.ErrClosed when it said nothing.
func (pc *pubChannel) closeReason() error {
	select {
	case e, ok := <-pc.closes:
		if ok && e != nil {
			return e
		}
	default:
	}
	return amqp.ErrClosed
}

// newPublisher returns a publisher opening its channels with conn, for
// work queues of type queueType ("classic" or "quorum"; anything else is
// taken as classic).
func newPublisher(conn ChannelOpener, queueType string) *publisher {
	return &publisher{
		conn:      conn,
		queueType: queueType,
		pool:      make(chan *pubChannel, maxPubChannels),
		sem:       make(chan struct{}, maxPubChannels),
		declared:  make(map[string]time.Time),
	}
}

// get returns an idle channel or opens one.
func (p *publisher) get(ctx context.Context) (*pubChannel, error) {
	for {
		select {
		case pc := <-p.pool:
			if pc.ch.IsClosed() {
				<-p.sem
				continue
			}
			return pc, nil
		default:
		}
		select {
		case pc := <-p.pool:
			if pc.ch.IsClosed() {
				<-p.sem
				continue
			}
			return pc, nil
		case p.sem <- struct{}{}:
			pc, err := p.open(ctx)
			if err != nil {
				<-p.sem
				return nil, err
			}
			return pc, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// contextOpener is a ChannelOpener whose wait for a connection ends with
// ctx: a Consumer's or DialPublisher's own connection (pubConn).
type contextOpener interface {
	channel(ctx context.Context) (*amqp.Channel, error)
}

// open opens a confirm-mode channel, unless the publisher is closed. A
// contextOpener's wait for its connection ends with ctx.
func (p *publisher) open(ctx context.Context) (*pubChannel, error) {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return nil, errors.New("amqpidem: publisher closed")
	}
	if c, ok := p.conn.(*amqp.Connection); ok {
		if err := refuseRecovery(c, "amqpidem: publish"); err != nil {
			return nil, err
		}
	}
	var ch *amqp.Channel
	var err error
	if co, ok := p.conn.(contextOpener); ok {
		ch, err = co.channel(ctx)
	} else {
		ch, err = p.conn.Channel()
	}
	if err != nil {
		return nil, fmt.Errorf("amqpidem: open publish channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("amqpidem: confirm mode: %w", err)
	}
	// Buffered: the connection's reader goroutine blocks on a full notify
	// channel. Returns are drained before each publish.
	return &pubChannel{ch: ch, returns: ch.NotifyReturn(make(chan amqp.Return, 4)),
		closes: ch.NotifyClose(make(chan *amqp.Error, 1))}, nil
}

// put gives a healthy channel back, or drops a broken one (see drop).
func (p *publisher) put(pc *pubChannel, healthy bool) {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if healthy && !closed && !pc.ch.IsClosed() {
		p.pool <- pc
		return
	}
	p.drop(pc)
}

// drop closes pc and frees its place. The close is made in the background:
// channel.close waits for the broker's close-ok, which a connection the
// broker has blocked (a resource alarm) does not get until it is
// unblocked, and a publish that gave up on its confirm must not wait for
// it. The channel keeps its place (sem) until it is closed, so that a
// blocked connection does not gather more than maxPubChannels of them.
func (p *publisher) drop(pc *pubChannel) {
	if pc.ch.IsClosed() {
		<-p.sem
		return
	}
	p.closing.Add(1)
	go func() {
		defer p.closing.Done()
		_ = pc.ch.Close()
		<-p.sem
	}()
}

// publish sends msg with mandatory set and waits for the broker's confirm.
// It returns ErrUnroutable when the broker returned it, and ErrNotConfirmed
// on a nack or when the channel closed before the confirm: wrapping the
// broker's reason when the broker closed the channel over the message (an
// exchange that does not exist, a property it refuses), or the
// connection's when the whole connection ended (IsRefused tells them
// apart). A message whose headers would not fit in the connection's
// frame_max is not sent: ErrTooLarge. When it returns nil the broker has
// taken responsibility for the message.
func (p *publisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if fm := p.frameMax(); !fits(&msg, fm) {
		// The broker would close the channel over it (501 FRAME_ERROR).
		return tooLarge(exchange, key, &msg, fm)
	}
	pc, err := p.get(ctx)
	if err != nil {
		return err
	}
	healthy := false
	defer func() { p.put(pc, healthy) }()

	for drained := false; !drained; {
		select {
		case _, ok := <-pc.returns: // left over from a publish that timed out
			if !ok { // closed with the channel since get looked
				return fmt.Errorf("amqpidem: publish to %q/%q: channel closed: %w", exchange, key, pc.closeReason())
			}
		default:
			drained = true
		}
	}
	dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		return fmt.Errorf("amqpidem: publish to %q/%q: %w", exchange, key, err)
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		// The confirm may still come; this channel's state is unknown.
		return fmt.Errorf("amqpidem: publish to %q/%q: waiting for confirm: %w", exchange, key, err)
	}
	healthy = true
	select {
	case r, ok := <-pc.returns:
		if ok {
			return fmt.Errorf("%w: exchange %q routing key %q: %d %s (no queue is bound to take it: declare the queue, "+
				"or start its consumer, which declares it, before publishing)", ErrUnroutable, exchange, key, r.ReplyCode, r.ReplyText)
		}
		// Closed with the channel: nothing was returned.
	default:
	}
	if !acked {
		if pc.ch.IsClosed() {
			return fmt.Errorf("%w: exchange %q routing key %q: the broker closed the channel: %w", ErrNotConfirmed, exchange, key, pc.closeReason())
		}
		return fmt.Errorf("%w: exchange %q routing key %q", ErrNotConfirmed, exchange, key)
	}
	return nil
}

// redeclareAfter is how often a self-expiring delay queue is declared
// again while in use; each declaration restarts its x-expires clock, which
// runs at least a minute longer than this.
const redeclareAfter = 15 * time.Second

// declare declares a durable queue once per publisher (per connection), or,
// when refresh is set, again every redeclareAfter (to keep a self-expiring
// queue alive while it is used).
func (p *publisher) declare(ctx context.Context, name string, args amqp.Table, refresh bool) error {
	p.mu.Lock()
	at, done := p.declared[name]
	p.mu.Unlock()
	if done && (!refresh || time.Since(at) < redeclareAfter) {
		return nil
	}
	pc, err := p.get(ctx)
	if err != nil {
		return err
	}
	_, err = pc.ch.QueueDeclare(name, true, false, false, false, args)
	p.put(pc, err == nil)
	if err != nil {
		return declareError(name, args, err)
	}
	p.mu.Lock()
	p.declared[name] = time.Now()
	p.mu.Unlock()
	return nil
}

// declareError describes a failed declaration of queue name with args.
// PRECONDITION_FAILED (which also closes the channel) means that the queue
// exists with other arguments, or that the broker refuses these: every
// later declaration fails the same way until someone acts, so the error
// says what to do. It wraps err (an *amqp.Error for a broker refusal).
func declareError(name string, args amqp.Table, err error) error {
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed {
		return fmt.Errorf("amqpidem: declare queue %q: it exists with arguments other than those amqpidem declares (%s), "+
			"or the broker refuses these (quorum delay queues need RabbitMQ 3.10 or later); "+
			"delete the queue, and amqpidem declares it again: %w", name, tableText(args), err)
	}
	return fmt.Errorf("amqpidem: declare queue %q: %w", name, err)
}

// tableText prints a queue's arguments, keys sorted; "none" for none.
func tableText(args amqp.Table) string {
	if len(args) == 0 {
		return "none"
	}
	return fmt.Sprint(map[string]any(args))
}

// forget makes the next declare of name go to the broker again.
func (p *publisher) forget(name string) {
	p.mu.Lock()
	delete(p.declared, name)
	p.mu.Unlock()
}

// close closes the idle channels, in the background (see drop); channels
// in use are closed when put back. wait waits for those closes.
func (p *publisher) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	for {
		select {
		case pc := <-p.pool:
			p.drop(pc)
		default:
			return
		}
	}
}

// wait waits for the channels being closed in the background: until the
// broker answers, or the connection closes.
func (p *publisher) wait() { p.closing.Wait() }

// requeue publishes msg, a copy of a delivery, to wait delay in its tier's
// delay queue and then return to queue (or straight back to queue when
// delay is zero). The delay queue is of the kind p.queueType calls for
// (see delayQueueArgs). A copy returned unroutable from a delay queue
// declared earlier (someone deleted it since) declares it again and is
// published once more: it was not enqueued, so this makes no duplicate.
func (p *publisher) requeue(ctx context.Context, queue string, msg amqp.Publishing, delay time.Duration) error {
	if delay <= 0 {
		return p.publish(ctx, "", queue, msg)
	}
	tier := delayTier(delay)
	name := delayQueue(queue, p.queueType, tier)
	args := delayQueueArgs(queue, p.queueType, tier, p.delayArgs)
	for try := 0; ; try++ {
		if err := p.declare(ctx, name, args, true); err != nil {
			return err
		}
		err := p.publish(ctx, "", name, msg)
		if try == 0 && errors.Is(err, ErrUnroutable) {
			p.forget(name)
			continue
		}
		return err
	}
}
