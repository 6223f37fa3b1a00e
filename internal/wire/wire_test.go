package wire

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/wire/wiretest"
)

// pubNestedTable returns Headers whose "h" is v inside n arrays: the
// innermost array is at depth n.
func pubNestedTable(v any, n int) amqp.Table {
	return amqp.Table{"h": wiretest.Nested(v, n, false)}
}

// pubEveryRead is what a consumer receives for wiretest.Every.
var pubEveryRead = amqp.Publishing{
	ContentType: "application/json", ContentEncoding: "gzip", DeliveryMode: amqp.Persistent, Priority: 7,
	CorrelationId: "corr", ReplyTo: "replies", Expiration: "60000", MessageId: "m-1", Timestamp: time.Unix(wiretest.Time.Unix(), 0),
	Type: "order.paid", UserId: "guest", AppId: "billing",
	Headers: amqp.Table{
		"bool":    true,
		"false":   false,
		"uint8":   uint8(200),
		"int8":    int8(-5),
		"int16":   int16(-300),
		"uint16":  uint16(60000),
		"int":     int32(-70000),
		"int32":   int32(math.MinInt32),
		"uint32":  uint32(math.MaxUint32),
		"int64":   int64(math.MinInt64),
		"float32": float32(1.5),
		"float64": -2.25,
		"decimal": amqp.Decimal{Scale: 2, Value: -12345},
		"time":    time.Unix(wiretest.Time.Unix(), 0),
		"string":  "héllo",
		"bytes":   []byte{0, 1, 2},
		"void":    nil,
		"array":   []any{"a", int32(1), int64(2), []any(nil), amqp.Table{"k": "v"}},
		"table":   amqp.Table{"inner": amqp.Table{"x": []byte("y")}, "empty": amqp.Table{}},
	},
	Body: []byte(`{"id":1}`),
}

