package amqpidem

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"maps"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// TestParseHeaders is the table of what parseHeaders makes of each of
// amqpidem's headers, forged and malformed values included: wrong types,
// negative, huge, missing, void. The rules are those of the package
// documentation's "Headers a publisher can forge".
func TestParseHeaders(t *testing.T) {
	const max = 5
	long := strings.Repeat("x", maxHeaderText+10)
	short := strings.Repeat("e", maxShortText)
	tooLong := short + "e"
	tests := []struct {
		name  string
		table amqp.Table
		want  headers // parsed is set for every case
	}{
		{"no headers", nil, headers{}},
		{"only other headers", amqp.Table{"tenant": "acme", HeaderReason: "handler error", "x-death": []any{}}, headers{}},

		{"attempt int64", amqp.Table{HeaderAttempt: int64(3)}, headers{attempt: 3}},
		{"attempt int8", amqp.Table{HeaderAttempt: int8(2)}, headers{attempt: 2}},
		{"attempt int16", amqp.Table{HeaderAttempt: int16(2)}, headers{attempt: 2}},
		{"attempt int32", amqp.Table{HeaderAttempt: int32(2)}, headers{attempt: 2}},
		{"attempt int", amqp.Table{HeaderAttempt: 2}, headers{attempt: 2}},
		{"attempt uint8", amqp.Table{HeaderAttempt: uint8(2)}, headers{attempt: 2}},
		{"attempt uint16", amqp.Table{HeaderAttempt: uint16(2)}, headers{attempt: 2}},
		{"attempt uint32 huge", amqp.Table{HeaderAttempt: uint32(math.MaxUint32)}, headers{attempt: max}},
		{"attempt int64 huge", amqp.Table{HeaderAttempt: int64(math.MaxInt64)}, headers{attempt: max}},
		{"attempt negative", amqp.Table{HeaderAttempt: int64(-7)}, headers{}},
		{"attempt most negative", amqp.Table{HeaderAttempt: int64(math.MinInt64)}, headers{}},
		{"attempt as a string", amqp.Table{HeaderAttempt: "3"}, headers{}},
		{"attempt as a float", amqp.Table{HeaderAttempt: 3.0}, headers{}},
		{"attempt as a bool", amqp.Table{HeaderAttempt: true}, headers{}},
		{"attempt void", amqp.Table{HeaderAttempt: nil}, headers{}},
		{"attempt on a dead letter moved back", amqp.Table{HeaderAttempt: int64(5), HeaderError: "boom"},
			headers{deadLetter: true}},
		{"attempt with a void error header", amqp.Table{HeaderAttempt: int64(4), HeaderError: nil}, headers{attempt: 4}},
		{"error header of another type", amqp.Table{HeaderError: int64(1)}, headers{deadLetter: true}},

		{"published", amqp.Table{HeaderTimestampMillis: int64(1_700_000_000_123)}, headers{publishedMs: 1_700_000_000_123}},
		{"published uint32", amqp.Table{HeaderTimestampMillis: uint32(5)}, headers{publishedMs: 5}},
		{"published zero", amqp.Table{HeaderTimestampMillis: int64(0)}, headers{}},
		{"published negative", amqp.Table{HeaderTimestampMillis: int64(-1)}, headers{}},
		{"published as a string", amqp.Table{HeaderTimestampMillis: "1700000000123"}, headers{}},
		{"published as a time", amqp.Table{HeaderTimestampMillis: time.Unix(1, 0)}, headers{}},

		{"pending text", amqp.Table{HeaderDeadLetterPending: "permanent failure: declined"},
			headers{pending: true, pendingText: "permanent failure: declined"}},
		{"pending void", amqp.Table{HeaderDeadLetterPending: nil}, headers{pending: true}},
		{"pending as bytes", amqp.Table{HeaderDeadLetterPending: []byte("permanent failure: x")}, headers{pending: true}},
		{"pending as a number", amqp.Table{HeaderDeadLetterPending: int64(1)}, headers{pending: true}},
		{"pending text too long", amqp.Table{HeaderDeadLetterPending: long},
			headers{pending: true, pendingText: long[:maxHeaderText-3] + "..."}},

		{"expiry", amqp.Table{HeaderExpiresAt: int64(1_700_000_060_000)}, headers{expires: true, expiresAt: 1_700_000_060_000}},
		{"expiry int32", amqp.Table{HeaderExpiresAt: int32(1000)}, headers{expires: true, expiresAt: 1000}},
		{"expiry negative", amqp.Table{HeaderExpiresAt: int64(-5)}, headers{expires: true, expiresAt: -5}},
		{"expiry huge", amqp.Table{HeaderExpiresAt: int64(math.MaxInt64)}, headers{expires: true, expiresAt: math.MaxInt64}},
		{"expiry as a string", amqp.Table{HeaderExpiresAt: "soon"}, headers{}},
		{"expiry as a float", amqp.Table{HeaderExpiresAt: 1e12}, headers{}},

		{"reply tries", amqp.Table{HeaderReplyTries: int64(2)}, headers{replyTries: 2}},
		{"reply tries huge", amqp.Table{HeaderReplyTries: int64(math.MaxInt64)}, headers{replyTries: max}},
		{"reply tries negative", amqp.Table{HeaderReplyTries: int8(-1)}, headers{}},
		{"reply tries as a string", amqp.Table{HeaderReplyTries: "2"}, headers{}},
		{"reply tries kept on a dead letter", amqp.Table{HeaderReplyTries: int64(2), HeaderError: "x"},
			headers{replyTries: 2, deadLetter: true}},

		{"origin", amqp.Table{HeaderOriginalExchange: "orders", HeaderOriginalRoutingKey: "paid"},
			headers{origin: true, exchange: "orders", routingKey: "paid"}},
		{"origin as bytes", amqp.Table{HeaderOriginalExchange: []byte("orders"), HeaderOriginalRoutingKey: []byte("")},
			headers{origin: true, exchange: "orders"}},
		{"origin at the length limit", amqp.Table{HeaderOriginalExchange: short, HeaderOriginalRoutingKey: short},
			headers{origin: true, exchange: short, routingKey: short}},
		{"origin exchange too long", amqp.Table{HeaderOriginalExchange: tooLong, HeaderOriginalRoutingKey: "paid"}, headers{}},
		{"origin routing key too long", amqp.Table{HeaderOriginalExchange: "orders", HeaderOriginalRoutingKey: tooLong}, headers{}},
		{"origin without a routing key", amqp.Table{HeaderOriginalExchange: "orders"}, headers{}},
		{"origin without an exchange", amqp.Table{HeaderOriginalRoutingKey: "paid"}, headers{}},
		{"origin exchange a number", amqp.Table{HeaderOriginalExchange: int64(1), HeaderOriginalRoutingKey: "paid"}, headers{}},

		{"user id", amqp.Table{HeaderUserID: "svc"}, headers{}},
		{"user id at the length limit", amqp.Table{HeaderUserID: short}, headers{}},
		{"user id too long", amqp.Table{HeaderUserID: tooLong}, headers{badUserID: true}},
		{"user id as bytes", amqp.Table{HeaderUserID: []byte("svc")}, headers{badUserID: true}},
		{"user id a number", amqp.Table{HeaderUserID: int64(7)}, headers{badUserID: true}},
		{"user id void", amqp.Table{HeaderUserID: nil}, headers{badUserID: true}},

		{"first seen and original expiration, any value", amqp.Table{HeaderFirstSeen: "not a time", HeaderOriginalExpiration: nil},
			headers{firstSeen: true, originalExpiration: true}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			want := tc.want
			want.parsed = true
			if got := parseHeaders(tc.table, max); !reflect.DeepEqual(got, want) {
				t.Fatalf("parseHeaders(%v):\n got  %+v\n want %+v", tc.table, got, want)
			}
			arrival := arrivalHeaders(tc.table, max)
			if arrival.attempt != want.attempt || arrival.publishedMs != want.publishedMs {
				t.Fatalf("arrivalHeaders(%v): attempt %d publishedMs %d, want %d and %d (as parseHeaders)",
					tc.table, arrival.attempt, arrival.publishedMs, want.attempt, want.publishedMs)
			}
		})
	}
}

