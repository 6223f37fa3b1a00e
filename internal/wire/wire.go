package wire

import (
	"errors"
	"fmt"
	"math"
	"strconv"

	amqp "github.com/rabbitmq/amqp091-go"
)

// publishingVersion is the first byte of the stored form of a message the
// outbox is to publish. A change of the layout takes a new number, so that
// a record written by one version of amqpidem is never misread by another.
//
// Version 1 is what basic.publish and the content header carry on the
// wire, in their encoding, every number big-endian:
//
//	version      1 byte, publishingVersion
//	exchange     short string: 1 byte length, then the bytes
//	routing key  short string
//	body size    8 bytes, as in the content header
//	flags        2 bytes, the content header's property flags
//	properties   those whose flag is set, in flag order, as in the content header
//	body         body size bytes
//
// Headers are an AMQP field table whose keys are in byte order, and a
// property is present exactly when amqp091-go would send it, so that a
// message has one stored form.
const publishingVersion = 1

// maxHeaderDepth bounds how deeply tables and arrays may nest inside
// Headers: a table or array directly in Headers is at depth 1. It keeps
// encoding and decoding (which recurse once per level) from exhausting the
// stack on a forged record; amqp091-go itself reads up to 32 levels.
const maxHeaderDepth = 16

// maxHeaderElements bounds the entries of a table (Headers included) and
// the elements of an array: amqp091-go's reader refuses a delivery with
// more (and drops the connection), so a consumer could never receive it.
const maxHeaderElements = 8192

// maxLongLen bounds the length of a long string, byte array, table or array
// in bytes: AMQP sends it in 32 bits and amqp091-go's reader refuses
// lengths above the largest int32.
const maxLongLen = math.MaxInt32

// ErrBadPublishing is what AppendPublishing returns, wrapped with the field
// and the reason, for a message that amqp091-go or the broker would refuse.
var ErrBadPublishing = errors.New("amqpidem: message cannot be published")

// ErrBadStored is what ReadPublishing returns, wrapped with the
// field, the byte offset and the reason, for bytes that are not a stored
// message: truncated, damaged, forged or written by another version.
var ErrBadStored = errors.New("amqpidem: stored message is unreadable")

// The content header's property flags of the basic class, the first
// property in the highest bit. Bit 2 is cluster-id (reserved in 0-9-1),
// which amqp.Publishing cannot set; bits 1 and 0 are unused.
const (
	pubFlagContentType     = 0x8000
	pubFlagContentEncoding = 0x4000
	pubFlagHeaders         = 0x2000
	pubFlagDeliveryMode    = 0x1000
	pubFlagPriority        = 0x0800
	pubFlagCorrelationID   = 0x0400
	pubFlagReplyTo         = 0x0200
	pubFlagExpiration      = 0x0100
	pubFlagMessageID       = 0x0080
	pubFlagTimestamp       = 0x0040
	pubFlagType            = 0x0020
	pubFlagUserID          = 0x0010
	pubFlagAppID           = 0x0008

	// pubFlagsKnown is every flag an amqp.Publishing can set.
	pubFlagsKnown = 0xfff8
)

// pubProperty returns the Go name of the property of flag and, for a short
// string property, a pointer to it in msg (nil for the other four).
func pubProperty(msg *amqp.Publishing, flag uint16) (name string, s *string) {
	switch flag {
	case pubFlagContentType:
		return "ContentType", &msg.ContentType
	case pubFlagContentEncoding:
		return "ContentEncoding", &msg.ContentEncoding
	case pubFlagHeaders:
		return "Headers", nil
	case pubFlagDeliveryMode:
		return "DeliveryMode", nil
	case pubFlagPriority:
		return "Priority", nil
	case pubFlagCorrelationID:
		return "CorrelationId", &msg.CorrelationId
	case pubFlagReplyTo:
		return "ReplyTo", &msg.ReplyTo
	case pubFlagExpiration:
		return "Expiration", &msg.Expiration
	case pubFlagMessageID:
		return "MessageId", &msg.MessageId
	case pubFlagTimestamp:
		return "Timestamp", nil
	case pubFlagType:
		return "Type", &msg.Type
	case pubFlagUserID:
		return "UserId", &msg.UserId
	case pubFlagAppID:
		return "AppId", &msg.AppId
	}
	return "flag " + strconv.Itoa(int(flag)), nil
}

// pubFlags returns the flags of the properties of msg that are sent: as
// amqp091-go does, those that are not their zero value, and Headers when
// they have an entry.
func pubFlags(msg *amqp.Publishing) uint16 {
	var flags uint16
	for flag := uint16(pubFlagContentType); flag >= pubFlagAppID; flag >>= 1 {
		_, s := pubProperty(msg, flag)
		switch {
		case s != nil && *s != "",
			flag == pubFlagHeaders && len(msg.Headers) > 0,
			flag == pubFlagDeliveryMode && msg.DeliveryMode != 0,
			flag == pubFlagPriority && msg.Priority != 0,
			flag == pubFlagTimestamp && !msg.Timestamp.IsZero():
			flags |= flag
		}
	}
	return flags
}

// fieldError is a refused or unreadable value. Inside Headers, the path to
// the value is built up, innermost step last, as the calls that reached it
// return.
type fieldError struct {
	path   string // such as `["a"][2]`; empty outside tables and arrays
	reason string
}

// at returns the path and the reason, to follow the name of a field.
func (e *fieldError) at() string {
	return e.path + ": " + e.reason
}

// inField returns fe with step put in front of its path.
func inField(step string, fe *fieldError) *fieldError {
	fe.path = step + fe.path
	return fe
}

// keyStep returns the path step of the table entry named k.
func keyStep(k string) string { return "[" + strconv.Quote(k) + "]" }

// indexStep returns the path step of the array element i.
func indexStep(i int) string { return "[" + strconv.Itoa(i) + "]" }

// Marshal returns the stored form of msg, to be published to
// exchange with routing key key: the one amqpidem's outboxes keep (the
// staged messages of a record, pgstore's producer outbox), versioned and
// close to AMQP's own encoding, so that every publish of it sends the same
// message. It refuses, with the field and the reason, what amqp091-go or
// the broker would refuse (see amqp.Table.Validate).
func Marshal(exchange, key string, msg amqp.Publishing) ([]byte, error) {
	return AppendPublishing(nil, exchange, key, msg)
}

// Unmarshal reads what Marshal wrote. It refuses, with
// the field, the byte offset and the reason, bytes that are not exactly
// one stored message: truncated, damaged, followed by more bytes, or
// written by another version.
func Unmarshal(b []byte) (exchange, key string, msg amqp.Publishing, err error) {
	exchange, key, msg, rest, err := ReadPublishing(b)
	if err != nil {
		return "", "", amqp.Publishing{}, err
	}
	if len(rest) > 0 {
		return "", "", amqp.Publishing{}, fmt.Errorf("%w: %d bytes after the message", ErrBadStored, len(rest))
	}
	return exchange, key, msg, nil
}