// TestPublishingRoundTrip is the table of what ReadPublishing gives back
// for what AppendPublishing stored: the same message as a consumer using
// amqp091-go receives it, for every property and every header type. It
// also checks that the stored form re-encodes to the same bytes and that
// ReadPublishing consumes exactly it.
func TestPublishingRoundTrip(t *testing.T) {
	long := strings.Repeat("s", 255)
	tests := []struct {
		name     string
		exchange string
		key      string
		msg      amqp.Publishing
		want     amqp.Publishing // Body []byte{} unless set
	}{
		{name: "zero message: no properties, nil Headers, empty non-nil Body", msg: amqp.Publishing{}, want: amqp.Publishing{}},
		{name: "exchange and key", exchange: "orders", key: "order.paid", msg: amqp.Publishing{}, want: amqp.Publishing{}},
		{name: "exchange and key of 255 bytes", exchange: long, key: long, msg: amqp.Publishing{}, want: amqp.Publishing{}},
		{name: "every property and header type", exchange: "ex", key: "rk", msg: wiretest.Every, want: pubEveryRead},

		{name: "ContentType", msg: amqp.Publishing{ContentType: "text/plain"}, want: amqp.Publishing{ContentType: "text/plain"}},
		{name: "ContentEncoding", msg: amqp.Publishing{ContentEncoding: "gzip"}, want: amqp.Publishing{ContentEncoding: "gzip"}},
		{name: "DeliveryMode 2", msg: amqp.Publishing{DeliveryMode: 2}, want: amqp.Publishing{DeliveryMode: 2}},
		{name: "DeliveryMode 255", msg: amqp.Publishing{DeliveryMode: 255}, want: amqp.Publishing{DeliveryMode: 255}},
		{name: "Priority 1", msg: amqp.Publishing{Priority: 1}, want: amqp.Publishing{Priority: 1}},
		{name: "Priority 200, above 9: amqp091-go sends it", msg: amqp.Publishing{Priority: 200}, want: amqp.Publishing{Priority: 200}},
		{name: "CorrelationId", msg: amqp.Publishing{CorrelationId: "c"}, want: amqp.Publishing{CorrelationId: "c"}},
		{name: "ReplyTo", msg: amqp.Publishing{ReplyTo: "r"}, want: amqp.Publishing{ReplyTo: "r"}},
		{name: "Expiration", msg: amqp.Publishing{Expiration: "0"}, want: amqp.Publishing{Expiration: "0"}},
		{name: "MessageId of 255 bytes", msg: amqp.Publishing{MessageId: long}, want: amqp.Publishing{MessageId: long}},
		{name: "Timestamp: whole seconds, local time", msg: amqp.Publishing{Timestamp: wiretest.Time}, want: amqp.Publishing{Timestamp: time.Unix(1714975689, 0)}},
		{name: "Timestamp at the Unix epoch is sent", msg: amqp.Publishing{Timestamp: time.Unix(0, 0).UTC()}, want: amqp.Publishing{Timestamp: time.Unix(0, 0)}},
		{name: "Timestamp before 1970", msg: amqp.Publishing{Timestamp: time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC)}, want: amqp.Publishing{Timestamp: time.Unix(-2208988800, 0)}},
		{name: "Timestamp in year 1 but not zero", msg: amqp.Publishing{Timestamp: time.Time{}.Add(time.Second)}, want: amqp.Publishing{Timestamp: time.Unix(-62135596799, 0)}},
		{name: "zero Timestamp is not sent", msg: amqp.Publishing{Timestamp: time.Time{}}, want: amqp.Publishing{}},
		{name: "Type", msg: amqp.Publishing{Type: "t"}, want: amqp.Publishing{Type: "t"}},
		{name: "UserId", msg: amqp.Publishing{UserId: "u"}, want: amqp.Publishing{UserId: "u"}},
		{name: "AppId", msg: amqp.Publishing{AppId: "a"}, want: amqp.Publishing{AppId: "a"}},
		{name: "Body", msg: amqp.Publishing{Body: []byte("payload")}, want: amqp.Publishing{Body: []byte("payload")}},
		{name: "nil Body reads as empty", msg: amqp.Publishing{Body: nil}, want: amqp.Publishing{Body: []byte{}}},
		{name: "empty Body reads as empty", msg: amqp.Publishing{Body: []byte{}}, want: amqp.Publishing{Body: []byte{}}},
		{name: "empty Headers are not sent: nil", msg: amqp.Publishing{Headers: amqp.Table{}}, want: amqp.Publishing{}},

		{name: "bool", msg: wiretest.Hdr("v", true), want: wiretest.Hdr("v", true)},
		{name: "uint8 reads as byte", msg: wiretest.Hdr("v", uint8(255)), want: wiretest.Hdr("v", byte(255))},
		{name: "int8", msg: wiretest.Hdr("v", int8(math.MinInt8)), want: wiretest.Hdr("v", int8(math.MinInt8))},
		{name: "int16", msg: wiretest.Hdr("v", int16(math.MaxInt16)), want: wiretest.Hdr("v", int16(math.MaxInt16))},
		{name: "uint16", msg: wiretest.Hdr("v", uint16(math.MaxUint16)), want: wiretest.Hdr("v", uint16(math.MaxUint16))},
		{name: "int reads as int32", msg: wiretest.Hdr("v", 42), want: wiretest.Hdr("v", int32(42))},
		{name: "int beyond 32 bits loses its high bits, as amqp091-go sends it", msg: wiretest.Hdr("v", 1<<32+5), want: wiretest.Hdr("v", int32(5))},
		{name: "int32", msg: wiretest.Hdr("v", int32(math.MaxInt32)), want: wiretest.Hdr("v", int32(math.MaxInt32))},
		{name: "uint32", msg: wiretest.Hdr("v", uint32(7)), want: wiretest.Hdr("v", uint32(7))},
		{name: "int64", msg: wiretest.Hdr("v", int64(math.MaxInt64)), want: wiretest.Hdr("v", int64(math.MaxInt64))},
		{name: "float32", msg: wiretest.Hdr("v", float32(math.Inf(-1))), want: wiretest.Hdr("v", float32(math.Inf(-1)))},
		{name: "float64", msg: wiretest.Hdr("v", math.SmallestNonzeroFloat64), want: wiretest.Hdr("v", math.SmallestNonzeroFloat64)},
		{name: "negative zero float64", msg: wiretest.Hdr("v", math.Copysign(0, -1)), want: wiretest.Hdr("v", math.Copysign(0, -1))},
		{name: "Decimal", msg: wiretest.Hdr("v", amqp.Decimal{Scale: 255, Value: math.MinInt32}), want: wiretest.Hdr("v", amqp.Decimal{Scale: 255, Value: math.MinInt32})},
		{name: "time.Time: whole seconds, local time", msg: wiretest.Hdr("v", wiretest.Time), want: wiretest.Hdr("v", time.Unix(1714975689, 0))},
		{name: "zero time.Time is sent", msg: wiretest.Hdr("v", time.Time{}), want: wiretest.Hdr("v", time.Unix(-62135596800, 0))},
		{name: "string", msg: wiretest.Hdr("v", "s"), want: wiretest.Hdr("v", "s")},
		{name: "empty string", msg: wiretest.Hdr("v", ""), want: wiretest.Hdr("v", "")},
		{name: "[]byte", msg: wiretest.Hdr("v", []byte{0xff}), want: wiretest.Hdr("v", []byte{0xff})},
		{name: "nil []byte reads as empty", msg: wiretest.Hdr("v", []byte(nil)), want: wiretest.Hdr("v", []byte{})},
		{name: "nil", msg: wiretest.Hdr("v", nil), want: wiretest.Hdr("v", nil)},
		{name: "array", msg: wiretest.Hdr("v", []any{true, "x", nil}), want: wiretest.Hdr("v", []any{true, "x", nil})},
		{name: "empty array reads as nil", msg: wiretest.Hdr("v", []any{}), want: wiretest.Hdr("v", []any(nil))},
		{name: "nil array reads as nil", msg: wiretest.Hdr("v", []any(nil)), want: wiretest.Hdr("v", []any(nil))},
		{name: "table", msg: wiretest.Hdr("v", amqp.Table{"b": 1, "a": "x"}), want: wiretest.Hdr("v", amqp.Table{"b": int32(1), "a": "x"})},
		{name: "empty nested table reads as empty", msg: wiretest.Hdr("v", amqp.Table{}), want: wiretest.Hdr("v", amqp.Table{})},
		{name: "nil nested table reads as empty", msg: wiretest.Hdr("v", amqp.Table(nil)), want: wiretest.Hdr("v", amqp.Table{})},
		{name: "arrays nested 16 deep", msg: amqp.Publishing{Headers: pubNestedTable(1, maxHeaderDepth)}, want: amqp.Publishing{Headers: pubNestedTable(int32(1), maxHeaderDepth)}},
		{name: "tables nested 16 deep", msg: amqp.Publishing{Headers: amqp.Table{"h": wiretest.Nested(amqp.Table{}, maxHeaderDepth-1, true)}}, want: amqp.Publishing{Headers: amqp.Table{"h": wiretest.Nested(amqp.Table{}, maxHeaderDepth-1, true)}}},
		{name: "empty and 255-byte header names", msg: amqp.Publishing{Headers: amqp.Table{"": 1, long: 2}}, want: amqp.Publishing{Headers: amqp.Table{"": int32(1), long: int32(2)}}},
		{name: "names in byte order, not rune order", msg: amqp.Publishing{Headers: amqp.Table{"é": 1, "z": 2, "Z": 3}}, want: amqp.Publishing{Headers: amqp.Table{"é": int32(1), "z": int32(2), "Z": int32(3)}}},
		{name: "8192 entries and elements", msg: amqp.Publishing{Headers: pubWide(maxHeaderElements, 1)}, want: amqp.Publishing{Headers: pubWide(maxHeaderElements, int32(1))}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix := []byte("before")
			stored, err := AppendPublishing(prefix, tt.exchange, tt.key, tt.msg)
			if err != nil {
				t.Fatalf("AppendPublishing: %v", err)
			}
			if got, want := string(stored[:len(prefix)]), "before"; got != want {
				t.Fatalf("prefix: got %q, want %q", got, want)
			}
			stored = append(stored, "after"...)
			ex, key, got, rest, err := ReadPublishing(stored[len(prefix):])
			if err != nil {
				t.Fatalf("ReadPublishing: %v", err)
			}
			if ex != tt.exchange || key != tt.key {
				t.Fatalf("exchange, key: got %q %q, want %q %q", ex, key, tt.exchange, tt.key)
			}
			if got, want := string(rest), "after"; got != want {
				t.Fatalf("rest: got %q, want %q", got, want)
			}
			want := tt.want
			if want.Body == nil {
				want.Body = []byte{}
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("ReadPublishing:\n got  %#v\n want %#v", got, want)
			}
			again, err := AppendPublishing(nil, ex, key, got)
			if err != nil {
				t.Fatalf("AppendPublishing of what was read: %v", err)
			}
			if want := stored[len(prefix) : len(stored)-len("after")]; !bytes.Equal(again, want) {
				t.Fatalf("re-encoded:\n got  %x\n want %x", again, want)
			}
		})
	}
}

