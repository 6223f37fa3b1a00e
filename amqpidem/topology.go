package amqpidem

import (
	"math"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Queue types, as in the x-queue-type argument and Config.QueueType.
const (
	// queueClassic is a classic queue.
	queueClassic = "classic"
	// queueQuorum is a quorum queue.
	queueQuorum = "quorum"
)

// maxExpiration is the largest expiration RabbitMQ accepts, in ms.
const maxExpiration = math.MaxUint32

// delayQueue names the delay tier queue for d on queue, a work queue of
// type queueType: "<queue>.delay.<ms>" for a classic work queue (a classic
// delay queue), "<queue>.delayq.<ms>" for a quorum one (a quorum delay
// queue). The names differ because a queue's type and arguments cannot
// change: declaring the quorum kind under the classic name, which may
// already exist, would fail with PRECONDITION_FAILED.
func delayQueue(queue, queueType string, d time.Duration) string {
	infix := ".delay."
	if queueType == queueQuorum {
		infix = ".delayq."
	}
	return queue + infix + strconv.FormatInt(d.Milliseconds(), 10)
}

// DelayTier is the delay a requeue asked to wait d actually waits: the
// delay of the queue it goes through, "<Queue>.delay.<ms>" on a classic
// work queue, "<Queue>.delayq.<ms>" on a quorum one. Delays are rounded to two significant digits of milliseconds,
// at least 10 ms, so there are at most 90 tiers per decade: a bounded
// label for metrics.
func DelayTier(d time.Duration) time.Duration { return delayTier(d) }

// delayTier rounds d to two significant digits of milliseconds (at least
// 10 ms), so that jittered backoffs share a bounded set of delay queues
// (at most 90 per decade) while staying within 5% of what was asked.
func delayTier(d time.Duration) time.Duration {
	ms := d.Milliseconds()
	if ms < 10 {
		return 10 * time.Millisecond
	}
	scale := int64(math.Pow10(int(math.Floor(math.Log10(float64(ms)))) - 1))
	return time.Duration((ms+scale/2)/scale*scale) * time.Millisecond
}

// delayQueueArgs makes a queue whose messages wait ttl and then are
// dead-lettered by RabbitMQ back to queue, a work queue of type queueType,
// through the default exchange. One queue per delay: with a queue-level
// TTL every message in it expires in order, so a short delay never waits
// behind a long one. The queue deletes itself (x-expires) when unused for
// long after its messages are gone; each requeue declares it again at
// least every redeclareAfter, which counts as use.
//
// For a classic work queue the delay queue is classic, with x-expires
// 2*ttl+1m. Classic dead-lettering is at-most-once: the broker does not
// wait for the work queue to confirm the copy, and the delay queue is not
// replicated; a broker crash while a copy waits, or a failure on the way
// back, can lose it.
//
// For a quorum work queue the delay queue is a quorum queue (replicated)
// with at-least-once dead-lettering (x-dead-letter-strategy
// "at-least-once", which requires x-overflow "reject-publish" and
// RabbitMQ 3.10 or later): a copy stays in the delay queue until the work
// queue has confirmed it. A quorum delay queue has no x-expires: it would
// delete the queue with the copies waiting in it, and RabbitMQ releases
// after 3.10 do not renew a quorum queue's expiry when it is declared
// again, so a queue in use would be deleted on schedule. Quorum delay
// queues stay (empty when unused); at most 90 tiers per decade of delays.
func delayQueueArgs(queue, queueType string, ttl time.Duration, extra amqp.Table) amqp.Table {
	ms := ttl.Milliseconds()
	args := make(amqp.Table, len(extra)+6)
	for k, v := range extra {
		args[k] = v // Config.Validate refused the keys set below
	}
	args["x-message-ttl"] = ms
	args["x-dead-letter-exchange"] = ""
	args["x-dead-letter-routing-key"] = queue
	if queueType == queueQuorum {
		args["x-queue-type"] = queueQuorum
		args["x-dead-letter-strategy"] = "at-least-once"
		args["x-overflow"] = "reject-publish"
		return args
	}
	args["x-queue-type"] = queueClassic
	args["x-expires"] = 2*ms + int64(time.Minute/time.Millisecond)
	return args
}

// delayArgsOwned are the delay queue arguments that delayQueueArgs sets
// and Config.DelayQueueArgs may not.
var delayArgsOwned = []string{"x-queue-type", "x-message-ttl", "x-expires", "x-overflow",
	"x-dead-letter-exchange", "x-dead-letter-routing-key", "x-dead-letter-strategy"}

// brokerHeaders are headers RabbitMQ writes on dead-lettering; they are not
// carried onto amqpidem's own copies (they would grow with every hop and
// describe the delay queues, not the message).
var brokerHeaders = []string{"x-death", "x-first-death-exchange", "x-first-death-queue",
	"x-first-death-reason", "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"}

// copyOf returns the Publishing that requeues d, whose headers say h
// (parsed):
// every property, header and the body of d, plus extra headers. Its
// expiration is what remains of the message's own (see HeaderExpiresAt),
// so that requeues never extend a message's life.
func copyOf(d *amqp.Delivery, h *headers, extra amqp.Table) amqp.Publishing {
	return copyAt(d, h, extra, time.Now())
}

// copyAt is copyOf at time now.
func copyAt(d *amqp.Delivery, h *headers, extra amqp.Table, now time.Time) amqp.Publishing {
	msg := baseCopy(d, h, extra, now)
	recordExpiry(d, h, msg.Headers, now)
	// A dead letter moved back and requeued is a message again.
	delete(msg.Headers, HeaderError)
	delete(msg.Headers, HeaderConsumer)
	return msg
}

// deadLetterOf returns the Publishing that dead-letters d, whose headers
// say h: like copyOf,
// but without an expiration, so that the dead letter does not expire from
// the dead-letter queue; the message's first expiration is kept in
// HeaderOriginalExpiration.
func deadLetterOf(d *amqp.Delivery, h *headers, extra amqp.Table) amqp.Publishing {
	msg := baseCopy(d, h, extra, time.Now())
	delete(msg.Headers, HeaderExpiresAt) // a dead letter moved back runs, not expires
	if !h.originalExpiration && d.Expiration != "" {
		msg.Headers[HeaderOriginalExpiration] = d.Expiration
	}
	return msg
}

// baseCopy returns a Publishing with every property but the expiration,
// every header and the body of d, plus extra headers, at time now: broker
// headers removed, amqpidem's informational headers kept as h says they
// may be, or set.
func baseCopy(d *amqp.Delivery, h *headers, extra amqp.Table, now time.Time) amqp.Publishing {
	t := make(amqp.Table, len(d.Headers)+len(extra)+4)
	for k, v := range d.Headers {
		t[k] = v
	}
	for _, k := range brokerHeaders {
		delete(t, k)
	}
	delete(t, HeaderBusy) // counts one run of busy waits: only requeueBusy sets it
	if h.origin {
		t[HeaderOriginalExchange], t[HeaderOriginalRoutingKey] = h.exchange, h.routingKey
	} else {
		t[HeaderOriginalExchange], t[HeaderOriginalRoutingKey] = d.Exchange, d.RoutingKey
	}
	if !h.firstSeen {
		t[HeaderFirstSeen] = now.UTC().Truncate(time.Second)
	}
	for k, v := range extra {
		t[k] = v
	}
	if d.UserId != "" {
		// RabbitMQ refuses a user-id property that is not the publishing
		// connection's user, so it travels as a header.
		t[HeaderUserID] = d.UserId
	} else if h.badUserID {
		delete(t, HeaderUserID)
	}
	return amqp.Publishing{
		Headers:         t,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    d.DeliveryMode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// recordExpiry records in t (a copy's headers) when d, whose headers say
// h, expires, as HeaderExpiresAt (ms since the epoch): the header's value,
// bounded by d's own expiration, or now plus d's expiration when the
// header is missing or not an integer. Nothing is recorded for a message
// with neither, or with an expiration RabbitMQ would not accept.
func recordExpiry(d *amqp.Delivery, h *headers, t amqp.Table, now time.Time) {
	ttl, ttlOK := parseExpiration(d.Expiration)
	if d.Expiration != "" && !ttlOK {
		return
	}
	at, atOK := h.expiresAt, h.expires
	switch {
	case ttlOK && atOK:
		at = min(at, now.UnixMilli()+ttl)
	case ttlOK:
		at, atOK = now.UnixMilli()+ttl, true
	}
	if !atOK {
		return
	}
	t[HeaderExpiresAt] = at
	if !h.originalExpiration && d.Expiration != "" {
		t[HeaderOriginalExpiration] = d.Expiration
	}
}

// parseExpiration reads an expiration property as RabbitMQ does: a
// decimal number of milliseconds from 0 to maxExpiration.
func parseExpiration(s string) (int64, bool) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > maxExpiration {
		return 0, false
	}
	return n, true
}
