package operator

import (
	"errors"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// Origins of a dead letter (DeadLetter.Origin): whether its headers are
// proven amqpidem's.
const (
	OriginSigned    = "signed"        // HeaderSignature verifies under the key
	OriginUnsigned  = "unsigned"      // no HeaderSignature
	OriginBad       = "bad signature" // forged, changed, or another key's
	OriginUnchecked = "unchecked"     // signed, but no key to check it with
)

// DeadLetter is one dead letter as the tools report it, read from its
// amqpidem fault headers. Every string in it is whatever a publisher or a
// consumer put in the headers: show it escaped.
type DeadLetter struct {
	Index              int        `json:"index"`
	Key                string     `json:"key"`
	Endpoint           string     `json:"endpoint,omitempty"`
	MessageID          string     `json:"message_id,omitempty"`
	Reason             string     `json:"reason"`
	Error              string     `json:"error"`
	Attempts           int64      `json:"attempts"`
	FirstSeen          *time.Time `json:"first_seen,omitempty"`
	OriginalExchange   string     `json:"original_exchange"`
	OriginalRoutingKey string     `json:"original_routing_key"`
	Consumer           string     `json:"consumer,omitempty"`
	BodyBytes          int        `json:"body_bytes"`
	// Origin says whether the headers above are proven amqpidem's: one
	// of the Origin constants.
	Origin string `json:"origin"`
}

// Describe reads dead letter d, the i-th read, checking its signature
// with key (see Origin).
func Describe(i int, d *amqp.Delivery, key []byte) DeadLetter {
	h := d.Headers
	dl := DeadLetter{Index: i, MessageID: d.MessageId, Reason: Text(h, amqpidem.HeaderReason), Error: Text(h, amqpidem.HeaderError),
		Attempts: Number(h, amqpidem.HeaderAttempt), OriginalExchange: Text(h, amqpidem.HeaderOriginalExchange),
		OriginalRoutingKey: Text(h, amqpidem.HeaderOriginalRoutingKey), Consumer: Text(h, amqpidem.HeaderConsumer),
		BodyBytes: len(d.Body)}
	dl.Endpoint = Text(h, amqpidem.HeaderEndpoint)
	if _, ok := h[amqpidem.HeaderKey]; ok {
		dl.Key = Text(h, amqpidem.HeaderKey)
	} else {
		dl.Key = d.MessageId // a dead letter of an older amqpidem: the default key
	}
	if t, ok := h[amqpidem.HeaderFirstSeen].(time.Time); ok && !t.IsZero() {
		t = t.UTC()
		dl.FirstSeen = &t
	}
	dl.Origin = Origin(key, d)
	return dl
}

// Origin says whether d's headers are proven amqpidem's under key.
func Origin(key []byte, d *amqp.Delivery) string {
	err := amqpidem.VerifySignature(key, d.Headers, d.Body)
	switch {
	case err == nil:
		return OriginSigned
	case errors.Is(err, amqpidem.ErrUnsigned):
		return OriginUnsigned
	case len(key) == 0:
		return OriginUnchecked
	}
	return OriginBad
}

// Text reads a string header ("" when absent or of another type).
func Text(h amqp.Table, name string) string {
	switch v := h[name].(type) {
	case string:
		return v
	case []byte:
		return string(v)
	}
	return ""
}

// Number reads an integer header of any AMQP integer type.
func Number(h amqp.Table, name string) int64 {
	switch v := h[name].(type) {
	case int8:
		return int64(v)
	case int16:
		return int64(v)
	case int32:
		return int64(v)
	case int64:
		return v
	case uint8:
		return int64(v)
	case uint16:
		return int64(v)
	case uint32:
		return int64(v)
	}
	return 0
}