// pubWide returns Headers of n entries, the first of them an array of n
// elements, every other value v.
func pubWide(n int, v any) amqp.Table {
	t := amqp.Table{}
	a := make([]any, n)
	for i := range a {
		a[i] = v
	}
	t["a"] = a
	for i := 1; i < n; i++ {
		t[fmt.Sprintf("k%05d", i)] = v
	}
	return t
}

// TestPublishingStoredForm pins the stored form byte for byte: a change of
// it must come with a new publishingVersion.
func TestPublishingStoredForm(t *testing.T) {
	msg := amqp.Publishing{
		ContentType: "t", DeliveryMode: 2, Timestamp: time.Unix(1, 0), AppId: "a",
		Headers: amqp.Table{"b": int16(-2), "a": []any{true}},
		Body:    []byte("xy"),
	}
	got, err := AppendPublishing(nil, "e", "k", msg)
	if err != nil {
		t.Fatal(err)
	}
	want := pubCat(
		byte(1),      // version
		byte(1), "e", // exchange
		byte(1), "k", // routing key
		uint64(2),      // body size
		uint16(0xb048), // content type, headers, delivery mode, timestamp, app id
		byte(1), "t",   // content type
		uint32(14),        // headers
		byte(1), "a", "A", // "a": an array
		uint32(2), "t", byte(1),
		byte(1), "b", "s", // "b": an int16
		uint16(0xfffe),
		byte(2),      // delivery mode
		uint64(1),    // timestamp
		byte(1), "a", // app id
		"xy", // body
	)
	if !bytes.Equal(got, want) {
		t.Fatalf("stored form:\n got  %x\n want %x", got, want)
	}
}

// pubCat concatenates its arguments as AMQP encodes them: a byte, a
// string's or a []byte's bytes, a uint16, uint32 or uint64 big-endian.
func pubCat(parts ...any) []byte {
	var b []byte
	for _, p := range parts {
		switch p := p.(type) {
		case byte:
			b = append(b, p)
		case string:
			b = append(b, p...)
		case []byte:
			b = append(b, p...)
		case uint16:
			b = binary.BigEndian.AppendUint16(b, p)
		case uint32:
			b = binary.BigEndian.AppendUint32(b, p)
		case uint64:
			b = binary.BigEndian.AppendUint64(b, p)
		default:
			panic(fmt.Sprintf("pubCat: %T", p))
		}
	}
	return b
}

