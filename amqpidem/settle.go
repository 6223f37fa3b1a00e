package amqpidem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// The settle actions: every delivery ends in exactly one of ack (after a
// reply, if it has ReplyTo), requeue (a confirmed copy, then an ack) or
// dead letter (a confirmed copy to the dead-letter target, then an ack),
// and, when no copy can be published at all, a nack with requeue. Each
// lives here, once.

// ack acknowledges the delivery on its own channel, as o; completed work
// (o Completed or Duplicate) whose staged messages this delivery gave up
// on (see dispatch) is acked as OutboxGivenUp.
func (f *flight) ack(o Outcome) {
	if f.ev.Outbox.Returned > 0 && (o == Completed || o == Duplicate) {
		o = OutboxGivenUp
		f.ev.Reason = "staged message given up"
	}
	f.ev.Outcome = o
	if err := f.d.Ack(false); err != nil {
		// The channel is gone; the broker will deliver it again and the
		// record, already settled, makes that a duplicate.
		f.ev.Err = errors.Join(f.ev.Err, fmt.Errorf("amqpidem: ack: %w", err))
	}
}

// drop acks a duplicate of failed work, whose record holds the error
// text stored, without dead-lettering it (AckFailedDuplicate).
func (f *flight) drop(stored string) {
	f.ev.Reason, f.ev.Err = "failed duplicate", errors.New(stored)
	f.ack(Dropped)
}

// duplicate settles a duplicate of completed work whose record res
// answered: the staged messages it holds that were not published yet
// published (see dispatch), the stored reply re-sent (only to the ReplyTo
// it was made for), then acked.
func (f *flight) duplicate(res *lock.Result) {
	if !f.dispatch(res.Value, res.Fence, false) {
		return
	}
	result, replyOK := decodeResult(res.Value, f.d.ReplyTo)
	if f.d.ReplyTo != "" && !replyOK {
		// The result was made for another ReplyTo, or none: a duplicate
		// does not get to choose where it goes.
		f.ev.Reason = "reply not re-sent"
		f.ev.Err = fmt.Errorf("amqpidem: stored reply not re-sent to %q: the result was not made for that reply-to", f.d.ReplyTo)
		f.ack(Duplicate)
		return
	}
	f.replyAndAck(result, Duplicate)
}

// replyAndAck sends result to the delivery's ReplyTo, if any, and acks it
// as o; see replyFailed for a reply that could not be sent.
func (f *flight) replyAndAck(result []byte, o Outcome) {
	if err := f.reply(result); err != nil {
		// The result is stored: the redelivery is a duplicate and sends
		// the stored reply.
		f.replyFailed(o, err)
		return
	}
	f.ack(o)
}

// reply sends result to the delivery's ReplyTo, if any, with its
// CorrelationId, within settleTimeout even if the delivery's context is
// done (the result is stored). A reply queue that no longer exists (the
// client gave up) is not an error: nobody will ever read the reply, so it
// is noted in the Event and dropped; only a publish that may succeed later
// returns an error.
func (f *flight) reply(result []byte) error {
	d := f.d
	if d.ReplyTo == "" {
		return nil
	}
	sctx, cancel := calmContext(f.calmCtx())
	defer cancel()
	msg := amqp.Publishing{
		CorrelationId: d.CorrelationId,
		ContentType:   d.ContentType,
		Timestamp:     time.Now(),
		Body:          result,
	}
	end := func(error) {}
	if f.p.cfg.Tracer != nil {
		msg.Headers = amqp.Table{}
		end = f.p.startPublish(f.ctx, Publish{
			Kind: PublishReply, Queue: f.p.cfg.Queue, RoutingKey: d.ReplyTo, Headers: msg.Headers,
			CorrelationID: msg.CorrelationId, BodySize: len(msg.Body),
		})
	}
	err := f.b.publishAlone(sctx, "", d.ReplyTo, msg)
	end(err)
	if errors.Is(err, ErrUnroutable) {
		f.ev.Err = errors.Join(f.ev.Err, fmt.Errorf("amqpidem: reply to %q dropped: %w", d.ReplyTo, err))
		return nil
	}
	return err
}

// replyFailed settles a delivery whose result is stored but whose reply
// could not be sent: requeued after UnavailableDelay so that its
// redelivery, a duplicate, sends the stored reply, at most MaxAttempts
// times (counted in HeaderReplyTries); then the reply is given up, logged,
// and the delivery acked as o, so that the copy does not cycle until its
// record expires and the work runs again.
func (f *flight) replyFailed(o Outcome, err error) {
	p := f.p
	tries := f.head().replyTries + 1
	if tries >= p.cfg.MaxAttempts {
		f.ev.Reason = "reply given up"
		f.ev.Err = errors.Join(f.ev.Err, fmt.Errorf("amqpidem: reply to %q not sent after %d tries: %w", f.d.ReplyTo, tries, err))
		p.cfg.Logger.ErrorContext(f.ctx, "amqpidem: reply given up; the result stays stored",
			"queue", p.cfg.Queue, "key", f.ev.Key, "reply_to", f.d.ReplyTo, "tries", tries, "error", err)
		f.ack(o)
		return
	}
	f.requeueWith(Abandoned, "reply not sent", p.cfg.UnavailableDelay, err, amqp.Table{HeaderReplyTries: int64(tries)})
}

