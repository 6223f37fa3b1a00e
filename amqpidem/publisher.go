package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"slices"
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

// maxPubChannels bounds the confirm-mode channels a publisher keeps open.
// Channels are opened as publishes need them: a publish takes the first
// open channel with room (pubPerChannel publishes awaiting their confirm),
// and a new one only when none has. With one publish per channel, a
// consumer whose handlers each staged a message (make bench, variant
// outbox) spent most of its time waiting for a free channel with 8
// channels; 64 doubled its rate.
const maxPubChannels = 64

// pubPerChannel is how many publishes await their confirm at once on one
// channel. Several per channel cost the broker less per message than a
// channel each (issue 40: a test program measured 30-45% less of
// RabbitMQ's CPU with 16 per channel than with one, make bench's outbox
// variant 15% less on classic queues and 32% on quorum ones): see
// docs/performance.md.
const pubPerChannel = 16

// publisher publishes confirmed, mandatory copies (requeues, dead letters,
// replies, staged messages) on channels of its own: staged messages and
// Publisher's, up to pubPerChannel of them in flight on a channel
// (publish); requeued copies, dead letters and replies one per channel
// (publishAlone). Two things make sharing a channel as exact as one
// publish per channel:
//
//   - A basic.return is matched to its publish by the message's MessageId:
//     the broker sends it before the confirm of the same message, so a
//     publish that got its confirm reads the returns that came until then
//     and takes the one with its own id. No two publishes in flight on a
//     channel share a MessageId; a message without one is published alone
//     on its channel.
//   - A channel the broker closes over one message (an exchange that does
//     not exist, a property it refuses) fails every publish in flight on
//     it. A publish that was not alone on its channel takes that as no
//     verdict on its own message: it publishes it again, alone on a
//     channel, and only that publish's answer counts (IsRefused). The
//     message that made the broker close the channel is refused again;
//     the others are confirmed (those the broker had taken before it closed
//     the channel are so published twice, with the same MessageId).
type publisher struct {
	conn ChannelOpener
	// queueType is the work queues' type, "classic" or "quorum": it picks
	// the kind of delay queue (see delayQueueArgs).
	queueType string
	// delayArgs are Config.DelayQueueArgs, added to every delay queue's.
	delayArgs amqp.Table
	sem       chan struct{} // bounds open channels
	// closing counts the channels being closed in the background (see
	// drop): a blocked connection answers channel.close only once the
	// broker unblocks it, or never, if the connection closes first.
	closing sync.WaitGroup

	mu       sync.Mutex
	chans    []*pubChannel        // open channels, in the order opened
	changed  chan struct{}        // closed (and replaced) when a publish ends while waiting is set: room on a channel
	waiting  bool                 // a get waits on changed
	declared map[string]time.Time // queues declared on this connection, and when
	closed   bool
}

// pubChannel is a confirm-mode channel of a publisher, the channel its
// basic.returns arrive on, and the one that says why the broker closed it.
// Its other fields are guarded by the publisher's mu.
type pubChannel struct {
	ch      *amqp.Channel
	returns chan amqp.Return
	closes  chan *amqp.Error

	inflight int                 // publishes (or a declare) using it
	waits    map[string]*pubWait // publishes in flight, by MessageId
	alone    bool                // one publish (or a declare) has it to itself
	retired  bool                // a publish gave up on its confirm: take no more
	removed  bool                // out of chans, being closed
	joined   uint64              // publishes that ever took it

	reasonMu sync.Mutex
	reason   error // why the broker closed it, once read (closeReason)
}

// pubWait is one publish in flight on a pubChannel.
type pubWait struct {
	id       string
	seq      uint64 // pubChannel.joined when it took the channel
	shared   bool   // another publish was in flight on the channel when it took it
	returned *amqp.Return
}

// closeReason says why the broker closed pc's channel (a publish to an
// exchange that does not exist, a user id or expiration it refuses, the
// connection's end): the *amqp.Error it sent, which the caller may tell
// apart by its Code, or amqp.ErrClosed when it said nothing. Call it only
// once the channel is closed (IsClosed): amqp091-go marks it closed and
// then sends the reason, or closes the notify channel, so it waits for
// that, briefly. Every publish in flight on the channel gets the reason.
func (pc *pubChannel) closeReason() error {
	pc.reasonMu.Lock()
	defer pc.reasonMu.Unlock()
	if pc.reason == nil {
		pc.reason = amqp.ErrClosed
		if e, ok := <-pc.closes; ok && e != nil {
			pc.reason = e
		}
	}
	return pc.reason
}

// drainReturns gives the returns that came on pc so far to the publishes
// in flight they belong to: by MessageId, or to the one publish of a
// channel it has to itself. A return nobody waits for (its publish gave
// up on the confirm) is dropped. Called with p.mu held.
func (pc *pubChannel) drainReturns() {
	for {
		select {
		case r, ok := <-pc.returns:
			if !ok {
				return
			}
			w := pc.waits[r.MessageId]
			if pc.alone {
				for _, only := range pc.waits {
					w = only
				}
			}
			if w != nil && w.returned == nil {
				w.returned = &r
			}
		default:
			return
		}
	}
}