// TestPublishingKeepsNoReference checks that what ReadPublishing returns
// shares no memory with its input, which the caller may reuse.
func TestPublishingKeepsNoReference(t *testing.T) {
	stored, err := AppendPublishing(nil, "ex", "rk", wiretest.Every)
	if err != nil {
		t.Fatal(err)
	}
	_, _, got, _, err := ReadPublishing(stored)
	if err != nil {
		t.Fatal(err)
	}
	for i := range stored {
		stored[i] = 0xAA
	}
	if !reflect.DeepEqual(got, pubEveryRead) {
		t.Fatalf("after the input was overwritten:\n got  %#v\n want %#v", got, pubEveryRead)
	}
}

// TestPublishingSequence reads messages stored one after another, as an
// outcome holding several staged messages stores them.
func TestPublishingSequence(t *testing.T) {
	var b []byte
	var err error
	for i := range 3 {
		if b, err = AppendPublishing(b, "ex", fmt.Sprint("rk", i), amqp.Publishing{MessageId: fmt.Sprint("m", i)}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		var key string
		var msg amqp.Publishing
		if _, key, msg, b, err = ReadPublishing(b); err != nil {
			t.Fatal(err)
		}
		if got, want := key+" "+msg.MessageId, fmt.Sprintf("rk%d m%d", i, i); got != want {
			t.Fatalf("message %d: got %v, want %v", i, got, want)
		}
	}
	if got, want := len(b), 0; got != want {
		t.Fatalf("left: got %v, want %v", got, want)
	}
}

// pubUnsupported is a named string type: amqp091-go sends only string
// itself.
type pubUnsupported string

// TestAppendPublishingRefuses is the table of what AppendPublishing
// refuses: what amqp091-go would not send or its reader not receive. Each
// error wraps ErrBadPublishing and names the field.
func TestAppendPublishingRefuses(t *testing.T) {
	if err := wiretest.EveryHeaders.Validate(); err != nil {
		t.Fatalf("amqp.Table.Validate refuses wiretest.Every's headers, which AppendPublishing accepts: %v", err)
	}
	long := strings.Repeat("s", 256)
	tests := []struct {
		name     string
		exchange string
		key      string
		msg      amqp.Publishing
		want     string // in the error
	}{
		{name: "exchange of 256 bytes", exchange: long, want: "exchange: 256 bytes, more than the 255 of a short string"},
		{name: "routing key of 256 bytes", key: long, want: "routing key: 256 bytes"},
		{name: "ContentType", msg: amqp.Publishing{ContentType: long}, want: "ContentType: 256 bytes"},
		{name: "ContentEncoding", msg: amqp.Publishing{ContentEncoding: long}, want: "ContentEncoding: 256 bytes"},
		{name: "CorrelationId", msg: amqp.Publishing{CorrelationId: long}, want: "CorrelationId: 256 bytes"},
		{name: "ReplyTo", msg: amqp.Publishing{ReplyTo: long}, want: "ReplyTo: 256 bytes"},
		{name: "Expiration", msg: amqp.Publishing{Expiration: long}, want: "Expiration: 256 bytes"},
		{name: "MessageId", msg: amqp.Publishing{MessageId: long}, want: "MessageId: 256 bytes"},
		{name: "Type", msg: amqp.Publishing{Type: long}, want: "Type: 256 bytes"},
		{name: "UserId", msg: amqp.Publishing{UserId: long}, want: "UserId: 256 bytes"},
		{name: "AppId", msg: amqp.Publishing{AppId: long}, want: "AppId: 256 bytes"},
		{name: "header name of 256 bytes", msg: wiretest.Hdr(long, 1), want: `Headers["ssss`},
		{name: "nested header name of 256 bytes", msg: wiretest.Hdr("a", []any{amqp.Table{long: 1}}), want: `Headers["a"][0]["sss`},
		{name: "uint", msg: wiretest.Hdr("v", uint(1)), want: `Headers["v"]: value of type uint, which an AMQP table cannot carry`},
		{name: "uint64", msg: wiretest.Hdr("v", uint64(1)), want: `Headers["v"]: value of type uint64`},
		{name: "map[string]any is not an amqp.Table", msg: wiretest.Hdr("v", map[string]any{}), want: `Headers["v"]: value of type map[string]interface {}`},
		{name: "[]string is not an []any", msg: wiretest.Hdr("v", []string{"a"}), want: `Headers["v"]: value of type []string`},
		{name: "named string type", msg: wiretest.Hdr("v", pubUnsupported("x")), want: `Headers["v"]: value of type wire.pubUnsupported`},
		{name: "pointer", msg: wiretest.Hdr("v", new(int32)), want: `Headers["v"]: value of type *int32`},
		{name: "struct", msg: wiretest.Hdr("v", struct{}{}), want: `Headers["v"]: value of type struct {}`},
		{name: "time.Duration", msg: wiretest.Hdr("v", time.Second), want: `Headers["v"]: value of type time.Duration`},
		{name: "deep in arrays and tables", msg: wiretest.Hdr("v", []any{1, amqp.Table{"x": []any{nil, uint(1)}}}), want: `Headers["v"][1]["x"][1]: value of type uint`},
		{name: "arrays nested 17 deep", msg: amqp.Publishing{Headers: pubNestedTable(1, maxHeaderDepth+1)}, want: `Headers["h"][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]: array nested deeper than 16`},
		{name: "tables nested 17 deep", msg: wiretest.Hdr("h", wiretest.Nested(amqp.Table{}, maxHeaderDepth, true)), want: `table nested deeper than 16`},
		{name: "table of 8193 entries", msg: amqp.Publishing{Headers: pubWide(maxHeaderElements+1, 1)}, want: "Headers: table of 8193 entries, more than 8192"},
		{name: "array of 8193 elements", msg: wiretest.Hdr("a", make([]any, maxHeaderElements+1)), want: `Headers["a"]: array of 8193 elements, more than 8192`},
		{name: "nested table of 8193 entries", msg: wiretest.Hdr("t", pubWide(maxHeaderElements+1, 1)), want: `Headers["t"]: table of 8193 entries`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix := []byte("before")
			b, err := AppendPublishing(prefix, tt.exchange, tt.key, tt.msg)
			if !errors.Is(err, ErrBadPublishing) {
				t.Fatalf("error: got %v, want one wrapping %v", err, ErrBadPublishing)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error: got %q, want it to hold %q", err, tt.want)
			}
			if got, want := string(b), "before"; got != want {
				t.Fatalf("returned bytes: got %q, want b as it was, %q", got, want)
			}
			if strings.Contains(tt.want, "value of type") && tt.msg.Headers.Validate() == nil {
				t.Fatalf("amqp.Table.Validate accepts the type AppendPublishing refuses: %#v", tt.msg.Headers)
			}
		})
	}
}