// TestHeadersExpired checks the boundary of expired: a message expires at
// the millisecond its header names, and never without the header.
func TestHeadersExpired(t *testing.T) {
	at := time.UnixMilli(1_700_000_060_000)
	h := parseHeaders(amqp.Table{HeaderExpiresAt: at.UnixMilli()}, 5)
	for _, tc := range []struct {
		now  time.Time
		want bool
	}{{at.Add(-time.Millisecond), false}, {at, true}, {at.Add(time.Hour), true}} {
		if got := h.expired(tc.now); got != tc.want {
			t.Errorf("expired at %v: got %v, want %v", tc.now.Sub(at), got, tc.want)
		}
	}
	none := parseHeaders(amqp.Table{HeaderExpiresAt: "1"}, 5)
	if none.expired(time.Unix(1<<40, 0)) {
		t.Error("a message without an integer expiry header expired")
	}
}

// TestFingerprintFormat checks that the payload fingerprint stays the hex
// of the first 16 bytes of the body's SHA-256, the form records already
// stored hold: another form would make every earlier key a conflict.
func TestFingerprintFormat(t *testing.T) {
	for _, body := range []string{"", "x", `{"order":42}`, strings.Repeat("\xff", 1000)} {
		sum := sha256.Sum256([]byte(body))
		if got, want := fingerprint([]byte(body)), hex.EncodeToString(sum[:16]); got != want {
			t.Errorf("fingerprint(%.20q): got %s, want %s", body, got, want)
		}
	}
}

