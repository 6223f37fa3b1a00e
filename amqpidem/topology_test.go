package amqpidem

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// TestDelayQueueNames checks that classic delay queues keep their name and
// quorum ones get another, so that a classic delay queue left from before
// never makes the quorum one's declaration fail.
func TestDelayQueueNames(t *testing.T) {
	tests := []struct {
		queueType string
		want      string
	}{
		{"classic", "orders.delay.1500"},
		{"", "orders.delay.1500"},
		{"quorum", "orders.delayq.1500"},
	}
	for _, tc := range tests {
		if got := delayQueue("orders", tc.queueType, 1500*time.Millisecond); got != tc.want {
			t.Errorf("delayQueue(orders, %q, 1.5s): got %q, want %q", tc.queueType, got, tc.want)
		}
	}
}

// TestDelayQueueArgs checks both kinds of delay queue: classic unchanged,
// quorum with at-least-once dead-lettering and the overflow it requires.
func TestDelayQueueArgs(t *testing.T) {
	classic := amqp.Table{
		"x-message-ttl":             int64(1500),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": "orders",
		"x-expires":                 int64(3000 + 60_000),
		"x-queue-type":              "classic",
	}
	quorum := amqp.Table{
		"x-queue-type":              "quorum",
		"x-message-ttl":             int64(1500),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": "orders",
		"x-dead-letter-strategy":    "at-least-once",
		"x-overflow":                "reject-publish",
	}
	for _, tc := range []struct {
		queueType string
		want      amqp.Table
	}{{"classic", classic}, {"", classic}, {"quorum", quorum}} {
		got := delayQueueArgs("orders", tc.queueType, 1500*time.Millisecond, nil)
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("delayQueueArgs(orders, %q, 1.5s):\n got  %v\n want %v", tc.queueType, got, tc.want)
		}
	}
}

// TestCopyExpiration checks that copies carry no expiration, that
// HeaderExpiresAt records the message's and never moves later, and that
// dead letters carry neither.
func TestCopyExpiration(t *testing.T) {
	t0 := time.UnixMilli(1_700_000_000_000)
	at := t0.UnixMilli() + 60_000
	tests := []struct {
		name    string
		exp     string
		headers amqp.Table
		now     time.Time
		wantAt  any // HeaderExpiresAt on the copy; nil: absent
	}{
		{"first copy records the expiry", "60000", nil, t0, at},
		{"later copy keeps it", "15000", amqp.Table{HeaderExpiresAt: at}, t0.Add(45 * time.Second), at},
		{"back from a delay queue without expiration", "", amqp.Table{HeaderExpiresAt: at}, t0.Add(50 * time.Second), at},
		{"expiry header of another integer type", "", amqp.Table{HeaderExpiresAt: int32(1000)}, time.UnixMilli(400), int64(1000)},
		{"expiration 0", "0", nil, t0, t0.UnixMilli()},
		{"header never extends the expiration", "1000", amqp.Table{HeaderExpiresAt: at}, t0, t0.UnixMilli() + 1000},
		{"header not an integer is replaced", "1000", amqp.Table{HeaderExpiresAt: "soon"}, t0, t0.UnixMilli() + 1000},
		{"no expiration", "", nil, t0, nil},
		{"invalid expiration ignored", "soon", nil, t0, nil},
		{"too large expiration ignored", "4294967296", nil, t0, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := &amqp.Delivery{Expiration: tc.exp, Headers: tc.headers, Body: []byte("x")}
			msg := copyAt(d, ptr(headersOf(d)), amqp.Table{HeaderAttempt: int64(1)}, tc.now)
			if msg.Expiration != "" {
				t.Errorf("copy Expiration: got %q, want none", msg.Expiration)
			}
			if got := msg.Headers[HeaderExpiresAt]; !reflect.DeepEqual(got, tc.wantAt) {
				t.Errorf("copy %s: got %v (%T), want %v (%T)", HeaderExpiresAt, got, got, tc.wantAt, tc.wantAt)
			}
			dl := deadLetterOf(d, ptr(headersOf(d)), amqp.Table{HeaderReason: "permanent failure"})
			if dl.Expiration != "" || dl.Headers[HeaderExpiresAt] != nil {
				t.Errorf("dead letter: Expiration %q, %s %v; want neither", dl.Expiration, HeaderExpiresAt, dl.Headers[HeaderExpiresAt])
			}
			if got, want := dl.Headers[HeaderOriginalExpiration], tc.exp; (want == "" && got != nil) || (want != "" && got != want) {
				t.Errorf("dead letter %s: got %v, want %q", HeaderOriginalExpiration, got, want)
			}
		})
	}
}