// TestPublishingLongLengths checks the bound on long strings, byte arrays,
// tables and arrays, which the other tests cannot reach without 2 GiB of
// input.
func TestPublishingLongLengths(t *testing.T) {
	if fe := checkLongLen(maxLongLen, "string"); fe != nil {
		t.Fatalf("checkLongLen(maxLongLen): %v", fe.at())
	}
	fe := checkLongLen(maxLongLen+1, "string")
	if fe == nil {
		t.Fatal("checkLongLen(maxLongLen+1): accepted")
	}
	if got, want := fe.reason, "string of 2147483648 bytes, more than 2147483647"; got != want {
		t.Fatalf("reason: got %q, want %q", got, want)
	}
}

// pubStoredHead is the stored form up to the property flags of a message
// to the default exchange with an empty routing key and body size size.
func pubStoredHead(size uint64) []byte {
	return pubCat(byte(1), byte(0), byte(0), size)
}

// pubStoredHeaders is the stored form of a message whose Headers are the
// field table entries entries, and whose table length is n more than
// their length.
func pubStoredHeaders(n int, entries ...any) []byte {
	table := pubCat(entries...)
	return pubCat(pubStoredHead(0), uint16(pubFlagHeaders), uint32(len(table)+n), table)
}

// TestReadPublishingRefuses is the table of stored forms ReadPublishing
// refuses: damaged, forged, from another version, or not what
// AppendPublishing writes. Each error wraps ErrBadStored and
// names the field.
func TestReadPublishingRefuses(t *testing.T) {
	deep := []byte("V")
	for range maxHeaderDepth + 1 {
		deep = pubCat("A", uint32(len(deep)), deep)
	}
	var deepTables []byte // the entry "t" of 17 tables nested
	for range maxHeaderDepth + 1 {
		deepTables = pubCat(byte(1), "t", "F", uint32(len(deepTables)), deepTables)
	}
	var wideArray []byte
	for range maxHeaderElements + 1 {
		wideArray = append(wideArray, 'V')
	}
	var wideTable []byte
	for i := range maxHeaderElements + 1 {
		wideTable = pubCat(wideTable, byte(2), uint16(i), "V")
	}
	tests := []struct {
		name  string
		input []byte
		want  string // in the error
	}{
		{"empty", nil, "version: at byte 0: needs 1 bytes, 0 left in the input"},
		{"version 0", []byte{0}, "version: at byte 0: unknown version 0, want 1"},
		{"version 2", pubCat(byte(2), pubStoredHead(0)[1:], uint16(0)), "unknown version 2"},
		{"exchange longer than the input", pubCat(byte(1), byte(5), "abc"), "exchange: at byte 1: length 5, more than the 3 bytes left in the input"},
		{"cluster-id flag", pubCat(pubStoredHead(0), uint16(0x0004)), "property flags: at byte 11: unknown flags 0x0004"},
		{"flag bit 1", pubCat(pubStoredHead(0), uint16(0x0002)), "unknown flags 0x0002"},
		{"flag bit 0 (continuation)", pubCat(pubStoredHead(0), uint16(0x0001)), "unknown flags 0x0001"},
		{"empty ContentType", pubCat(pubStoredHead(0), uint16(pubFlagContentType), byte(0)), "ContentType: at byte 13: present with its zero value"},
		{"empty AppId", pubCat(pubStoredHead(0), uint16(pubFlagAppID), byte(0)), "AppId: at byte 13: present with its zero value"},
		{"DeliveryMode 0", pubCat(pubStoredHead(0), uint16(pubFlagDeliveryMode), byte(0)), "DeliveryMode: at byte 13: present with its zero value"},
		{"Priority 0", pubCat(pubStoredHead(0), uint16(pubFlagPriority), byte(0)), "Priority: at byte 13: present with its zero value"},
		{"zero Timestamp", pubCat(pubStoredHead(0), uint16(pubFlagTimestamp), uint64(0xfffffff1886e0900)), "Timestamp: at byte 13: present with its zero value"},
		{"empty Headers", pubStoredHeaders(0), "Headers: at byte 13: present with its zero value"},
		{"Headers longer than the input", pubStoredHeaders(1, byte(1), "a", "V"), "Headers: at byte 13: length 4, more than the 3 bytes left in the input"},
		{"table length above 2^31-1", pubCat(pubStoredHead(0), uint16(pubFlagHeaders), uint32(math.MaxUint32)), "Headers: at byte 13: length 4294967295, more than 2147483647"},
		{"trailing byte in the table", pubStoredHeaders(0, byte(1), "a", "V", byte(1)), "Headers: name at byte 20: length 1, more than the 0 bytes left in its table or array"},
		{"field runs past its table", pubStoredHeaders(-2, byte(1), "a", "I", uint32(7)), `Headers["a"]: at byte 20: needs 4 bytes, 2 left in its table or array`},
		{"field runs past its array", pubStoredHeaders(0, byte(1), "a", "A", uint32(3), "I", uint32(7)), `Headers["a"][0]: at byte 25: needs 4 bytes, 2 left in its table or array`},
		{"array longer than its table", pubStoredHeaders(0, byte(1), "a", "A", uint32(2), "V"), `Headers["a"]: at byte 20: length 2, more than the 1 bytes left in its table or array`},
		{"keys out of order", pubStoredHeaders(0, byte(1), "b", "V", byte(1), "a", "V"), `Headers["a"]: at byte 20: name after "b": names must be in increasing byte order, each once`},
		{"key repeated", pubStoredHeaders(0, byte(1), "a", "V", byte(1), "a", "V"), `Headers["a"]: at byte 20: name after "a"`},
		{"unknown field type", pubStoredHeaders(0, byte(1), "a", "Z"), `Headers["a"]: at byte 19: unknown field type 'Z'`},
		{"field type missing", pubStoredHeaders(0, byte(1), "a"), `Headers["a"]: type at byte 19: needs 1 bytes, 0 left`},
		{"bool 2", pubStoredHeaders(0, byte(1), "a", "t", byte(2)), `Headers["a"]: at byte 20: bool 2, neither 0 nor 1`},
		{"string length above 2^31-1", pubStoredHeaders(0, byte(1), "a", "S", uint32(math.MaxInt32+1)), `Headers["a"]: at byte 20: length 2147483648, more than 2147483647`},
		{"string longer than its table", pubStoredHeaders(0, byte(1), "a", "S", uint32(1)), `Headers["a"]: at byte 20: length 1, more than the 0 bytes left in its table or array`},
		{"byte array longer than its table", pubStoredHeaders(0, byte(1), "a", "x", uint32(9), "abc"), `Headers["a"]: at byte 20: length 9, more than the 3 bytes left in its table or array`},
		{"decimal cut short", pubStoredHeaders(0, byte(1), "a", "D", uint32(9)), `Headers["a"]: at byte 20: needs 5 bytes, 4 left`},
		{"nested table's trailing byte", pubStoredHeaders(0, byte(1), "a", "F", uint32(4), byte(1), "b", "V", byte(9)), `Headers["a"]: name at byte 27: length 9, more than the 0 bytes left in its table or array`},
		{"arrays nested 17 deep", pubStoredHeaders(0, byte(1), "a", deep), `Headers["a"][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]: at byte 99: array nested deeper than 16`},
		{"tables nested 17 deep", pubStoredHeaders(0, deepTables), `Headers["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]["t"]: at byte 131: table nested deeper than 16`},
		{"array of 8193 elements", pubStoredHeaders(0, byte(1), "a", "A", uint32(len(wideArray)), wideArray), `Headers["a"]: at byte 8216: array of more than 8192 elements`},
		{"table of 8193 entries", pubStoredHeaders(0, wideTable), "Headers: at byte 32785: table of more than 8192 entries"},
		{"body size beyond the input", pubCat(pubStoredHead(3), uint16(0), "ab"), "body: at byte 13: 3 bytes by the body size, 2 left"},
		{"body size 2^64-1", pubCat(pubStoredHead(math.MaxUint64), uint16(0)), "body: at byte 13: 18446744073709551615 bytes by the body size, 0 left"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, _, _, err := ReadPublishing(tt.input)
			if !errors.Is(err, ErrBadStored) {
				t.Fatalf("error: got %v, want one wrapping %v", err, ErrBadStored)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error: got %q, want it to hold %q", err, tt.want)
			}
		})
	}
}

