package amqpidem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

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

// errBadPublishing is what appendPublishing returns, wrapped with the field
// and the reason, for a message that amqp091-go or the broker would refuse.
var errBadPublishing = errors.New("amqpidem: message cannot be published")

// errBadStoredPublishing is what readPublishing returns, wrapped with the
// field, the byte offset and the reason, for bytes that are not a stored
// message: truncated, damaged, forged or written by another version.
var errBadStoredPublishing = errors.New("amqpidem: stored message is unreadable")

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

// appendPublishing appends to b the stored form of a message to publish to
// exchange with routing key key. It refuses, with an error wrapping
// errBadPublishing that names the field, what amqp091-go or the broker
// would refuse: a short string (the exchange, the routing key, a string
// property, a header name) longer than 255 bytes; a header value of a type
// amqp.Table does not accept (see amqp.Table.Validate); tables and arrays
// nested deeper than maxHeaderDepth or holding more than maxHeaderElements
// entries; a string, byte array, table or array longer than maxLongLen
// bytes. On error it returns b as it was.
//
// Values are stored as amqp091-go sends them: an int header as a 32-bit
// integer (its high bits dropped, as amqp091-go does), a time.Time and the
// Timestamp as whole seconds, empty Headers and properties that are their
// zero value not at all.
func appendPublishing(b []byte, exchange, key string, msg amqp.Publishing) ([]byte, error) {
	start := len(b)
	b = append(b, publishingVersion)
	b, fe := appendShort(b, exchange)
	if fe != nil {
		return b[:start], fmt.Errorf("%w: exchange%s", errBadPublishing, fe.at())
	}
	if b, fe = appendShort(b, key); fe != nil {
		return b[:start], fmt.Errorf("%w: routing key%s", errBadPublishing, fe.at())
	}
	b = binary.BigEndian.AppendUint64(b, uint64(len(msg.Body)))
	flags := pubFlags(&msg)
	b = binary.BigEndian.AppendUint16(b, flags)
	for flag := uint16(pubFlagContentType); flag >= pubFlagAppID; flag >>= 1 {
		if flags&flag == 0 {
			continue
		}
		name, s := pubProperty(&msg, flag)
		switch flag {
		case pubFlagHeaders:
			b, fe = appendTable(b, msg.Headers, 0)
		case pubFlagDeliveryMode:
			b = append(b, msg.DeliveryMode)
		case pubFlagPriority:
			b = append(b, msg.Priority)
		case pubFlagTimestamp:
			b = binary.BigEndian.AppendUint64(b, uint64(msg.Timestamp.Unix()))
		default:
			b, fe = appendShort(b, *s)
		}
		if fe != nil {
			return b[:start], fmt.Errorf("%w: %s%s", errBadPublishing, name, fe.at())
		}
	}
	return append(b, msg.Body...), nil
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

// appendShort appends s as a short string, or refuses it when it is longer
// than 255 bytes.
func appendShort(b []byte, s string) ([]byte, *fieldError) {
	if len(s) > math.MaxUint8 {
		return b, &fieldError{reason: fmt.Sprintf("%d bytes, more than the 255 of a short string", len(s))}
	}
	b = append(b, byte(len(s)))
	return append(b, s...), nil
}

// appendTable appends t as a field table: its length in bytes, then each
// entry, keys in byte order. depth is how many tables and arrays enclose t
// within Headers (0 for Headers itself).
func appendTable(b []byte, t amqp.Table, depth int) ([]byte, *fieldError) {
	if len(t) > maxHeaderElements {
		return b, &fieldError{reason: fmt.Sprintf("table of %d entries, more than %d", len(t), maxHeaderElements)}
	}
	keys := make([]string, 0, len(t))
	for k := range t {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	at := len(b)
	b = append(b, 0, 0, 0, 0) // the length, set below
	var fe *fieldError
	for _, k := range keys {
		if b, fe = appendShort(b, k); fe != nil {
			fe.reason = "name of " + fe.reason
			return b, inField(keyStep(k), fe)
		}
		if b, fe = appendField(b, t[k], depth); fe != nil {
			return b, inField(keyStep(k), fe)
		}
	}
	return setLongLen(b, at, "table")
}

// appendArray appends a as a field array: its length in bytes, then each
// element. depth is how many tables and arrays enclose a within Headers.
func appendArray(b []byte, a []any, depth int) ([]byte, *fieldError) {
	if len(a) > maxHeaderElements {
		return b, &fieldError{reason: fmt.Sprintf("array of %d elements, more than %d", len(a), maxHeaderElements)}
	}
	at := len(b)
	b = append(b, 0, 0, 0, 0) // the length, set below
	var fe *fieldError
	for i, v := range a {
		if b, fe = appendField(b, v, depth); fe != nil {
			return b, inField(indexStep(i), fe)
		}
	}
	return setLongLen(b, at, "array")
}

// setLongLen writes at b[at:at+4] the length of what follows them, or
// refuses a what longer than maxLongLen.
func setLongLen(b []byte, at int, what string) ([]byte, *fieldError) {
	n := len(b) - at - 4
	if fe := checkLongLen(n, what); fe != nil {
		return b, fe
	}
	binary.BigEndian.PutUint32(b[at:], uint32(n))
	return b, nil
}

// checkLongLen refuses a what of n bytes when n is more than maxLongLen.
func checkLongLen(n int, what string) *fieldError {
	if uint64(n) > maxLongLen {
		return &fieldError{reason: fmt.Sprintf("%s of %d bytes, more than %d", what, n, maxLongLen)}
	}
	return nil
}

// appendField appends v as a field value, its type tag first, as
// amqp091-go writes it. depth is how many tables and arrays enclose v
// within Headers.
func appendField(b []byte, v any, depth int) ([]byte, *fieldError) {
	switch v := v.(type) {
	case nil:
		return append(b, 'V'), nil
	case bool:
		if v {
			return append(b, 't', 1), nil
		}
		return append(b, 't', 0), nil
	case uint8:
		return append(b, 'B', v), nil
	case int8:
		return append(b, 'b', byte(v)), nil
	case int16:
		return binary.BigEndian.AppendUint16(append(b, 's'), uint16(v)), nil
	case uint16:
		return binary.BigEndian.AppendUint16(append(b, 'u'), v), nil
	case int:
		// amqp091-go sends an int as 32 bits, dropping the high ones.
		return binary.BigEndian.AppendUint32(append(b, 'I'), uint32(v)), nil
	case int32:
		return binary.BigEndian.AppendUint32(append(b, 'I'), uint32(v)), nil
	case uint32:
		return binary.BigEndian.AppendUint32(append(b, 'i'), v), nil
	case int64:
		return binary.BigEndian.AppendUint64(append(b, 'l'), uint64(v)), nil
	case float32:
		return binary.BigEndian.AppendUint32(append(b, 'f'), math.Float32bits(v)), nil
	case float64:
		return binary.BigEndian.AppendUint64(append(b, 'd'), math.Float64bits(v)), nil
	case amqp.Decimal:
		return binary.BigEndian.AppendUint32(append(b, 'D', v.Scale), uint32(v.Value)), nil
	case time.Time:
		return binary.BigEndian.AppendUint64(append(b, 'T'), uint64(v.Unix())), nil
	case string:
		if fe := checkLongLen(len(v), "string"); fe != nil {
			return b, fe
		}
		b = binary.BigEndian.AppendUint32(append(b, 'S'), uint32(len(v)))
		return append(b, v...), nil
	case []byte:
		if fe := checkLongLen(len(v), "byte array"); fe != nil {
			return b, fe
		}
		b = binary.BigEndian.AppendUint32(append(b, 'x'), uint32(len(v)))
		return append(b, v...), nil
	case []any:
		if depth >= maxHeaderDepth {
			return b, &fieldError{reason: fmt.Sprintf("array nested deeper than %d", maxHeaderDepth)}
		}
		return appendArray(append(b, 'A'), v, depth+1)
	case amqp.Table:
		if depth >= maxHeaderDepth {
			return b, &fieldError{reason: fmt.Sprintf("table nested deeper than %d", maxHeaderDepth)}
		}
		return appendTable(append(b, 'F'), v, depth+1)
	}
	return b, &fieldError{reason: fmt.Sprintf("value of type %T, which an AMQP table cannot carry", v)}
}

// readPublishing reads one message appendPublishing wrote from the front of
// b and returns it and the bytes after it. The message is what a consumer
// using amqp091-go would receive: header values of the types its reader
// returns (an int32 for an int, a []byte for a byte array, a nil []any for
// an empty array, an amqp.Table for a nested table), time.Time values and
// the Timestamp as time.Unix(seconds, 0), Headers nil when there were none,
// and Body never nil. Body and every value are copies: none shares memory
// with b.
//
// b may be any bytes. readPublishing checks every length against what is
// left before it allocates, so that it allocates in proportion to b's
// length, never what a forged length claims. It returns an error wrapping
// errBadStoredPublishing, naming the field and the byte offset, for an
// unknown version, input that ends early, a length longer than what is
// left of b or of its table or array, an unknown field type or property
// flag, nesting deeper than maxHeaderDepth, more than maxHeaderElements
// entries, and anything appendPublishing would not have written (table
// keys out of order or repeated, a present property with its zero value, a
// bool other than 0 or 1), so that what it reads re-encodes to the same
// bytes.
func readPublishing(b []byte) (exchange, key string, msg amqp.Publishing, rest []byte, err error) {
	d := &pubDecoder{b: b, end: len(b)}
	bad := func(what string, fe *fieldError) (string, string, amqp.Publishing, []byte, error) {
		return "", "", amqp.Publishing{}, nil, fmt.Errorf("%w: %s%s", errBadStoredPublishing, what, fe.at())
	}
	version, fe := d.byte()
	if fe == nil && version != publishingVersion {
		fe = d.fail(0, fmt.Sprintf("unknown version %d, want %d", version, publishingVersion))
	}
	if fe != nil {
		return bad("version", fe)
	}
	if exchange, fe = d.short(); fe != nil {
		return bad("exchange", fe)
	}
	if key, fe = d.short(); fe != nil {
		return bad("routing key", fe)
	}
	size, fe := d.uint64()
	if fe != nil {
		return bad("body size", fe)
	}
	flags, fe := d.uint16()
	if fe == nil && flags&^pubFlagsKnown != 0 {
		fe = d.fail(d.off-2, fmt.Sprintf("unknown flags %#04x", flags&^pubFlagsKnown))
	}
	if fe != nil {
		return bad("property flags", fe)
	}
	for flag := uint16(pubFlagContentType); flag >= pubFlagAppID; flag >>= 1 {
		if flags&flag == 0 {
			continue
		}
		name, s := pubProperty(&msg, flag)
		at := d.off
		var zero bool
		switch flag {
		case pubFlagHeaders:
			msg.Headers, fe = d.table(0)
			zero = len(msg.Headers) == 0
		case pubFlagDeliveryMode:
			msg.DeliveryMode, fe = d.byte()
			zero = msg.DeliveryMode == 0
		case pubFlagPriority:
			msg.Priority, fe = d.byte()
			zero = msg.Priority == 0
		case pubFlagTimestamp:
			var sec uint64
			sec, fe = d.uint64()
			msg.Timestamp = time.Unix(int64(sec), 0)
			zero = msg.Timestamp.IsZero()
		default:
			*s, fe = d.short()
			zero = *s == ""
		}
		if fe == nil && zero {
			fe = d.fail(at, "present with its zero value, which is never sent")
		}
		if fe != nil {
			return bad(name, fe)
		}
	}
	if left := d.end - d.off; uint64(left) < size {
		return bad("body", d.fail(d.off, fmt.Sprintf("%d bytes by the body size, %d left", size, left)))
	}
	msg.Body = make([]byte, size)
	d.off += copy(msg.Body, b[d.off:])
	return exchange, key, msg, b[d.off:], nil
}

// pubDecoder reads the stored form of a message from b, from off on and
// before end: the end of b, or of the table or array being read.
type pubDecoder struct {
	b      []byte
	off    int
	end    int
	nested int // how many tables and arrays are being read
}

// fail returns the error for the bytes at offset at.
func (d *pubDecoder) fail(at int, why string) *fieldError {
	return &fieldError{reason: fmt.Sprintf("at byte %d: %s", at, why)}
}

// take returns the next n bytes, or an error when fewer are left before
// end.
func (d *pubDecoder) take(n int) ([]byte, *fieldError) {
	if left := d.end - d.off; n > left {
		return nil, d.fail(d.off, fmt.Sprintf("needs %d bytes, %d left in %s", n, left, d.within()))
	}
	p := d.b[d.off : d.off+n]
	d.off += n
	return p, nil
}

// takeLen returns the next n bytes, whose length was read at offset at, or
// an error there when fewer are left before end.
func (d *pubDecoder) takeLen(n, at int) ([]byte, *fieldError) {
	if left := d.end - d.off; n > left {
		return nil, d.fail(at, fmt.Sprintf("length %d, more than the %d bytes left in %s", n, left, d.within()))
	}
	return d.take(n)
}

// within names what end is the end of.
func (d *pubDecoder) within() string {
	if d.nested > 0 {
		return "its table or array"
	}
	return "the input"
}

// byte reads one byte.
func (d *pubDecoder) byte() (byte, *fieldError) {
	p, fe := d.take(1)
	if fe != nil {
		return 0, fe
	}
	return p[0], nil
}

// uint16 reads a 16-bit number.
func (d *pubDecoder) uint16() (uint16, *fieldError) {
	p, fe := d.take(2)
	if fe != nil {
		return 0, fe
	}
	return binary.BigEndian.Uint16(p), nil
}

// uint32 reads a 32-bit number.
func (d *pubDecoder) uint32() (uint32, *fieldError) {
	p, fe := d.take(4)
	if fe != nil {
		return 0, fe
	}
	return binary.BigEndian.Uint32(p), nil
}

// uint64 reads a 64-bit number.
func (d *pubDecoder) uint64() (uint64, *fieldError) {
	p, fe := d.take(8)
	if fe != nil {
		return 0, fe
	}
	return binary.BigEndian.Uint64(p), nil
}

// short reads a short string.
func (d *pubDecoder) short() (string, *fieldError) {
	at := d.off
	n, fe := d.byte()
	if fe != nil {
		return "", fe
	}
	p, fe := d.takeLen(int(n), at)
	return string(p), fe
}

// long reads a 32-bit length, refused above maxLongLen, and the bytes of
// that length.
func (d *pubDecoder) long() ([]byte, *fieldError) {
	at := d.off
	n, fe := d.uint32()
	if fe != nil {
		return nil, fe
	}
	if n > maxLongLen {
		return nil, d.fail(at, fmt.Sprintf("length %d, more than %d", n, maxLongLen))
	}
	return d.takeLen(int(n), at)
}

// enter reads the 32-bit length of a table or an array and limits reading
// to its contents; leave, with what enter returned, lifts the limit.
func (d *pubDecoder) enter() (outerEnd int, fe *fieldError) {
	p, fe := d.long()
	if fe != nil {
		return 0, fe
	}
	outerEnd = d.end
	d.off -= len(p)
	d.end = d.off + len(p)
	d.nested++
	return outerEnd, nil
}

// leave ends the reading of a table or an array that enter began.
func (d *pubDecoder) leave(outerEnd int) {
	d.end = outerEnd
	d.nested--
}

// table reads a field table. depth is how many tables and arrays enclose it
// within Headers (0 for Headers itself).
func (d *pubDecoder) table(depth int) (amqp.Table, *fieldError) {
	outerEnd, fe := d.enter()
	if fe != nil {
		return nil, fe
	}
	t := make(amqp.Table)
	var prev string
	for d.off < d.end {
		at := d.off
		k, fe := d.short()
		if fe != nil {
			fe.reason = "name " + fe.reason
			return nil, fe
		}
		if len(t) > 0 && k <= prev {
			return nil, inField(keyStep(k), d.fail(at, fmt.Sprintf("name after %q: names must be in increasing byte order, each once", prev)))
		}
		if len(t) == maxHeaderElements {
			return nil, d.fail(at, fmt.Sprintf("table of more than %d entries", maxHeaderElements))
		}
		v, fe := d.field(depth)
		if fe != nil {
			return nil, inField(keyStep(k), fe)
		}
		t[k] = v
		prev = k
	}
	d.leave(outerEnd)
	return t, nil
}

// array reads a field array. depth is how many tables and arrays enclose it
// within Headers.
func (d *pubDecoder) array(depth int) ([]any, *fieldError) {
	outerEnd, fe := d.enter()
	if fe != nil {
		return nil, fe
	}
	var a []any // nil when empty, as amqp091-go reads it
	for d.off < d.end {
		if len(a) == maxHeaderElements {
			return nil, d.fail(d.off, fmt.Sprintf("array of more than %d elements", maxHeaderElements))
		}
		v, fe := d.field(depth)
		if fe != nil {
			return nil, inField(indexStep(len(a)), fe)
		}
		a = append(a, v)
	}
	d.leave(outerEnd)
	return a, nil
}

// field reads a field value, its type tag first, as amqp091-go reads it.
// depth is how many tables and arrays enclose it within Headers.
func (d *pubDecoder) field(depth int) (any, *fieldError) {
	at := d.off
	tag, fe := d.byte()
	if fe != nil {
		fe.reason = "type " + fe.reason
		return nil, fe
	}
	var v any
	switch tag {
	case 'V':
		return nil, nil
	case 't':
		var n byte
		if n, fe = d.byte(); fe == nil && n > 1 {
			fe = d.fail(at+1, fmt.Sprintf("bool %d, neither 0 nor 1", n))
		}
		v = n == 1
	case 'B':
		v, fe = d.byte()
	case 'b':
		var n byte
		n, fe = d.byte()
		v = int8(n)
	case 's':
		var n uint16
		n, fe = d.uint16()
		v = int16(n)
	case 'u':
		v, fe = d.uint16()
	case 'I':
		var n uint32
		n, fe = d.uint32()
		v = int32(n)
	case 'i':
		v, fe = d.uint32()
	case 'l':
		var n uint64
		n, fe = d.uint64()
		v = int64(n)
	case 'f':
		var n uint32
		n, fe = d.uint32()
		v = math.Float32frombits(n)
	case 'd':
		var n uint64
		n, fe = d.uint64()
		v = math.Float64frombits(n)
	case 'D':
		var p []byte
		if p, fe = d.take(5); fe == nil {
			v = amqp.Decimal{Scale: p[0], Value: int32(binary.BigEndian.Uint32(p[1:]))}
		}
	case 'T':
		var n uint64
		n, fe = d.uint64()
		v = time.Unix(int64(n), 0)
	case 'S':
		var p []byte
		p, fe = d.long()
		v = string(p)
	case 'x':
		var p []byte
		p, fe = d.long()
		v = append([]byte{}, p...)
	case 'A':
		if depth >= maxHeaderDepth {
			return nil, d.fail(at, fmt.Sprintf("array nested deeper than %d", maxHeaderDepth))
		}
		return d.array(depth + 1)
	case 'F':
		if depth >= maxHeaderDepth {
			return nil, d.fail(at, fmt.Sprintf("table nested deeper than %d", maxHeaderDepth))
		}
		return d.table(depth + 1)
	default:
		return nil, d.fail(at, fmt.Sprintf("unknown field type %q", tag))
	}
	if fe != nil {
		return nil, fe
	}
	return v, nil
}

// MarshalPublishing returns the stored form of msg, to be published to
// exchange with routing key key: the one amqpidem's outboxes keep (the
// staged messages of a record, pgstore's producer outbox), versioned and
// close to AMQP's own encoding, so that every publish of it sends the same
// message. It refuses, with the field and the reason, what amqp091-go or
// the broker would refuse (see amqp.Table.Validate).
func MarshalPublishing(exchange, key string, msg amqp.Publishing) ([]byte, error) {
	return appendPublishing(nil, exchange, key, msg)
}

// UnmarshalPublishing reads what MarshalPublishing wrote. It refuses, with
// the field, the byte offset and the reason, bytes that are not exactly
// one stored message: truncated, damaged, followed by more bytes, or
// written by another version.
func UnmarshalPublishing(b []byte) (exchange, key string, msg amqp.Publishing, err error) {
	exchange, key, msg, rest, err := readPublishing(b)
	if err != nil {
		return "", "", amqp.Publishing{}, err
	}
	if len(rest) > 0 {
		return "", "", amqp.Publishing{}, fmt.Errorf("%w: %d bytes after the message", errBadStoredPublishing, len(rest))
	}
	return exchange, key, msg, nil
}