// fuzzKeys are the header names the fuzz target's tables are made of:
// every header amqpidem reads or writes, and two it does not.
var fuzzKeys = []string{
	HeaderAttempt, HeaderError, HeaderDeadLetterPending, HeaderExpiresAt, HeaderTimestampMillis,
	HeaderReplyTries, HeaderOriginalExchange, HeaderOriginalRoutingKey, HeaderUserID, HeaderFirstSeen,
	HeaderOriginalExpiration, HeaderReason, HeaderConsumer, HeaderKey, HeaderEndpoint, "tenant", "x-death",
	HeaderBusy, HeaderSignature,
}

// fuzzTable turns b into a header table: each entry takes a key byte (an
// index into fuzzKeys), a type byte and the value's bytes, so that the
// fuzzer can reach every header with values of every AMQP field type,
// of any size.
func fuzzTable(b []byte) amqp.Table {
	t := amqp.Table{}
	next := func(n int) []byte {
		if n > len(b) {
			n = len(b)
		}
		v := b[:n]
		b = b[n:]
		return v
	}
	num := func(n int) uint64 {
		var buf [8]byte
		copy(buf[8-n:], next(n))
		return binary.BigEndian.Uint64(buf[:])
	}
	for len(b) >= 2 {
		key := fuzzKeys[int(next(1)[0])%len(fuzzKeys)]
		var v any
		switch next(1)[0] % 16 {
		case 0:
			v = nil
		case 1:
			v = num(1)&1 == 1
		case 2:
			v = int8(num(1))
		case 3:
			v = int16(num(2))
		case 4:
			v = int32(num(4))
		case 5:
			v = int64(num(8))
		case 6:
			v = uint8(num(1))
		case 7:
			v = uint16(num(2))
		case 8:
			v = uint32(num(4))
		case 9:
			v = math.Float64frombits(num(8))
		case 10:
			v = float32(math.Float64frombits(num(8)))
		case 11:
			v = string(next(int(num(2) % 600)))
		case 12:
			v = next(int(num(2) % 600))
		case 13:
			v = time.Unix(int64(num(4)), 0)
		case 14:
			v = amqp.Decimal{Scale: uint8(num(1)), Value: int32(num(4))}
		case 15:
			v = int(int64(num(8)))
		}
		t[key] = v
	}
	return t
}