// TestReadPublishingTruncated cuts the stored form of a message with every
// property and header type at every byte: each cut is an error.
func TestReadPublishingTruncated(t *testing.T) {
	stored, err := AppendPublishing(nil, "ex", "rk", wiretest.Every)
	if err != nil {
		t.Fatal(err)
	}
	for n := range len(stored) {
		if _, _, _, _, err := ReadPublishing(stored[:n]); !errors.Is(err, ErrBadStored) {
			t.Fatalf("cut at byte %d of %d: got %v, want an error wrapping %v", n, len(stored), err, ErrBadStored)
		}
	}
	if _, _, _, _, err := ReadPublishing(stored); err != nil {
		t.Fatalf("whole: %v", err)
	}
}

// TestReadPublishingAllocatesWithinInput gives ReadPublishing forged
// lengths of gigabytes in a few bytes: it refuses them without allocating
// what they claim.
func TestReadPublishingAllocatesWithinInput(t *testing.T) {
	forged := [][]byte{
		pubCat(pubStoredHead(1<<40), uint16(0), "x"),
		pubCat(pubStoredHead(0), uint16(pubFlagHeaders), uint32(maxLongLen), byte(1), "a", "V"),
		pubStoredHeaders(0, byte(1), "a", "S", uint32(maxLongLen)),
		pubStoredHeaders(0, byte(1), "a", "x", uint32(maxLongLen)),
		pubStoredHeaders(0, byte(1), "a", "A", uint32(maxLongLen)),
		pubStoredHeaders(0, byte(1), "a", "F", uint32(maxLongLen)),
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for _, b := range forged {
		if _, _, _, _, err := ReadPublishing(b); !errors.Is(err, ErrBadStored) {
			t.Fatalf("ReadPublishing(%x): got %v, want an error", b, err)
		}
	}
	runtime.ReadMemStats(&after)
	if got, max := after.TotalAlloc-before.TotalAlloc, uint64(64<<20); got > max {
		t.Fatalf("allocated %d bytes for %d forged inputs of a few bytes each, want at most %d", got, len(forged), max)
	}
}

// TestPublishingAsReceived publishes messages through a real RabbitMQ with
// amqp091-go, gets them back, and checks that ReadPublishing returns, field
// for field, what the consumer received: the stored form holds what a
// consumer receives. It needs the RabbitMQ of testenv.AMQPURL.
func TestPublishingAsReceived(t *testing.T) {
	url := testenv.AMQPURL(t)
	uri, err := amqp.ParseURI(url)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	exchange, queue := testenv.Name(t), testenv.Name(t)
	testenv.DeleteQueues(t, url, queue)
	t.Cleanup(func() {
		if c, err := amqp.Dial(url); err == nil {
			defer c.Close()
			if ch, err := c.Channel(); err == nil {
				_ = ch.ExchangeDelete(exchange, false, false)
			}
		}
	})
	if err := ch.ExchangeDeclare(exchange, amqp.ExchangeTopic, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(queue, "order.#", exchange, false, nil); err != nil {
		t.Fatal(err)
	}

	every := wiretest.Every
	every.UserId = uri.Username // RabbitMQ refuses any other user-id
	tests := []struct {
		name     string
		exchange string
		key      string
		msg      amqp.Publishing
	}{
		{"every property and header type", exchange, "order.paid", every},
		{"zero message", exchange, "order.x", amqp.Publishing{}},
		{"empty Headers and Body", exchange, "order.y", amqp.Publishing{Headers: amqp.Table{}, Body: []byte{}}},
		{"default exchange", "", queue, amqp.Publishing{Headers: amqp.Table{"n": nil, "a": []any{}, "t": amqp.Table(nil), "x": []byte(nil)}, Body: []byte("b")}},
		{"large", exchange, "order." + strings.Repeat("k", 200), amqp.Publishing{
			MessageId: strings.Repeat("m", 255),
			Headers:   amqp.Table{"deep": wiretest.Nested(amqp.Table{"s": strings.Repeat("s", 5000)}, maxHeaderDepth-1, false)},
			Body:      bytes.Repeat([]byte("body"), 100_000), // several frames
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stored, err := AppendPublishing(nil, tt.exchange, tt.key, tt.msg)
			if err != nil {
				t.Fatalf("AppendPublishing: %v", err)
			}
			ex, key, got, _, err := ReadPublishing(stored)
			if err != nil {
				t.Fatalf("ReadPublishing: %v", err)
			}

			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			conf, err := ch.PublishWithDeferredConfirmWithContext(ctx, tt.exchange, tt.key, true, false, tt.msg)
			if err != nil {
				t.Fatalf("publish: %v", err)
			}
			if ok, err := conf.WaitContext(ctx); err != nil || !ok {
				t.Fatalf("confirm: %v %v", ok, err)
			}
			d := pubGet(t, ch, queue)

			fields := []struct {
				name      string
				got, want any
			}{
				{"Exchange", ex, d.Exchange},
				{"RoutingKey", key, d.RoutingKey},
				{"Headers", got.Headers, d.Headers},
				{"ContentType", got.ContentType, d.ContentType},
				{"ContentEncoding", got.ContentEncoding, d.ContentEncoding},
				{"DeliveryMode", got.DeliveryMode, d.DeliveryMode},
				{"Priority", got.Priority, d.Priority},
				{"CorrelationId", got.CorrelationId, d.CorrelationId},
				{"ReplyTo", got.ReplyTo, d.ReplyTo},
				{"Expiration", got.Expiration, d.Expiration},
				{"MessageId", got.MessageId, d.MessageId},
				{"Timestamp", got.Timestamp, d.Timestamp},
				{"Type", got.Type, d.Type},
				{"UserId", got.UserId, d.UserId},
				{"AppId", got.AppId, d.AppId},
				{"Body", got.Body, d.Body},
			}
			for _, f := range fields {
				if !reflect.DeepEqual(f.got, f.want) {
					t.Errorf("%s: got %#v from ReadPublishing, want %#v as received", f.name, f.got, f.want)
				}
			}
		})
	}
}

// pubGet returns the next message on queue, waiting for it a few seconds.
func pubGet(t *testing.T, ch *amqp.Channel, queue string) amqp.Delivery {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatalf("get: %v", err)
		}
		if ok {
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("no message on %s after 5s", queue)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pubSameField reports whether a and b are the same header value: of the
// same type and deeply equal, floats compared bit for bit (so that NaN
// equals itself) and times by instant and location.
func pubSameField(a, b any) bool {
	switch a := a.(type) {
	case float32:
		b, ok := b.(float32)
		return ok && math.Float32bits(a) == math.Float32bits(b)
	case float64:
		b, ok := b.(float64)
		return ok && math.Float64bits(a) == math.Float64bits(b)
	case []any:
		b, ok := b.([]any)
		if !ok || len(a) != len(b) || (a == nil) != (b == nil) {
			return false
		}
		for i := range a {
			if !pubSameField(a[i], b[i]) {
				return false
			}
		}
		return true
	case amqp.Table:
		b, ok := b.(amqp.Table)
		if !ok || len(a) != len(b) || (a == nil) != (b == nil) {
			return false
		}
		for k, v := range a {
			w, ok := b[k]
			if !ok || !pubSameField(v, w) {
				return false
			}
		}
		return true
	}
	return reflect.DeepEqual(a, b)
}

// pubSame reports whether a and b are the same message, header values
// compared by pubSameField.
func pubSame(a, b amqp.Publishing) bool {
	if !pubSameField(a.Headers, b.Headers) {
		return false
	}
	a.Headers, b.Headers = nil, nil
	return reflect.DeepEqual(a, b)
}

// FuzzReadPublishing reads arbitrary bytes: ReadPublishing never panics,
// and what it reads re-encodes to the very bytes it consumed, which read
// again give the same message.
func FuzzReadPublishing(f *testing.F) {
	seeds := []struct {
		exchange, key string
		msg           amqp.Publishing
	}{
		{"", "", amqp.Publishing{}},
		{"ex", "rk", wiretest.Every},
		{"", "q", amqp.Publishing{ContentType: "c", ContentEncoding: "e", DeliveryMode: 1, Priority: 9, CorrelationId: "i", ReplyTo: "r",
			Expiration: "1", MessageId: "m", Timestamp: time.Unix(1, 0), Type: "t", UserId: "u", AppId: "a", Body: []byte("b")}},
		{"", "", wiretest.Hdr("n", wiretest.Nested(amqp.Table{"a": []any{nil}}, 7, true))},
		{"", "", wiretest.Hdr("f", []any{float32(math.NaN()), math.NaN(), math.Inf(1), math.Copysign(0, -1)})},
	}
	for _, tt := range seeds {
		b, err := AppendPublishing(nil, tt.exchange, tt.key, tt.msg)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, v := range wiretest.EveryHeaders {
		b, err := AppendPublishing(nil, "", "", wiretest.Hdr("v", v))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add(pubStoredHeaders(0, byte(1), "b", "V", byte(1), "a", "V"))
	f.Add(pubStoredHeaders(0, byte(1), "a", "t", byte(2)))
	f.Add(pubCat(pubStoredHead(0), uint16(pubFlagTimestamp), uint64(0xfffffff1886e0900)))

	f.Fuzz(func(t *testing.T, b []byte) {
		ex, key, msg, rest, err := ReadPublishing(b)
		if err != nil {
			if !errors.Is(err, ErrBadStored) {
				t.Fatalf("error %v does not wrap %v", err, ErrBadStored)
			}
			return
		}
		if len(rest) > len(b) || !bytes.Equal(rest, b[len(b)-len(rest):]) {
			t.Fatalf("rest %x is not the end of the input %x", rest, b)
		}
		used := b[:len(b)-len(rest)]
		again, err := AppendPublishing(nil, ex, key, msg)
		if err != nil {
			t.Fatalf("AppendPublishing refuses what ReadPublishing read from %x: %v", used, err)
		}
		if !bytes.Equal(again, used) {
			t.Fatalf("re-encoded:\n got  %x\n want %x", again, used)
		}
		ex2, key2, msg2, rest2, err := ReadPublishing(again)
		if err != nil {
			t.Fatalf("reading the re-encoded form: %v", err)
		}
		if ex2 != ex || key2 != key || len(rest2) != 0 || !pubSame(msg2, msg) {
			t.Fatalf("read again:\n got  %q %q %#v rest %x\n want %q %q %#v", ex2, key2, msg2, rest2, ex, key, msg)
		}
	})
}
