package otelamqpidem

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
)

// HeaderCarrier adapts the headers of an AMQP message to
// propagation.TextMapCarrier, so that a propagator can read the trace
// context of a delivery (amqp.Delivery.Headers) and write it into a
// message to publish (amqp.Publishing.Headers):
//
//	otel.GetTextMapPropagator().Inject(ctx, otelamqpidem.HeaderCarrier(msg.Headers))
//
// Header names are case-sensitive in AMQP: "traceparent" is looked up as
// it is written. Set on a nil HeaderCarrier panics, like a write to a nil
// map; Get and Keys do not.
type HeaderCarrier amqp.Table

var _ propagation.TextMapCarrier = HeaderCarrier(nil)

// Get returns the header key as text: a string as it is, a byte array
// (how some clients send text headers) converted, anything else, or a
// missing header, as "".
func (c HeaderCarrier) Get(key string) string {
	switch v := c[key].(type) {
	case string:
		return v
	case []byte:
		return string(v)
	}
	return ""
}

// Set stores value under key, as a string.
func (c HeaderCarrier) Set(key, value string) {
	c[key] = value
}

// Keys returns the names of all the headers, in no particular order.
func (c HeaderCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// Inject writes the trace context of ctx (the span in it, and with a
// baggage propagator its baggage) into headers, for a producer to call on
// a Publishing's Headers before amqpidem.Publisher.Publish, so that the
// consumer's span continues the producer's trace:
//
//	msg := amqp.Publishing{MessageId: orderID, Headers: amqp.Table{}, Body: body}
//	otelamqpidem.Inject(ctx, msg.Headers)
//	err := pub.Publish(ctx, "orders", "created", msg)
//
// It uses the propagator of WithPropagators, else
// otel.GetTextMapPropagator() (which writes nothing until the program sets
// one). Headers it writes replace headers of the same name. headers must
// be a table to write into: Inject does nothing when it is nil.
func Inject(ctx context.Context, headers amqp.Table, opts ...Option) {
	if headers == nil {
		return
	}
	newConfig(opts).propagator.Inject(ctx, HeaderCarrier(headers))
}

// Extract returns ctx with the trace context read from headers (the remote
// span context of the message's producer, and with a baggage propagator
// its baggage), for code that consumes without a Tracer. It uses the
// propagator of WithPropagators, else otel.GetTextMapPropagator(). Without
// trace headers, it returns ctx as it is.
func Extract(ctx context.Context, headers amqp.Table, opts ...Option) context.Context {
	return newConfig(opts).propagator.Extract(ctx, HeaderCarrier(headers))
}