// referenceHeaders is parseHeaders written the plain way, one lookup per
// header, as the fuzz target's model of what the one-pass parser must
// return.
func referenceHeaders(t amqp.Table, maxAttempts int) headers {
	h := headers{parsed: true}
	clamp := func(n int64) int { return int(math.Min(math.Max(float64(n), 0), float64(maxAttempts))) }
	integer := func(v any) (int64, bool) {
		switch v := v.(type) {
		case int, int8, int16, int32, int64, uint8, uint16, uint32:
			return reflect.ValueOf(v).Convert(reflect.TypeFor[int64]()).Int(), true
		}
		return 0, false
	}
	text := func(v any, bytesOK bool) (string, bool) {
		switch v := v.(type) {
		case string:
			return v, len(v) <= maxShortText
		case []byte:
			return string(v), bytesOK && len(v) <= maxShortText
		}
		return "", false
	}
	h.deadLetter = t[HeaderError] != nil
	if n, _ := integer(t[HeaderAttempt]); !h.deadLetter {
		h.attempt = clamp(n)
	}
	if ms, ok := integer(t[HeaderTimestampMillis]); ok && ms > 0 {
		h.publishedMs = ms
	}
	if v, ok := t[HeaderDeadLetterPending]; ok {
		h.pending = true
		if s, ok := v.(string); ok {
			h.pendingText = headerText(s)
		}
	}
	h.expiresAt, h.expires = integer(t[HeaderExpiresAt])
	n, _ := integer(t[HeaderReplyTries])
	h.replyTries = clamp(n)
	n, _ = integer(t[HeaderBusy])
	h.busy = int(math.Min(math.Max(float64(n), 0), maxBusyDoublings))
	ex, exOK := text(t[HeaderOriginalExchange], true)
	rk, rkOK := text(t[HeaderOriginalRoutingKey], true)
	if exOK && rkOK {
		h.origin, h.exchange, h.routingKey = true, ex, rk
	}
	if v, ok := t[HeaderUserID]; ok {
		_, valid := text(v, false)
		h.badUserID = !valid
	}
	_, h.firstSeen = t[HeaderFirstSeen]
	_, h.originalExpiration = t[HeaderOriginalExpiration]
	return h
}

