package amqpidem

import (
	"math"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Headers amqpidem writes on the copies it publishes. User headers are kept
// as they are.
const (
	// HeaderAttempt is the number of executions so far, on requeued and
	// dead-lettered copies.
	HeaderAttempt = "x-amqpidem-attempt"
	// HeaderFirstSeen is when amqpidem first requeued or dead-lettered
	// the message (time.Time).
	HeaderFirstSeen = "x-amqpidem-first-seen"
	// HeaderOriginalExchange is the exchange the message was first
	// published to.
	HeaderOriginalExchange = "x-amqpidem-original-exchange"
	// HeaderOriginalRoutingKey is the routing key it was first published
	// with.
	HeaderOriginalRoutingKey = "x-amqpidem-original-routing-key"
	// HeaderReason says why a copy was requeued or dead-lettered
	// ("permanent failure", "attempts exhausted", "key conflict", ...).
	HeaderReason = "x-amqpidem-reason"
	// HeaderError is the handler's or the stored error text, on dead
	// letters.
	HeaderError = "x-amqpidem-error"
	// HeaderConsumer names the consumer that dead-lettered the message.
	HeaderConsumer = "x-amqpidem-consumer"
	// HeaderKey is the idempotency key, on dead letters.
	HeaderKey = "x-amqpidem-key"
	// HeaderDeadLetterPending marks a copy requeued because its dead
	// letter could not be routed: it is dead-lettered again, whatever
	// the failed-duplicate policy.
	HeaderDeadLetterPending = "x-amqpidem-dead-letter-pending"
	// HeaderUserID carries the original user-id property, which a
	// republished copy cannot keep.
	HeaderUserID = "x-amqpidem-user-id"
	// maxHeaderText bounds the error text written into a header.
	maxHeaderText = 4 << 10
)

// delayQueue names the delay tier queue for d on queue.
func delayQueue(queue string, d time.Duration) string {
	return queue + ".delay." + strconv.FormatInt(d.Milliseconds(), 10)
}

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
// dead-lettered by RabbitMQ back to queue through the default exchange. One
// queue per delay: with a queue-level TTL every message in it expires in
// order, so a short delay never waits behind a long one. The queue deletes
// itself when unused for long after its messages are gone (each publish
// declares it again, which counts as use).
func delayQueueArgs(queue string, ttl time.Duration) amqp.Table {
	ms := ttl.Milliseconds()
	return amqp.Table{
		"x-message-ttl":             ms,
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": queue,
		"x-expires":                 2*ms + int64(time.Minute/time.Millisecond),
		"x-queue-type":              "classic",
	}
}

// brokerHeaders are headers RabbitMQ writes on dead-lettering; they are not
// carried onto amqpidem's own copies (they would grow with every hop and
// describe the delay queues, not the message).
var brokerHeaders = []string{"x-death", "x-first-death-exchange", "x-first-death-queue",
	"x-first-death-reason", "x-last-death-exchange", "x-last-death-queue", "x-last-death-reason"}

// copyOf returns a Publishing with every property, header and the body of
// d, plus extra headers.
func copyOf(d *amqp.Delivery, extra amqp.Table) amqp.Publishing {
	h := make(amqp.Table, len(d.Headers)+len(extra)+2)
	for k, v := range d.Headers {
		h[k] = v
	}
	for _, k := range brokerHeaders {
		delete(h, k)
	}
	if _, ok := h[HeaderOriginalExchange]; !ok {
		h[HeaderOriginalExchange] = d.Exchange
		h[HeaderOriginalRoutingKey] = d.RoutingKey
	}
	if _, ok := h[HeaderFirstSeen]; !ok {
		h[HeaderFirstSeen] = time.Now().UTC().Truncate(time.Second)
	}
	for k, v := range extra {
		h[k] = v
	}
	if d.UserId != "" {
		// RabbitMQ refuses a user-id property that is not the publishing
		// connection's user, so it travels as a header.
		h[HeaderUserID] = d.UserId
	}
	return amqp.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    d.DeliveryMode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		Expiration:      d.Expiration,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// headerText cuts s to fit a header.
func headerText(s string) string {
	if len(s) > maxHeaderText {
		return s[:maxHeaderText-3] + "..."
	}
	return s
}