// requeue publishes a copy of the delivery to come back after delay (at
// once when delay is zero), then acks the delivery as o. Returning a
// message this way, rather than with a nack, keeps it off a quorum queue's
// delivery limit. A copy that cannot be published never spins: see
// sendBack.
func (f *flight) requeue(o Outcome, reason string, delay time.Duration, cause error) {
	f.requeueWith(o, reason, delay, cause, nil)
}

// requeueBusy requeues a duplicate whose key another consumer holds for
// remaining more (reason says how), to look again after busyDelay,
// counting the wait in HeaderBusy.
func (f *flight) requeueBusy(reason string, remaining time.Duration) {
	busy := f.head().busy
	f.requeueWith(Busy, reason, f.p.busyDelay(remaining, busy), nil, amqp.Table{HeaderBusy: int64(busy + 1)})
}

// requeueWith is requeue with extra headers on the copy (which it may
// change). The copy carries the attempt count and the reason, and stays
// marked HeaderDeadLetterPending when the delivery was and extra does not
// mark it anew.
func (f *flight) requeueWith(o Outcome, reason string, delay time.Duration, cause error, extra amqp.Table) {
	f.ev.Reason, f.ev.Delay = reason, delay
	f.ev.Err = errors.Join(f.ev.Err, cause)
	if extra == nil {
		extra = make(amqp.Table, 2)
	}
	extra[HeaderAttempt] = int64(max(f.ev.Attempt, f.h.attempt))
	extra[HeaderReason] = reason
	if _, marked := extra[HeaderDeadLetterPending]; !marked && f.head().pending {
		extra[HeaderDeadLetterPending] = cmp.Or(f.head().pendingText, "pending")
	}
	end := f.p.startPublish(f.ctx, Publish{
		Kind: PublishRequeue, Queue: f.p.cfg.Queue, RoutingKey: f.p.cfg.Queue, Delay: delay, Headers: extra,
		MessageID: f.d.MessageId, CorrelationID: f.d.CorrelationId, BodySize: len(f.d.Body),
	})
	sent, copyErr := f.sendBack(delay, extra)
	if sent {
		end(nil)
		f.ack(o)
		return
	}
	end(cmp.Or(copyErr, errCopyNotPublished))
}

// errCopyNotPublished is the error a PublishTracer is given for a
// requeued copy that was not published for another reason than a failed
// publish (too large for frame_max, say): the delivery was nacked.
var errCopyNotPublished = errors.New("amqpidem: copy not published; the delivery was nacked with requeue")

// pendingMark is the extra header that marks a requeued copy
// HeaderDeadLetterPending with text: when it comes back it is
// dead-lettered, whatever FailedDuplicate says.
func pendingMark(text string) amqp.Table {
	return amqp.Table{HeaderDeadLetterPending: headerText(text)}
}

