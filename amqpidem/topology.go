package amqpidem

import (
	"math"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Headers amqpidem writes on the copies it publishes. User headers are kept
// as they are.
//
// HeaderOriginalExchange, HeaderOriginalRoutingKey, HeaderUserID,
// HeaderOriginalExpiration and HeaderExpiresAt are carried from copy to
// copy, so a publisher can set them on a message's first delivery: they
// are informational, and nothing in amqpidem decides anything from them
// (HeaderExpiresAt can only shorten a copy's life; see there).
const (
	// HeaderAttempt is the number of executions so far, on requeued and
	// dead-lettered copies.
	HeaderAttempt = "x-amqpidem-attempt"
	// HeaderFirstSeen is when amqpidem first requeued or dead-lettered
	// the message (time.Time).
	HeaderFirstSeen = "x-amqpidem-first-seen"
	// HeaderOriginalExchange is the exchange the message was first
	// published to. It is kept from the delivery's headers when it is
	// there as a string (or byte array) of at most 255 bytes, together
	// with a valid HeaderOriginalRoutingKey; otherwise both are set from
	// the delivery's own exchange and routing key. A publisher can set it
	// on a first delivery: it is informational, nothing in amqpidem
	// decides anything from it.
	HeaderOriginalExchange = "x-amqpidem-original-exchange"
	// HeaderOriginalRoutingKey is the routing key the message was first
	// published with; kept or replaced together with
	// HeaderOriginalExchange, under the same rules. Informational, like
	// it.
	HeaderOriginalRoutingKey = "x-amqpidem-original-routing-key"
	// HeaderReason says why a copy was requeued or dead-lettered
	// ("permanent failure", "attempts exhausted", "key conflict", ...).
	HeaderReason = "x-amqpidem-reason"
	// HeaderError is the handler's or the stored error text, on dead
	// letters.
	HeaderError = "x-amqpidem-error"
	// HeaderConsumer names the consumer that dead-lettered the message.
	HeaderConsumer = "x-amqpidem-consumer"
	// HeaderKey is the idempotency key, on dead letters ("" when the
	// message had none).
	HeaderKey = "x-amqpidem-key"
	// HeaderEndpoint is the Config.Endpoint under which the key's record
	// is kept, on dead letters: what a tool that replays them needs to find
	// the record (see StoreKey).
	HeaderEndpoint = "x-amqpidem-endpoint"
	// HeaderDeadLetterPending marks a copy requeued because its dead
	// letter could not be routed: it is dead-lettered again, whatever
	// the failed-duplicate policy.
	HeaderDeadLetterPending = "x-amqpidem-dead-letter-pending"
	// HeaderReplyTries counts the requeues of a message whose result is
	// stored but whose reply could not be sent; after MaxAttempts the reply
	// is given up (logged) and the message acked.
	HeaderReplyTries = "x-amqpidem-reply-tries"
	// HeaderUserID carries the original user-id property, which a
	// republished copy cannot keep. It is set from the delivery's user-id
	// when that is present (RabbitMQ checked it against the publishing
	// connection's user). Otherwise a value already in the headers is
	// kept if it is a string of at most 255 bytes and dropped if not; such
	// a value may come from a publisher rather than from the broker: it
	// is informational, nothing in amqpidem decides anything from it.
	HeaderUserID = "x-amqpidem-user-id"
	// HeaderExpiresAt is when a message that was published with an
	// expiration (per-message TTL) expires, in milliseconds since the
	// Unix epoch (int64). The first copy amqpidem makes sets it to the
	// time of the copy plus the delivery's expiration, and no copy ever
	// moves it later. Copies themselves carry no expiration: the broker
	// would drop an expired copy silently (a dead letter due included),
	// would dead-letter a delayed one back before its delay, and removes
	// it on dead-lettering anyway. Instead, a delivery whose
	// HeaderExpiresAt has passed and that would run is dead-lettered
	// ("expired"); a duplicate of completed work is still acked.
	// Dead letters do not carry it, so that one moved back to the queue
	// runs.
	HeaderExpiresAt = "x-amqpidem-expires-at"
	// HeaderOriginalExpiration is the expiration property the message was
	// first seen with, on dead letters (which carry none, so that they do
	// not expire from the dead-letter queue) and requeued copies.
	HeaderOriginalExpiration = "x-amqpidem-original-expiration"
	// maxHeaderText bounds the error text written into a header.
	maxHeaderText = 4 << 10
	// maxShortText bounds the broker-given names kept from incoming
	// headers (exchange, routing key, user id): AMQP short strings.
	maxShortText = 255
	// maxExpiration is the largest expiration RabbitMQ accepts, in ms.
	maxExpiration = math.MaxUint32
)

// Queue types, as in the x-queue-type argument and Config.QueueType.
const (
	// queueClassic is a classic queue.
	queueClassic = "classic"
	// queueQuorum is a quorum queue.
	queueQuorum = "quorum"
)

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
// delay of the queue "<Queue>.delay.<ms>" (or ".delayq.") it goes
// through. Delays are rounded to two significant digits of milliseconds,
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

// copyOf returns the Publishing that requeues d: every property, header
// and the body of d, plus extra headers. Its expiration is what remains of
// the message's own (see HeaderExpiresAt), so that requeues never extend
// a message's life.
func copyOf(d *amqp.Delivery, extra amqp.Table) amqp.Publishing {
	return copyAt(d, extra, time.Now())
}

// copyAt is copyOf at time now.
func copyAt(d *amqp.Delivery, extra amqp.Table, now time.Time) amqp.Publishing {
	msg := baseCopy(d, extra, now)
	recordExpiry(d, msg.Headers, now)
	// A dead letter moved back and requeued is a message again.
	delete(msg.Headers, HeaderError)
	delete(msg.Headers, HeaderConsumer)
	return msg
}

// expired reports whether d carries a HeaderExpiresAt that has passed at
// now. A publisher can set the header: it can only bring a dead letter
// closer.
func expired(d *amqp.Delivery, now time.Time) bool {
	at, ok := headerInt64(d.Headers[HeaderExpiresAt])
	return ok && now.UnixMilli() >= at
}

// deadLetterOf returns the Publishing that dead-letters d: like copyOf,
// but without an expiration, so that the dead letter does not expire from
// the dead-letter queue; the message's first expiration is kept in
// HeaderOriginalExpiration.
func deadLetterOf(d *amqp.Delivery, extra amqp.Table) amqp.Publishing {
	msg := baseCopy(d, extra, time.Now())
	delete(msg.Headers, HeaderExpiresAt) // a dead letter moved back runs, not expires
	if _, ok := msg.Headers[HeaderOriginalExpiration]; !ok && d.Expiration != "" {
		msg.Headers[HeaderOriginalExpiration] = d.Expiration
	}
	return msg
}

// baseCopy returns a Publishing with every property but the expiration,
// every header and the body of d, plus extra headers, at time now: broker
// headers removed, amqpidem's informational headers checked or set.
func baseCopy(d *amqp.Delivery, extra amqp.Table, now time.Time) amqp.Publishing {
	h := make(amqp.Table, len(d.Headers)+len(extra)+4)
	for k, v := range d.Headers {
		h[k] = v
	}
	for _, k := range brokerHeaders {
		delete(h, k)
	}
	ex, exOK := shortText(h[HeaderOriginalExchange], true)
	rk, rkOK := shortText(h[HeaderOriginalRoutingKey], true)
	if !exOK || !rkOK {
		ex, rk = d.Exchange, d.RoutingKey
	}
	h[HeaderOriginalExchange], h[HeaderOriginalRoutingKey] = ex, rk
	if _, ok := h[HeaderFirstSeen]; !ok {
		h[HeaderFirstSeen] = now.UTC().Truncate(time.Second)
	}
	for k, v := range extra {
		h[k] = v
	}
	if d.UserId != "" {
		// RabbitMQ refuses a user-id property that is not the publishing
		// connection's user, so it travels as a header.
		h[HeaderUserID] = d.UserId
	} else if v, ok := h[HeaderUserID]; ok {
		if _, valid := shortText(v, false); !valid {
			delete(h, HeaderUserID)
		}
	}
	return amqp.Publishing{
		Headers:         h,
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

// shortText returns v as a string when it is one (or, with bytesOK, a
// byte array) of at most maxShortText bytes.
func shortText(v any, bytesOK bool) (string, bool) {
	var s string
	switch v := v.(type) {
	case string:
		s = v
	case []byte:
		if !bytesOK {
			return "", false
		}
		s = string(v)
	default:
		return "", false
	}
	return s, len(s) <= maxShortText
}

// recordExpiry records in h (a copy's headers) when d expires, as
// HeaderExpiresAt (ms since the epoch): the header's value, bounded by d's
// own expiration, or now plus d's expiration when the header is missing or
// not an integer. Nothing is recorded for a message with neither, or with
// an expiration RabbitMQ would not accept.
func recordExpiry(d *amqp.Delivery, h amqp.Table, now time.Time) {
	nowMs := now.UnixMilli()
	ttl, ttlOK := parseExpiration(d.Expiration)
	if d.Expiration != "" && !ttlOK {
		return
	}
	at, atOK := headerInt64(h[HeaderExpiresAt])
	switch {
	case ttlOK && atOK:
		at = min(at, nowMs+ttl)
	case ttlOK:
		at, atOK = nowMs+ttl, true
	}
	if !atOK {
		return
	}
	h[HeaderExpiresAt] = at
	if _, ok := h[HeaderOriginalExpiration]; !ok && d.Expiration != "" {
		h[HeaderOriginalExpiration] = d.Expiration
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

// headerInt64 reads a header of any AMQP integer type.
func headerInt64(v any) (int64, bool) {
	switch v := v.(type) {
	case int:
		return int64(v), true
	case int8:
		return int64(v), true
	case int16:
		return int64(v), true
	case int32:
		return int64(v), true
	case int64:
		return v, true
	case uint8:
		return int64(v), true
	case uint16:
		return int64(v), true
	case uint32:
		return int64(v), true
	}
	return 0, false
}

// headerText cuts s to fit a header.
func headerText(s string) string {
	if len(s) > maxHeaderText {
		return s[:maxHeaderText-3] + "..."
	}
	return s
}
