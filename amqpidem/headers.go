package amqpidem

import (
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Headers amqpidem writes on the copies it publishes. User headers are kept
// as they are.
//
// HeaderOriginalExchange, HeaderOriginalRoutingKey, HeaderUserID,
// HeaderOriginalExpiration and HeaderExpiresAt are carried from copy to
// copy, so a publisher can set them on a message's first delivery: they
// are informational, and nothing in the consumer decides anything from
// them (HeaderExpiresAt can only shorten a copy's life; see there). With
// Config.SigningKey, the original exchange and routing key are carried
// only from a copy amqpidem signed (HeaderSignature), so that the CLI can
// trust them on a signed dead letter.
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
	// on a first delivery: it is informational, nothing in the consumer
	// decides anything from it. With Config.SigningKey it is kept only
	// when the delivery's HeaderSignature verifies, and `amqpidem dlq
	// replay --to-original-exchange` publishes to it only then (or with
	// --trust-headers).
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
	// HeaderBusy counts a duplicate's waits in a row while another
	// consumer held its key: each wait is at most twice the one before
	// (see Config.InProgressDelay). Only those requeues carry it.
	HeaderBusy = "x-amqpidem-busy"
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
	// HeaderHeadersDropped is set on a copy (a dead letter, or a requeued
	// copy whose dead letter is due) that would not have fitted in the
	// connection's frame_max with amqpidem's headers added: it says which
	// of the delivery's headers were dropped, the largest first, to make
	// it fit. The body and amqpidem's own headers are always kept. See
	// ErrTooLarge. A publisher can set it too: it is informational,
	// nothing in amqpidem decides anything from it.
	HeaderHeadersDropped = "x-amqpidem-headers-dropped"
	// HeaderTimestampMillis is the header holding when a message was
	// published, in Unix milliseconds: Publisher sets it, as RabbitMQ's
	// message_timestamp plugin does.
	HeaderTimestampMillis = "timestamp_in_ms"
)

const (
	// maxHeaderText bounds the error text written into a header.
	maxHeaderText = 4 << 10
	// maxShortText bounds the broker-given names kept from incoming
	// headers (exchange, routing key, user id): AMQP short strings.
	maxShortText = 255
)

// headers is what a delivery's headers say to amqpidem: its own headers
// and HeaderTimestampMillis, read by parseHeaders, and nowhere else. A
// publisher can set any of them, so every field is what is left of a
// value once the rules of the package documentation ("Headers a publisher
// can forge") have made it harmless: a forged value may bring a dead
// letter closer, never allow an execution the record would not, and the
// informational ones are copied only when well formed.
type headers struct {
	// attempt is HeaderAttempt, the executions so far by the message's
	// own count, in [0, maxAttempts]: 0 when missing, not an integer or
	// negative, and on a dead letter moved back to its queue (deadLetter),
	// whose count starts afresh (see attemptOf).
	attempt int
	// publishedMs is HeaderTimestampMillis when it is a positive integer;
	// zero otherwise (see publishedMsOf).
	publishedMs int64
	// pendingText is HeaderDeadLetterPending's text when it is a string,
	// cut to maxHeaderText; "" otherwise (see pending).
	pendingText string
	// expiresAt is HeaderExpiresAt, in ms since the epoch, when expires
	// is set (the header is an integer of any AMQP type; any value, a
	// negative one included, since it can only bring a dead letter
	// closer). expires is with the other flags, at the end.
	expiresAt int64
	// replyTries is HeaderReplyTries, in [0, maxAttempts].
	replyTries int
	// busy is HeaderBusy, in [0, maxBusyDoublings]: a forged value can
	// only make a duplicate look again sooner (as publishing it again
	// would) or wait at most InProgressDelay.
	busy int
	// exchange and routingKey are HeaderOriginalExchange and
	// HeaderOriginalRoutingKey when both are strings (or byte arrays) of
	// at most maxShortText bytes: origin says so. Otherwise a copy names
	// the delivery's own exchange and routing key.
	exchange, routingKey string

	// The flags, together (no padding after each).

	// parsed is set by parseHeaders: every field is read. Before, only
	// attempt and publishedMs are (arrivalHeaders).
	parsed bool
	// deadLetter is set when HeaderError is (to anything but void): the
	// message is a dead letter moved back to its queue.
	deadLetter bool
	// pending is set when HeaderDeadLetterPending is present, whatever
	// its value: the message's dead letter is due.
	pending bool
	expires bool // see expiresAt
	origin  bool // see exchange
	// badUserID is set when HeaderUserID is present but not a string of
	// at most maxShortText bytes: a copy drops it.
	badUserID bool
	// firstSeen and originalExpiration are set when HeaderFirstSeen and
	// HeaderOriginalExpiration are present: copies keep them as they are.
	firstSeen, originalExpiration bool
}

