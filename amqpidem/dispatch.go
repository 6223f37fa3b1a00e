package amqpidem

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// dispatch publishes the staged messages of value, the stored value of
// the delivery's completed record (of fence fence), that are not
// published yet, and records in the record what became of them. It
// reports whether the delivery may now be settled as completed work (every
// message published or given up); if not, it has requeued the delivery,
// whose next copy publishes the rest. own says that this delivery's
// execution stored value: its messages are published, not re-published,
// and its claim is its own.
//
// Whoever publishes holds the claim: the storing execution from its
// completion on, for a lease TTL; a copy takes it (compare-and-set,
// lock.Amender) before it publishes, with a claim tagged as its own
// (newClaim), so that of copies arriving together one publishes and the
// others wait as busy duplicates, as they do while the claim is held. An
// execution gives its claim up once it stops publishing, done or not (so
// that neither the next copy nor amqpidem outbox redrive waits for it to
// pass); one whose claim passed before it could publish (stalled, the
// process paused) publishes nothing and goes back to the queue, for a copy
// to take the claim.
//
// Only the broker's refusal of a message (IsRefused: returned, or its
// channel closed by the broker over it) counts as one of its tries, and
// MaxAttempts of them give it up. A publish that failed on the way (the
// connection lost, the confirm lost or nacked) stops the publishing: the
// delivery is requeued after UnavailableDelay, the claim given up, and no
// try counted, however often that happens.
func (f *flight) dispatch(value []byte, fence int64, own bool) bool {
	p := f.p
	v, err := splitValue(value)
	if err != nil {
		// Nothing in it can be published; the result stands. Said loudly,
		// not retried: a damaged record does not mend itself.
		f.ev.Err = errors.Join(f.ev.Err, err)
		p.cfg.Logger.ErrorContext(f.ctx, "amqpidem: staged messages unreadable; not published",
			"queue", p.cfg.Queue, "key", f.ev.Key, "error", err)
		return true
	}
	pending := 0
	for _, e := range v.outbox {
		if e.state == OutboxPending {
			pending++
		}
	}
	if pending == 0 {
		return true
	}
	now := time.Now()
	left := time.UnixMilli(v.claimUntil).Sub(now)
	switch {
	case own && left <= 0:
		f.requeue(Abandoned, "outbox claim passed", MinInProgressDelay, nil)
		return false
	case !own && left > 0:
		f.requeueBusy("outbox being published", left)
		return false
	case !own:
		taken := append([]byte(nil), value...)
		// Tagged, so that of copies taking it from this same value at
		// this same millisecond only one does (see claimTagged).
		binary.BigEndian.PutUint64(taken[v.claimAt:], newClaim(claimFrom(now, p.claimTTL())))
		if !f.amended(value, taken, fence) {
			return false
		}
		value = taken
	}
	amended := append([]byte(nil), value...)
	var broken error // a publish failed for want of the broker: stop
	for i, e := range v.outbox {
		if e.state != OutboxPending || broken != nil {
			continue
		}
		err := f.publishStaged(e.msg)
		switch {
		case err == nil:
			amended[e.at] = byte(OutboxPublished)
			pending--
			f.ev.Outbox.Published++
			if !own {
				f.ev.Outbox.Republished++
			}
		case IsRefused(err) || errors.Is(err, errBadValue):
			// The broker refused this message (returned it, or closed
			// the channel over it): a try, counted toward MaxAttempts.
			tries := int(e.tries) + 1
			amended[e.at+1] = byte(min(tries, 255))
			if tries >= p.cfg.MaxAttempts || errors.Is(err, errBadValue) {
				amended[e.at] = byte(OutboxReturned)
				pending--
				f.ev.Outbox.Returned++
				p.cfg.Logger.WarnContext(f.ctx, "amqpidem: staged message given up; it stays in the record (amqpidem outbox redrive publishes it again)",
					"queue", p.cfg.Queue, "key", f.ev.Key, "index", i, "tries", tries, "error", err)
			}
			f.ev.Err = errors.Join(f.ev.Err, err)
		default:
			// The broker or the way to it failed (the connection lost,
			// a confirm lost or nacked, no channel): not the message's
			// fault, so not a try; the rest waits for the next copy.
			broken = err
			f.ev.Err = errors.Join(f.ev.Err, err)
		}
	}
	// Done publishing: the claim is given up, so that the next copy
	// publishes the rest at once, and an operator's tool (outbox
	// redrive, which takes it too) need not wait for it to pass.
	clear(amended[v.claimAt : v.claimAt+claimLen])
	if !bytes.Equal(amended, value) && !f.amended(value, amended, fence) {
		return false
	}
	if pending == 0 {
		return true
	}
	reason := "outbox not published"
	if broken == nil {
		reason = "outbox returned"
	}
	f.requeue(Abandoned, reason, p.cfg.UnavailableDelay, nil)
	return false
}

// publishStaged publishes one staged message, as encoded, confirmed and
// mandatory: with the trace context Stage wrote into its headers, which
// its record keeps.
func (f *flight) publishStaged(enc []byte) error {
	exchange, key, msg, _, err := readPublishing(enc)
	if err != nil {
		return fmt.Errorf("%w: %w", errBadValue, err)
	}
	if f.p.cfg.Tracer != nil && msg.Headers == nil {
		msg.Headers = make(amqp.Table, 2) // staged without a Tracer
	}
	end := f.p.startPublish(f.ctx, Publish{
		Kind: PublishOutbox, Queue: f.p.cfg.Queue, Exchange: exchange, RoutingKey: key, Headers: msg.Headers,
		MessageID: msg.MessageId, CorrelationID: msg.CorrelationId, BodySize: len(msg.Body),
	})
	sctx, cancel := calmContext(f.calmCtx())
	defer cancel()
	err = f.b.publish(sctx, exchange, key, msg)
	end(err)
	return err
}

// amended records value as the record's new stored value in place of old
// (amend) and reports whether it did; if not, it has requeued the
// delivery, to look at the record again.
func (f *flight) amended(old, value []byte, fence int64) bool {
	err := f.amend(old, value, fence)
	switch {
	case err == nil:
		return true
	case errors.Is(err, lock.ErrChanged):
		// Another delivery changed the record first (took the claim,
		// recorded its publishes): look again shortly.
		f.requeue(Abandoned, "outbox changed", MinInProgressDelay, err)
	default:
		// What was published is not recorded: published again later, a
		// duplicate downstream, never a loss.
		f.requeue(Abandoned, "store unavailable", f.p.cfg.UnavailableDelay, err)
	}
	return false
}

// amend records value as the record's new stored value in place of old,
// compare-and-set (lock.Amender), retrying for up to settleTimeout while
// the store does not answer.
func (f *flight) amend(old, value []byte, fence int64) error {
	a := f.p.amender
	if a == nil {
		return errors.New("amqpidem: the store cannot amend records (lock.Amender): staged messages are not marked published")
	}
	return settle(f.calmCtx(), "Amend", func(ctx context.Context) error { return a.Amend(ctx, f.storeKey, fence, old, value) })
}

// publishUnkeyed publishes the messages an execution without a record
// staged, before its delivery is acked; it reports whether all were
// published, or else returns the first error.
func (f *flight) publishUnkeyed(staged [][]byte) error {
	for _, enc := range staged {
		if err := f.publishStaged(enc); err != nil {
			return err
		}
		f.ev.Outbox.Published++
	}
	return nil
}