// TestCopyOfExpirationOverRequeues follows one message with a 60 s
// expiration through requeues 20 s apart: its expiry stays where it was
// first recorded, and it is expired once that has passed.
func TestCopyOfExpirationOverRequeues(t *testing.T) {
	t0 := time.UnixMilli(1_700_000_000_000)
	d := &amqp.Delivery{Expiration: "60000", Body: []byte("x")}
	var got []any
	var gone []bool
	for i := range 4 {
		now := t0.Add(time.Duration(i) * 20 * time.Second)
		msg := copyAt(d, ptr(headersOf(d)), nil, now)
		got = append(got, msg.Headers[HeaderExpiresAt])
		d = &amqp.Delivery{Headers: msg.Headers, Body: msg.Body}
		h := headersOf(d)
		gone = append(gone, h.expired(now.Add(time.Second)))
	}
	at := t0.UnixMilli() + 60_000
	if want := []any{at, at, at, at}; !reflect.DeepEqual(got, want) {
		t.Errorf("%s of successive copies: got %v, want %v", HeaderExpiresAt, got, want)
	}
	if want := []bool{false, false, false, true}; !reflect.DeepEqual(gone, want) {
		t.Errorf("expired a second after each copy: got %v, want %v", gone, want)
	}
	if got := d.Headers[HeaderOriginalExpiration]; got != "60000" {
		t.Errorf("%s: got %v, want 60000", HeaderOriginalExpiration, got)
	}
}

// TestCopyOfExpirationNow checks copyOf against the clock.
func TestCopyOfExpirationNow(t *testing.T) {
	before := time.Now().UnixMilli()
	msg := copyOf(&amqp.Delivery{Expiration: "5000"}, &headers{parsed: true}, nil)
	after := time.Now().UnixMilli()
	at, ok := msg.Headers[HeaderExpiresAt].(int64)
	if !ok || at < before+5000 || at > after+5000 || msg.Expiration != "" {
		t.Errorf("copyOf: Expiration %q, %s %v; want none and now+5s", msg.Expiration, HeaderExpiresAt, msg.Headers[HeaderExpiresAt])
	}
}

