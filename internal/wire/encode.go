package wire

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// AppendPublishing appends to b the stored form of a message to publish to
// exchange with routing key key. It refuses, with an error wrapping
// ErrBadPublishing that names the field, what amqp091-go or the broker
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
func AppendPublishing(b []byte, exchange, key string, msg amqp.Publishing) ([]byte, error) {
	start := len(b)
	b = append(b, publishingVersion)
	b, fe := appendShort(b, exchange)
	if fe != nil {
		return b[:start], fmt.Errorf("%w: exchange%s", ErrBadPublishing, fe.at())
	}
	if b, fe = appendShort(b, key); fe != nil {
		return b[:start], fmt.Errorf("%w: routing key%s", ErrBadPublishing, fe.at())
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
			return b[:start], fmt.Errorf("%w: %s%s", ErrBadPublishing, name, fe.at())
		}
	}
	return append(b, msg.Body...), nil
}

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
