package amqpidem

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrTooLarge means a message's properties, its headers mostly, would not
// fit in one frame of the connection's negotiated frame_max: the broker
// would close the channel over it (501 FRAME_ERROR), so it is not sent.
// The body does not count (it is split into frames). IsRefused reports
// true for it: publishing it again meets the same answer.
var ErrTooLarge = errors.New("amqpidem: message headers exceed the connection's frame_max")

// defaultFrameMax is RabbitMQ's default frame_max, and amqp091-go's, taken
// when the connection's negotiated one cannot be known (a ChannelOpener
// of the user's that is not an *amqp.Connection).
const defaultFrameMax = 131072

// frameOverhead is what a frame adds to its payload: type, channel and
// size before it, the end octet after.
const frameOverhead = 8

// frameSizer is a broker that knows the frame_max its connection
// negotiated: *publisher. A broker that does not (a test's) checks no
// size.
type frameSizer interface {
	// frameMax is the negotiated frame_max; 0 for no limit.
	frameMax() int
}

// frameMaxOf is b's negotiated frame_max, 0 (no limit) when b cannot say.
func frameMaxOf(b broker) int {
	if fs, ok := b.(frameSizer); ok {
		return fs.frameMax()
	}
	return 0
}

// frameMax is the frame_max of p's connection: what an *amqp.Connection
// (or a Consumer's own connection) negotiated in connection.tune, which
// amqp091-go keeps in Connection.Config.FrameSize (0: no limit), or
// defaultFrameMax for an opener that cannot say.
func (p *publisher) frameMax() int {
	switch c := p.conn.(type) {
	case *amqp.Connection:
		return c.Config.FrameSize
	case *pubConn:
		return c.frameMax()
	}
	return defaultFrameMax
}

// frameMax is the frame_max of p's current connection, or defaultFrameMax
// before one is dialled (it is the same on every connection to a broker
// that keeps its configuration).
func (p *pubConn) frameMax() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conn == nil {
		return defaultFrameMax
	}
	return p.conn.Config.FrameSize
}

// fits reports whether msg's content header frame fits in frameMax (0:
// no limit).
func fits(msg *amqp.Publishing, frameMax int) bool {
	return frameMax <= 0 || headerFrameSize(msg) <= frameMax
}

// tooLarge is the ErrTooLarge error of msg, published to exchange/key
// on a connection whose frame_max is frameMax.
func tooLarge(exchange, key string, msg *amqp.Publishing, frameMax int) error {
	return fmt.Errorf("%w: exchange %q routing key %q: a header frame of %d bytes, frame_max %d",
		ErrTooLarge, exchange, key, headerFrameSize(msg), frameMax)
}

// HeaderFrameSize is the size in bytes of the frame that carries msg's
// properties and headers (its content header, framing included), as
// amqp091-go writes it: what the connection's frame_max
// (amqp.Connection.Config.FrameSize) bounds. The broker closes the
// connection over a publish whose content header exceeds it; Publisher
// and Consumer check it themselves (ErrTooLarge). The body does not count:
// it is split into frames.
func HeaderFrameSize(msg *amqp.Publishing) int { return headerFrameSize(msg) }

// headerFrameSize is the size of the content header frame amqp091-go
// writes for msg, framing included: what frame_max bounds.
func headerFrameSize(msg *amqp.Publishing) int {
	n := frameOverhead + 2 + 2 + 8 + 2 // class, weight, body size, flags
	for _, s := range []string{msg.ContentType, msg.ContentEncoding, msg.CorrelationId, msg.ReplyTo,
		msg.Expiration, msg.MessageId, msg.Type, msg.UserId, msg.AppId} {
		if s != "" {
			n += 1 + len(s)
		}
	}
	if len(msg.Headers) > 0 {
		n += tableSize(msg.Headers)
	}
	if msg.DeliveryMode > 0 {
		n++
	}
	if msg.Priority > 0 {
		n++
	}
	if !msg.Timestamp.IsZero() {
		n += 8
	}
	return n
}

// tableSize is the encoded size of t: its length, then each key (a short
// string) and value.
func tableSize(t amqp.Table) int {
	n := 4
	for k, v := range t {
		n += tableEntrySize(k, v)
	}
	return n
}

// tableEntrySize is the encoded size of one table entry.
func tableEntrySize(k string, v any) int { return 1 + len(k) + fieldSize(v) }

// fieldSize is the encoded size of a field value, its type octet
// included, as amqp091-go writes it. A type it cannot write counts as
// nothing: the publish fails before it is sent.
func fieldSize(v any) int {
	switch v := v.(type) {
	case nil:
		return 1
	case bool, byte, int8:
		return 2
	case int16, uint16:
		return 3
	case int, int32, uint32, float32:
		return 5
	case int64, float64, time.Time:
		return 9
	case amqp.Decimal:
		return 6
	case string:
		return 5 + len(v)
	case []byte:
		return 5 + len(v)
	case []any:
		n := 5
		for _, e := range v {
			n += fieldSize(e)
		}
		return n
	case amqp.Table:
		return 1 + tableSize(v)
	}
	return 0
}

// fitHeaders makes msg, a copy amqpidem publishes, fit in frameMax (0:
// no limit) by dropping its headers, the largest first, but never those
// named in keep (amqpidem's own, set on this copy). When it drops any it
// sets HeaderHeadersDropped on msg, saying which, and returns that text;
// "" when msg fitted as it was. If msg still does not fit (a frame_max
// too small even for amqpidem's headers), the publish fails with
// ErrTooLarge.
func fitHeaders(msg *amqp.Publishing, keep amqp.Table, frameMax int) string {
	if fits(msg, frameMax) {
		return ""
	}
	before := headerFrameSize(msg)
	var names []string
	for k := range msg.Headers {
		if _, kept := keep[k]; !kept {
			names = append(names, k)
		}
	}
	sort.Slice(names, func(i, j int) bool {
		si, sj := tableEntrySize(names[i], msg.Headers[names[i]]), tableEntrySize(names[j], msg.Headers[names[j]])
		return si > sj || si == sj && names[i] < names[j]
	})
	t := make(amqp.Table, len(msg.Headers)+1)
	for k, v := range msg.Headers {
		t[k] = v
	}
	msg.Headers = t
	var dropped []string
	note := func() string {
		return headerText(fmt.Sprintf("%d header(s) dropped, the largest first, to fit frame_max %d (a header frame of %d bytes): %s",
			len(dropped), frameMax, before, strings.Join(dropped, ", ")))
	}
	for _, k := range names {
		delete(t, k)
		dropped = append(dropped, k)
		if t[HeaderHeadersDropped] = note(); fits(msg, frameMax) {
			break
		}
	}
	t[HeaderHeadersDropped] = note()
	return t[HeaderHeadersDropped].(string)
}
