package wire

import (
	"encoding/binary"
	"fmt"
	"math"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ReadPublishing reads one message AppendPublishing wrote from the front of
// b and returns it and the bytes after it. The message is what a consumer
// using amqp091-go would receive: header values of the types its reader
// returns (an int32 for an int, a []byte for a byte array, a nil []any for
// an empty array, an amqp.Table for a nested table), time.Time values and
// the Timestamp as time.Unix(seconds, 0), Headers nil when there were none,
// and Body never nil. Body and every value are copies: none shares memory
// with b.
//
// b may be any bytes. ReadPublishing checks every length against what is
// left before it allocates, so that it allocates in proportion to b's
// length, never what a forged length claims. It returns an error wrapping
// ErrBadStored, naming the field and the byte offset, for an
// unknown version, input that ends early, a length longer than what is
// left of b or of its table or array, an unknown field type or property
// flag, nesting deeper than maxHeaderDepth, more than maxHeaderElements
// entries, and anything AppendPublishing would not have written (table
// keys out of order or repeated, a present property with its zero value, a
// bool other than 0 or 1), so that what it reads re-encodes to the same
// bytes.
func ReadPublishing(b []byte) (exchange, key string, msg amqp.Publishing, rest []byte, err error) {
	d := &pubDecoder{b: b, end: len(b)}
	bad := func(what string, fe *fieldError) (string, string, amqp.Publishing, []byte, error) {
		return "", "", amqp.Publishing{}, nil, fmt.Errorf("%w: %s%s", ErrBadStored, what, fe.at())
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