// sendBack publishes a copy of the delivery, with extra headers, to come
// back after delay; it reports whether it did, or else has nacked the
// delivery with requeue, and then the last error a publish of the copy
// gave, if one was tried (for the PublishTracer's span).
//
// When the copy cannot be published (a delay queue declared elsewhere
// with other arguments, a broker refusing publishes), the delivery is held
// for the delay it was to wait anyway (at most UnavailableDelay, less on
// shutdown), then sent straight back to the queue, and only if that fails
// too is it nacked with requeue. A persistent failure so costs one try per
// message per delay, never a hot loop, and a nack (which a quorum queue
// counts against its delivery limit) only when nothing can be published
// at all. With Config.DelayInProcess every delay is waited here.
//
// A copy that would not fit in the connection's frame_max (a delivery
// whose headers are near it) is never published, which the broker would
// answer by closing the channel: the delivery is held for its delay, then
// nacked with requeue, so that it is run again, its headers intact, and
// dead-lettered (with headers dropped to fit; see fit) once its attempts
// are exhausted. A copy marked HeaderDeadLetterPending, whose dead letter
// is due, is published with headers dropped to fit instead, since a nack
// would lose the mark.
func (f *flight) sendBack(delay time.Duration, extra amqp.Table) (bool, error) {
	p := f.p
	msg := copyOf(f.d, f.head(), extra)
	p.sign(&msg)
	if _, pending := extra[HeaderDeadLetterPending]; pending {
		f.fit(&msg, extra, "requeued copy") // a nack would lose the mark
	} else if fm := frameMaxOf(f.b); !fits(&msg, fm) {
		return f.holdTooLarge(&msg, delay, fm), nil
	}
	if delay > 0 && p.cfg.DelayInProcess {
		// Config.DelayInProcess: the delivery waits here, unacked, and
		// its copy goes straight back. If its channel dies meanwhile, the
		// broker has already delivered it again: no copy then.
		start := time.Now()
		if !p.hold(f.ctx, f.d, delay) {
			f.nackRequeue(f.ev.Reason + "; channel closed during the wait")
			return false, nil
		}
		f.ev.Delay = min(delay, time.Since(start)) // less when cut short
		delay = 0
	}
	err := f.publishCopy(delay, msg)
	if err == nil {
		return true, nil
	}
	f.ev.Err = errors.Join(f.ev.Err, err)
	if delay > 0 {
		p.cfg.Logger.ErrorContext(f.ctx, "amqpidem: delayed requeue failed; the message waits here, then goes straight back to the queue",
			"queue", p.cfg.Queue, "key", f.ev.Key, "delay", delay, "error", err)
		p.sleep(f.ctx, min(delay, p.cfg.UnavailableDelay))
		if err = f.publishCopy(0, msg); err == nil {
			return true, nil // it waited its delay here instead
		}
		f.ev.Err = errors.Join(f.ev.Err, err)
	}
	f.nackRequeue(f.ev.Reason + "; nacked back, its copy not published")
	return false, err
}

// publishCopy publishes msg, sendBack's copy of the delivery, to come
// back after delay, within settleTimeout.
func (f *flight) publishCopy(delay time.Duration, msg amqp.Publishing) error {
	sctx, cancel := calmContext(f.calmCtx())
	defer cancel()
	return f.b.requeue(sctx, f.p.cfg.Queue, msg, delay)
}

// fit makes msg, a copy of the delivery (what says which: "dead letter",
// "requeued copy") fit in the connection's frame_max by dropping the
// delivery's headers, the largest first, never those of keep (amqpidem's,
// set on this copy); see fitHeaders. When it drops any, it says so in the
// copy (HeaderHeadersDropped), in the Event's Err (wrapping ErrTooLarge)
// and in an error log line: the message is kept, its body whole, but
// headers of it are lost.
func (f *flight) fit(msg *amqp.Publishing, keep amqp.Table, what string) {
	keep = maps.Clone(keep)
	for _, k := range []string{HeaderOriginalExchange, HeaderOriginalRoutingKey, HeaderUserID, HeaderSignature, HeaderKey, HeaderEndpoint} {
		keep[k] = nil // amqpidem's: short, and signed (see sign)
	}
	note := fitHeaders(msg, keep, frameMaxOf(f.b))
	if note == "" {
		return
	}
	err := fmt.Errorf("amqpidem: %s would exceed the connection's frame_max: %s: %w", what, note, ErrTooLarge)
	f.ev.Err = errors.Join(f.ev.Err, err)
	f.p.cfg.Logger.ErrorContext(f.ctx, "amqpidem: "+what+" too large for frame_max; headers dropped to fit",
		"queue", f.p.cfg.Queue, "key", f.ev.Key, "dropped", note)
}

// holdTooLarge settles a delivery whose requeued copy msg would not fit
// in frameMax: see sendBack. It holds the delivery for delay (as
// Config.DelayInProcess does), then nacks it with requeue; it reports
// false, as sendBack does when it nacked.
func (f *flight) holdTooLarge(msg *amqp.Publishing, delay time.Duration, frameMax int) bool {
	p := f.p
	err := fmt.Errorf("amqpidem: requeued copy of %d header bytes would exceed the connection's frame_max %d: %w",
		headerFrameSize(msg), frameMax, ErrTooLarge)
	p.cfg.Logger.ErrorContext(f.ctx, "amqpidem: requeued copy too large for frame_max; the message waits here, then is nacked back to the queue",
		"queue", p.cfg.Queue, "key", f.ev.Key, "delay", delay, "error", err)
	f.ev.Err = errors.Join(f.ev.Err, err)
	reason := f.ev.Reason + "; copy too large, nacked"
	if delay > 0 {
		start := time.Now()
		if !p.hold(f.ctx, f.d, delay) {
			f.nackRequeue(reason + "; channel closed during the wait")
			return false
		}
		f.ev.Delay = min(delay, time.Since(start))
	}
	delayed := f.ev.Delay
	f.nackRequeue(reason)
	f.ev.Delay = delayed // waited here
	return false
}

