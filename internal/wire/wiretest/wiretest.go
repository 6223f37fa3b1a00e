// Package wiretest holds the messages the tests of internal/wire and of
// amqpidem (whose frame-size checks read the codec's form) both use: one
// with every property and every header type amqp091-go sends, and helpers
// that build headers. Only tests import it.
package wiretest

import (
	"math"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Nested returns v inside n arrays, or n tables under the key "t" when
// tables is set.
func Nested(v any, n int, tables bool) any {
	for range n {
		if tables {
			v = amqp.Table{"t": v}
		} else {
			v = []any{v}
		}
	}
	return v
}

// Hdr returns a message whose one header, k, is v.
func Hdr(k string, v any) amqp.Publishing {
	return amqp.Publishing{Headers: amqp.Table{k: v}}
}

// Every is a message with every property set and a header of every
// type amqp091-go sends (EveryHeaders), nested tables and arrays included;
// internal/wire's tests hold what a consumer receives for it. Time, its time, has
// nanoseconds and a zone of its own, which neither survive.
var (
	Time         = time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.FixedZone("X", 3600))
	EveryHeaders = amqp.Table{
		"bool":    true,
		"false":   false,
		"uint8":   uint8(200),
		"int8":    int8(-5),
		"int16":   int16(-300),
		"uint16":  uint16(60000),
		"int":     -70000,
		"int32":   int32(math.MinInt32),
		"uint32":  uint32(math.MaxUint32),
		"int64":   int64(math.MinInt64),
		"float32": float32(1.5),
		"float64": -2.25,
		"decimal": amqp.Decimal{Scale: 2, Value: -12345},
		"time":    Time,
		"string":  "héllo",
		"bytes":   []byte{0, 1, 2},
		"void":    nil,
		"array":   []any{"a", 1, int64(2), []any{}, amqp.Table{"k": "v"}},
		"table":   amqp.Table{"inner": amqp.Table{"x": []byte("y")}, "empty": amqp.Table{}},
	}
	Every = amqp.Publishing{
		ContentType: "application/json", ContentEncoding: "gzip", DeliveryMode: amqp.Persistent, Priority: 7,
		CorrelationId: "corr", ReplyTo: "replies", Expiration: "60000", MessageId: "m-1", Timestamp: Time,
		Type: "order.paid", UserId: "guest", AppId: "billing", Headers: EveryHeaders, Body: []byte(`{"id":1}`),
	}
)