// FuzzParseHeaders checks parseHeaders on tables of any of amqpidem's
// headers with values of any type: it agrees with the plain reference
// and with arrivalHeaders, keeps every count within [0, maxAttempts],
// and the copies made from what it read carry only well-formed
// informational headers and never a later expiry than the message had.
func FuzzParseHeaders(f *testing.F) {
	for _, seed := range [][]byte{
		{},
		{0, 5, 0, 0, 0, 0, 0, 0, 0, 3},    // attempt int64 3
		{0, 5, 0x80, 0, 0, 0, 0, 0, 0, 0}, // attempt most negative
		{0, 5, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1, 11, 0, 4, 'b', 'o', 'o', 'm'}, // huge attempt, error
		{2, 0}, // pending void
		{2, 11, 0, 20, 'p', 'e', 'r', 'm', 'a', 'n', 'e', 'n', 't', ' ', 'f', 'a', 'i', 'l', 'u', 'r', 'e', ':', ' ', 'x'},
		{3, 5, 0, 0, 1, 0x8b, 0xcf, 0xe5, 0x68, 0}, // expires at
		{4, 5, 0, 0, 1, 0x8b, 0xcf, 0xe5, 0x68, 0}, // published
		{5, 2, 0xff}, // reply tries int8 -1
		{6, 11, 0, 3, 'e', 'x', '1', 7, 12, 0, 2, 'r', 'k'}, // origin, routing key as bytes
		{6, 11, 1, 0},                                // exchange string of 256 bytes (truncated input)
		{8, 12, 0, 3, 's', 'v', 'c'},                 // user id as bytes
		{9, 13, 0, 0, 0, 1, 10, 14, 1, 0, 0, 0, 1},   // first seen, original expiration a decimal
		{16, 9, 0, 0, 0, 0, 0, 0, 0, 0, 15, 5, 0, 1}, // x-death, tenant
	} {
		f.Add(seed, uint8(5), "60000")
	}
	f.Fuzz(func(t *testing.T, b []byte, maxAttempts uint8, expiration string) {
		max := int(maxAttempts%20) + 1
		table := fuzzTable(b)
		h := parseHeaders(table, max)
		if want := referenceHeaders(table, max); !reflect.DeepEqual(h, want) {
			t.Fatalf("parseHeaders(%v):\n got  %+v\n want %+v (reference)", table, h, want)
		}
		if a := arrivalHeaders(table, max); a.attempt != h.attempt || a.publishedMs != h.publishedMs {
			t.Fatalf("arrivalHeaders: attempt %d publishedMs %d; parseHeaders: %d, %d", a.attempt, a.publishedMs, h.attempt, h.publishedMs)
		}
		if h.attempt < 0 || h.attempt > max || h.replyTries < 0 || h.replyTries > max || h.publishedMs < 0 ||
			h.busy < 0 || h.busy > maxBusyDoublings {
			t.Fatalf("counts out of range: %+v", h)
		}
		if len(h.pendingText) > maxHeaderText {
			t.Fatalf("pending text of %d bytes", len(h.pendingText))
		}

		now := time.UnixMilli(1_700_000_000_000)
		d := &amqp.Delivery{Headers: table, Exchange: "ex", RoutingKey: "rk", Expiration: expiration}
		// A signature over any table verifies until a signed header or
		// the body changes; a table's own, forged one never does.
		key := []byte("fuzz-signing-key-0123")
		if VerifySignature(key, table, d.Body) == nil {
			t.Fatalf("a forged signature verifies: %v", table)
		}
		signedCopy := maps.Clone(table)
		if signedCopy == nil {
			signedCopy = amqp.Table{}
		}
		signedCopy[HeaderSignature] = signature(key, signedCopy, d.Body)
		if err := VerifySignature(key, signedCopy, d.Body); err != nil {
			t.Fatalf("a table's own signature does not verify: %v", err)
		}
		if VerifySignature(key, signedCopy, []byte("x")) == nil {
			t.Fatalf("a signature verifies another body")
		}
		msg := copyAt(d, &h, amqp.Table{HeaderAttempt: int64(h.attempt + 1)}, now)
		if _, ok := msg.Headers[HeaderBusy]; ok {
			t.Fatalf("a copy carries %s from the delivery", HeaderBusy)
		}
		for _, k := range []string{HeaderOriginalExchange, HeaderOriginalRoutingKey} {
			if s, ok := msg.Headers[k].(string); !ok || len(s) > maxShortText {
				t.Fatalf("copy's %s: %#v", k, msg.Headers[k])
			}
		}
		if v, ok := msg.Headers[HeaderUserID]; ok {
			if s, isString := v.(string); !isString || len(s) > maxShortText {
				t.Fatalf("copy's %s: %#v", HeaderUserID, v)
			}
		}
		for _, k := range append([]string{HeaderError, HeaderConsumer}, brokerHeaders...) {
			if _, ok := msg.Headers[k]; ok {
				t.Fatalf("copy carries %s", k)
			}
		}
		// A message whose expiration RabbitMQ would refuse keeps its
		// expiry header as it is, of whatever type (found by the fuzzer:
		// an int8 one); an integer one never moves later.
		if at, ok := headerInt64(msg.Headers[HeaderExpiresAt]); ok {
			if h.expires && at > h.expiresAt {
				t.Fatalf("copy's expiry %d is later than the message's %d", at, h.expiresAt)
			}
			if ttl, valid := parseExpiration(expiration); valid && at > now.UnixMilli()+ttl {
				t.Fatalf("copy's expiry %d is later than now plus the expiration %s", at, expiration)
			}
		}
		if msg.Expiration != "" {
			t.Fatalf("copy carries an expiration %q", msg.Expiration)
		}
		dl := deadLetterOf(d, &h, amqp.Table{HeaderReason: "permanent failure"})
		if _, ok := dl.Headers[HeaderExpiresAt]; ok || dl.Expiration != "" {
			t.Fatalf("dead letter carries an expiry: %v %q", dl.Headers[HeaderExpiresAt], dl.Expiration)
		}
	})
}