// parseHeaders reads t, a delivery's headers, for a consumer whose
// MaxAttempts is maxAttempts: see headers for the rules. It reads each of
// t's entries once and keeps nothing of t.
func parseHeaders(t amqp.Table, maxAttempts int) headers {
	h := headers{parsed: true}
	var attempt, replyTries int64
	var exchangeOK, routingKeyOK bool
	for k, v := range t {
		switch k {
		case HeaderTimestampMillis:
			h.publishedMs = publishedMsOf(v)
		case HeaderAttempt:
			attempt, _ = headerInt64(v)
		case HeaderError:
			h.deadLetter = movedBack(v)
		case HeaderDeadLetterPending:
			h.pending = true
			if s, ok := v.(string); ok {
				h.pendingText = headerText(s)
			}
		case HeaderExpiresAt:
			h.expiresAt, h.expires = headerInt64(v)
		case HeaderReplyTries:
			replyTries, _ = headerInt64(v)
		case HeaderBusy:
			n, _ := headerInt64(v)
			h.busy = int(min(max(n, 0), maxBusyDoublings))
		case HeaderOriginalExchange:
			h.exchange, exchangeOK = shortText(v, true)
		case HeaderOriginalRoutingKey:
			h.routingKey, routingKeyOK = shortText(v, true)
		case HeaderUserID:
			_, ok := shortText(v, false)
			h.badUserID = !ok
		case HeaderFirstSeen:
			h.firstSeen = true
		case HeaderOriginalExpiration:
			h.originalExpiration = true
		}
	}
	h.attempt = attemptOf(attempt, h.deadLetter, maxAttempts)
	h.replyTries = int(min(max(replyTries, 0), int64(maxAttempts)))
	h.origin = exchangeOK && routingKeyOK
	if !h.origin {
		h.exchange, h.routingKey = "", ""
	}
	return h
}

// arrivalHeaders reads of t only what every delivery's Event needs, its
// attempt and publishedMs, by parseHeaders' rules (attemptOf,
// publishedMsOf, movedBack): three lookups, where parseHeaders walks
// the whole table, which costs a duplicate of completed work (that needs
// nothing more) more than all the rest of its way through the layer. The
// flight reads the rest with parseHeaders when a step first needs it.
func arrivalHeaders(t amqp.Table, maxAttempts int) headers {
	if len(t) == 0 {
		return headers{parsed: true} // nothing more to read
	}
	n, _ := headerInt64(t[HeaderAttempt])
	return headers{
		attempt:     attemptOf(n, movedBack(t[HeaderError]), maxAttempts),
		publishedMs: publishedMsOf(t[HeaderTimestampMillis]),
	}
}

// attemptOf is the attempt count n, read from HeaderAttempt (0 when not
// an integer), comes to: clamped to [0, maxAttempts], and 0 on a dead
// letter moved back to its queue, whose count starts afresh. A publisher
// can forge the header, so it may only bring a dead letter closer (its
// executions count with the record's), never allow more executions than
// the record does.
func attemptOf(n int64, deadLetter bool, maxAttempts int) int {
	if deadLetter {
		return 0
	}
	return int(min(max(n, 0), int64(maxAttempts)))
}

// movedBack reports whether v, the value of HeaderError, marks a dead
// letter moved back to its queue: any value but void (nil).
func movedBack(v any) bool { return v != nil }

// publishedMsOf is v, the value of HeaderTimestampMillis, when it is a
// positive integer; zero otherwise.
func publishedMsOf(v any) int64 {
	if ms, ok := headerInt64(v); ok && ms > 0 {
		return ms
	}
	return 0
}

// expired reports whether the message's HeaderExpiresAt has passed at
// now. A publisher can set the header: it can only bring a dead letter
// closer. h must be parsed.
func (h *headers) expired(now time.Time) bool {
	return h.expires && now.UnixMilli() >= h.expiresAt
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

// headerText cuts s to fit a header.
func headerText(s string) string {
	if len(s) > maxHeaderText {
		return s[:maxHeaderText-3] + "..."
	}
	return s
}

// publishedAt is Event.Published for d, whose headers say h: its
// HeaderTimestampMillis, else its timestamp property.
func publishedAt(d *amqp.Delivery, h *headers) time.Time {
	if h.publishedMs > 0 {
		return time.UnixMilli(h.publishedMs)
	}
	return d.Timestamp
}