// nackRequeue nacks the delivery with requeue, for reason: the broker
// delivers it again at once. It is the last resort when no copy can be
// published: a quorum queue counts the nack against its delivery limit,
// as it counts a crash.
func (f *flight) nackRequeue(reason string) {
	nackRequeue(f.d, &f.ev, reason, nil)
}

// nackRequeue nacks d with requeue, noting reason and cause in ev.
func nackRequeue(d *amqp.Delivery, ev *Event, reason string, cause error) {
	ev.Outcome, ev.Reason, ev.Delay = Abandoned, reason, 0
	ev.Err = errors.Join(ev.Err, cause)
	if err := d.Nack(false, true); err != nil {
		ev.Err = errors.Join(ev.Err, fmt.Errorf("amqpidem: nack: %w", err))
	}
}

// deadLetter publishes the delivery with fault headers to the dead-letter
// target, then acks it. An unroutable target never loses the message: it
// is requeued, marked to be dead-lettered again.
func (f *flight) deadLetter(reason string, cause error) {
	p, b := f.p, f.b
	f.ev.Reason = reason
	f.ev.Err = errors.Join(f.ev.Err, cause)
	sctx, cancel := calmContext(f.calmCtx())
	defer cancel()
	fault := amqp.Table{
		HeaderReason:   reason,
		HeaderError:    headerText(cause.Error()),
		HeaderAttempt:  int64(max(f.ev.Attempt, f.h.attempt)),
		HeaderConsumer: p.cfg.ConsumerName,
		HeaderKey:      headerText(f.ev.Key),
		HeaderEndpoint: p.cfg.Endpoint,
	}
	msg := deadLetterOf(f.d, f.head(), fault)
	delete(msg.Headers, HeaderDeadLetterPending)
	exchange, key := p.cfg.DeadLetterExchange, p.cfg.DeadLetterRoutingKey
	end := p.startPublish(f.ctx, Publish{
		Kind: PublishDeadLetter, Queue: p.cfg.Queue, Exchange: exchange, RoutingKey: key, Headers: msg.Headers,
		MessageID: msg.MessageId, CorrelationID: msg.CorrelationId, BodySize: len(msg.Body),
	})
	p.sign(&msg)
	f.fit(&msg, fault, "dead letter")
	ownQueue := exchange == "" && key == p.cfg.Queue+".dlq"
	var err error
	for try := 0; try < 2; try++ {
		if ownQueue {
			if err = b.declare(sctx, key, p.cfg.DeadLetterQueueArgs, false); err != nil {
				break
			}
		}
		if err = b.publishAlone(sctx, exchange, key, msg); err == nil || !errors.Is(err, ErrUnroutable) || !ownQueue {
			break
		}
		b.forget(key) // someone deleted our dead-letter queue: declare it again
	}
	end(err)
	if err != nil {
		p.cfg.Logger.ErrorContext(f.ctx, "amqpidem: dead letter not delivered; requeued to try again",
			"queue", p.cfg.Queue, "key", f.ev.Key, "exchange", exchange, "routing_key", key, "error", err)
		f.requeueWith(Abandoned, reason, p.cfg.UnavailableDelay, err, pendingMark(reason+": "+cause.Error()))
		return
	}
	f.ack(DeadLettered)
}

// deadLetterExpired dead-letters the delivery, whose HeaderExpiresAt has
// passed: its publisher gave it an expiration that requeues have
// outlived. It is not run, and not dropped either. Only a run is stopped
// so: a duplicate of completed work is still acked as one.
func (f *flight) deadLetterExpired() {
	f.freeSlot()
	at := time.UnixMilli(f.head().expiresAt).UTC()
	f.deadLetter("expired", fmt.Errorf("expired at %s (%s)", at.Format(time.RFC3339Nano), HeaderExpiresAt))
}

// sleep waits d, or less if ctx ends or the consumer begins stopping.
func (p *processor) sleep(ctx context.Context, d time.Duration) {
	p.wait(ctx, d, nil)
}

// hold is sleep for a delivery held unacked during its delay: it reports
// false, at once, if the delivery's channel dies meanwhile (the broker
// then delivers it again), true when the wait ends otherwise.
func (p *processor) hold(ctx context.Context, d *amqp.Delivery, delay time.Duration) bool {
	var dead <-chan struct{} // nil, never ready, unless a Consumer's acker says
	if a, ok := d.Acknowledger.(*acker); ok {
		dead = a.dead
	}
	return p.wait(ctx, delay, dead)
}

// wait waits d, or less if ctx ends, the consumer begins stopping or wake
// is closed; it reports false, at once, if dead is closed first.
func (p *processor) wait(ctx context.Context, d time.Duration, dead <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-dead:
		return false
	case <-t.C:
	case <-ctx.Done():
	case <-p.stopping:
	case <-p.wake:
	}
	return true
}