// newPublisher returns a publisher opening its channels with conn, for
// work queues of type queueType ("classic" or "quorum"; anything else is
// taken as classic).
func newPublisher(conn ChannelOpener, queueType string) *publisher {
	return &publisher{
		conn:      conn,
		queueType: queueType,
		sem:       make(chan struct{}, maxPubChannels),
		changed:   make(chan struct{}),
		declared:  make(map[string]time.Time),
	}
}

// get takes room on a channel for a publish of MessageId id, or for a
// declare: on an open channel that has room and no publish of that id in
// flight, or on a new one. alone (also when id is empty) takes a channel
// with nothing in flight and keeps it to itself. It returns the channel
// and the publish's wait, to be given back with put.
func (p *publisher) get(ctx context.Context, id string, alone bool) (*pubChannel, *pubWait, error) {
	alone = alone || id == ""
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, nil, errors.New("amqpidem: publisher closed")
		}
		var dead []*pubChannel
		var pick *pubChannel
		for _, pc := range p.chans {
			switch {
			case pc.ch.IsClosed() || pc.retired:
				if pc.inflight == 0 {
					dead = append(dead, pc)
				}
				continue
			case pc.alone:
				continue
			case alone && pc.inflight > 0, !alone && pc.inflight >= pubPerChannel:
				continue
			}
			if _, dup := pc.waits[id]; dup && !alone {
				continue
			}
			pick = pc
			break
		}
		p.removeLocked(dead)
		if pick != nil {
			w := p.joinLocked(pick, id, alone)
			p.mu.Unlock()
			p.dropAll(dead)
			return pick, w, nil
		}
		changed := p.changed
		p.waiting = true
		p.mu.Unlock()
		p.dropAll(dead)
		select {
		case p.sem <- struct{}{}:
			pc, err := p.open(ctx)
			if err != nil {
				<-p.sem
				return nil, nil, err
			}
			p.mu.Lock()
			if p.closed {
				p.mu.Unlock()
				p.drop(pc)
				return nil, nil, errors.New("amqpidem: publisher closed")
			}
			p.chans = append(p.chans, pc)
			w := p.joinLocked(pc, id, alone)
			p.mu.Unlock()
			return pc, w, nil
		case <-changed:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
}

// joinLocked takes room on pc for a publish of id. Called with p.mu held.
func (p *publisher) joinLocked(pc *pubChannel, id string, alone bool) *pubWait {
	pc.joined++
	w := &pubWait{id: id, seq: pc.joined, shared: pc.inflight > 0}
	pc.inflight++
	pc.alone = alone
	if pc.waits == nil {
		pc.waits = make(map[string]*pubWait, pubPerChannel)
	}
	pc.waits[id] = w
	return w
}

// put gives back the room w took on pc; healthy false (the publish gave up
// on its confirm: the channel's state is unknown) retires the channel,
// closed once nothing is in flight on it. It reports whether another
// publish took pc while w was in flight.
func (p *publisher) put(pc *pubChannel, w *pubWait, healthy bool) (shared bool) {
	p.mu.Lock()
	shared = w.shared || pc.joined != w.seq
	pc.inflight--
	if pc.waits[w.id] == w {
		delete(pc.waits, w.id)
	}
	pc.alone = false
	if !healthy {
		pc.retired = true
	}
	var dead []*pubChannel
	if pc.inflight == 0 && (pc.retired || p.closed || pc.ch.IsClosed()) {
		dead = []*pubChannel{pc}
		p.removeLocked(dead)
	}
	if p.waiting {
		// Only then: a channel made and closed per publish was an
		// allocation per message in make bench's outbox variant.
		close(p.changed)
		p.changed = make(chan struct{})
		p.waiting = false
	}
	p.mu.Unlock()
	p.dropAll(dead)
	return shared
}

// removeLocked takes dead out of p.chans. Called with p.mu held.
func (p *publisher) removeLocked(dead []*pubChannel) {
	for _, pc := range dead {
		pc.removed = true
	}
	if len(dead) == 0 {
		return
	}
	p.chans = slices.DeleteFunc(p.chans, func(pc *pubChannel) bool { return pc.removed })
}