// TestCopyForgedHeaders checks the headers a publisher can set on a first
// delivery: kept when well formed, replaced or dropped otherwise.
func TestCopyForgedHeaders(t *testing.T) {
	long := strings.Repeat("a", 256)
	longest := strings.Repeat("a", 255)
	tests := []struct {
		name         string
		userID       string
		headers      amqp.Table
		wantExchange any
		wantKey      any
		wantUser     any // nil: absent
	}{
		{"none", "", nil, "ex", "rk", nil},
		{"valid kept", "", amqp.Table{HeaderOriginalExchange: "first-ex", HeaderOriginalRoutingKey: "first-rk"}, "first-ex", "first-rk", nil},
		{"255 bytes kept", "", amqp.Table{HeaderOriginalExchange: longest, HeaderOriginalRoutingKey: longest}, longest, longest, nil},
		{"byte arrays kept as strings", "", amqp.Table{HeaderOriginalExchange: []byte("first-ex"), HeaderOriginalRoutingKey: []byte("")}, "first-ex", "", nil},
		{"exchange not a string", "", amqp.Table{HeaderOriginalExchange: int64(7), HeaderOriginalRoutingKey: "first-rk"}, "ex", "rk", nil},
		{"routing key too long", "", amqp.Table{HeaderOriginalExchange: "first-ex", HeaderOriginalRoutingKey: long}, "ex", "rk", nil},
		{"routing key missing", "", amqp.Table{HeaderOriginalExchange: "first-ex"}, "ex", "rk", nil},
		{"routing key a table", "", amqp.Table{HeaderOriginalExchange: "first-ex", HeaderOriginalRoutingKey: amqp.Table{"a": "b"}}, "ex", "rk", nil},
		{"user id from the broker wins", "alice", amqp.Table{HeaderUserID: "mallory"}, "ex", "rk", "alice"},
		{"user id from the broker over a bad header", "alice", amqp.Table{HeaderUserID: int64(1)}, "ex", "rk", "alice"},
		{"user id header kept", "", amqp.Table{HeaderUserID: "alice"}, "ex", "rk", "alice"},
		{"user id header 255 bytes kept", "", amqp.Table{HeaderUserID: longest}, "ex", "rk", longest},
		{"user id header not a string", "", amqp.Table{HeaderUserID: int64(1)}, "ex", "rk", nil},
		{"user id header bytes", "", amqp.Table{HeaderUserID: []byte("alice")}, "ex", "rk", nil},
		{"user id header too long", "", amqp.Table{HeaderUserID: long}, "ex", "rk", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := &amqp.Delivery{Exchange: "ex", RoutingKey: "rk", UserId: tc.userID, Headers: tc.headers}
			for _, msg := range []amqp.Publishing{copyOf(d, ptr(headersOf(d)), nil), deadLetterOf(d, ptr(headersOf(d)), nil)} {
				h := msg.Headers
				if got := h[HeaderOriginalExchange]; !reflect.DeepEqual(got, tc.wantExchange) {
					t.Errorf("%s: got %v (%T), want %v", HeaderOriginalExchange, got, got, tc.wantExchange)
				}
				if got := h[HeaderOriginalRoutingKey]; !reflect.DeepEqual(got, tc.wantKey) {
					t.Errorf("%s: got %v (%T), want %v", HeaderOriginalRoutingKey, got, got, tc.wantKey)
				}
				got, ok := h[HeaderUserID]
				if tc.wantUser == nil && ok || tc.wantUser != nil && got != tc.wantUser {
					t.Errorf("%s: got %v (present %v), want %v", HeaderUserID, got, ok, tc.wantUser)
				}
			}
		})
	}
}

// TestDeclareErrorPreconditionFailed checks that a declaration refused with
// PRECONDITION_FAILED says which queue and what to do, and still wraps the
// broker's error.
func TestDeclareErrorPreconditionFailed(t *testing.T) {
	args := delayQueueArgs("orders", "quorum", time.Second, nil)
	cause := &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'x-queue-type'"}
	err := declareError("orders.delayq.1000", args, fmt.Errorf("wrapped: %w", cause))
	for _, want := range []string{`"orders.delayq.1000"`, "exists with arguments other than those amqpidem declares",
		"x-dead-letter-strategy:at-least-once", "delete the queue", "inequivalent arg"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
		t.Errorf("error %v does not wrap the *amqp.Error", err)
	}

	other := declareError("orders.dlq", nil, &amqp.Error{Code: amqp.AccessRefused, Reason: "ACCESS_REFUSED"})
	if strings.Contains(other.Error(), "delete the queue") || !strings.Contains(other.Error(), `"orders.dlq"`) {
		t.Errorf("error for ACCESS_REFUSED: %q", other)
	}
}

// headersOf parses d's headers as a processor with the default
// MaxAttempts does when d arrives.
func headersOf(d *amqp.Delivery) headers {
	return parseHeaders(d.Headers, DefaultMaxAttempts)
}

// ptr returns a pointer to a copy of v.
func ptr[T any](v T) *T { return &v }