// dropAll drops each channel of dead (see drop).
func (p *publisher) dropAll(dead []*pubChannel) {
	for _, pc := range dead {
		p.drop(pc)
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
	// channel (for up to 5 s, then drops the return). Each publish drains
	// it once confirmed; a return not drained yet belongs to a publish in
	// flight, or to one that gave up, which retires the channel (no more
	// publishes on it): pubPerChannel returns at most wait in it.
	return &pubChannel{ch: ch, returns: ch.NotifyReturn(make(chan amqp.Return, pubPerChannel)),
		closes: ch.NotifyClose(make(chan *amqp.Error, 1))}, nil
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
//
// A message shares its channel with other publishes in flight (see
// publisher); when the broker closes that channel, the message is
// published again alone on a channel, so that the broker's refusal of
// another message is not taken for a refusal of this one.
func (p *publisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if fm := p.frameMax(); !fits(&msg, fm) {
		// The broker would close the channel over it (501 FRAME_ERROR).
		return tooLarge(exchange, key, &msg, fm)
	}
	shared, err := p.publishOn(ctx, exchange, key, msg, false)
	if errors.Is(err, errChannelRefused) || shared && errors.Is(err, ErrNotConfirmed) && IsRefused(err) {
		// The broker closed a channel other publishes were in flight on:
		// over this message or another. Alone, its answer is its own.
		_, err = p.publishOn(ctx, exchange, key, msg, true)
	}
	return err
}

// publishAlone is publish on a channel of its own, as every publish was
// before several shared a channel: for the consumer's own copies of a
// delivery (a requeued copy, a dead letter) and its replies. On a shared
// channel the broker closes over another message, a message the broker
// had taken but not yet confirmed is published again, and reaches its
// queue twice: harmless for a staged message (its consumer deduplicates
// it by MessageId), not for a dead-letter queue, which would hold the
// letter twice for an operator to replay twice (scenario 08's
// deadletter-exchange-missing printed duplicated=2), nor for a reply.
func (p *publisher) publishAlone(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if fm := p.frameMax(); !fits(&msg, fm) {
		return tooLarge(exchange, key, &msg, fm)
	}
	_, err := p.publishOn(ctx, exchange, key, msg, true)
	return err
}

// errChannelRefused is the error of a publish whose channel the broker
// closed, with a channel-level reason, before the message was sent: over
// another message in flight on it. publish tries such a message again
// alone; on a channel a publish had to itself (the broker closed it over
// something else), it is the publish's error, which IsRefused reports
// false for.
var errChannelRefused = errors.New("amqpidem: the broker closed the channel before the publish")

// publishOn publishes msg once on a channel taken with get (alone: to
// itself), and waits for its confirm; see publish. shared reports whether
// other publishes took the channel while msg was in flight on it.
func (p *publisher) publishOn(ctx context.Context, exchange, key string, msg amqp.Publishing, alone bool) (shared bool, err error) {
	pc, w, err := p.get(ctx, msg.MessageId, alone)
	if err != nil {
		return false, err
	}
	healthy := false
	defer func() { shared = p.put(pc, w, healthy) }()

	dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		if pc.ch.IsClosed() {
			reason := pc.closeReason()
			if IsRefused(fmt.Errorf("%w: %w", ErrNotConfirmed, reason)) {
				return false, fmt.Errorf("%w: exchange %q routing key %q: %w", errChannelRefused, exchange, key, reason)
			}
		}
		return false, fmt.Errorf("amqpidem: publish to %q/%q: %w", exchange, key, err)
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		// The confirm may still come; this channel's state is unknown.
		return false, fmt.Errorf("amqpidem: publish to %q/%q: waiting for confirm: %w", exchange, key, err)
	}
	healthy = true
	p.mu.Lock()
	// The broker sent this message's return, if any, before its confirm.
	pc.drainReturns()
	r := w.returned
	p.mu.Unlock()
	closed := !acked && pc.ch.IsClosed()
	var reason error
	if closed {
		reason = pc.closeReason()
	}
	if r != nil {
		return false, fmt.Errorf("%w: exchange %q routing key %q: %d %s (no queue is bound to take it: declare the queue, "+
			"or start its consumer, which declares it, before publishing)", ErrUnroutable, exchange, key, r.ReplyCode, r.ReplyText)
	}
	if !acked {
		if closed {
			return false, fmt.Errorf("%w: exchange %q routing key %q: %s: %w", ErrNotConfirmed, exchange, key, whoClosed(reason), reason)
		}
		return false, fmt.Errorf("%w: exchange %q routing key %q", ErrNotConfirmed, exchange, key)
	}
	return false, nil
}

// whoClosed says what closed a publish channel that ended with reason:
// the broker (a channel or connection exception it sent), or the
// connection's loss or close on this side (amqp091 reports a lost TCP
// connection as a 501 frame error of its own, not the broker's).
func whoClosed(reason error) string {
	var e *amqp.Error
	if errors.As(reason, &e) && e.Server {
		return "the broker closed the channel"
	}
	return "the channel closed with its connection (lost or closed on this side; the broker did not close it)"
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
	pc, w, err := p.get(ctx, "", true)
	if err != nil {
		return err
	}
	_, err = pc.ch.QueueDeclare(name, true, false, false, false, args)
	p.put(pc, w, err == nil)
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
	var idle []*pubChannel
	for _, pc := range p.chans {
		if pc.inflight == 0 {
			idle = append(idle, pc)
		}
	}
	p.removeLocked(idle)
	p.mu.Unlock()
	p.dropAll(idle)
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
		return p.publishAlone(ctx, "", queue, msg)
	}
	tier := delayTier(delay)
	name := delayQueue(queue, p.queueType, tier)
	args := delayQueueArgs(queue, p.queueType, tier, p.delayArgs)
	for try := 0; ; try++ {
		if err := p.declare(ctx, name, args, true); err != nil {
			return err
		}
		err := p.publishAlone(ctx, "", name, msg)
		if try == 0 && errors.Is(err, ErrUnroutable) {
			p.forget(name)
			continue
		}
		return err
	}
}
