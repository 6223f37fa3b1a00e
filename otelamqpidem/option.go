package otelamqpidem

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// scopeName is the instrumentation scope of the tracer and the meter.
const scopeName = "github.com/amqpidem/amqpidem/otelamqpidem"

// An Option configures NewTracer, NewMeter, Inject or Extract. Each takes
// the options that concern it and ignores the others.
type Option func(*config)

// config is what the options set; newConfig fills in the defaults.
type config struct {
	tracerProvider trace.TracerProvider
	meterProvider  metric.MeterProvider
	propagator     propagation.TextMapPropagator
	keyAttribute   bool
}

// newConfig applies opts over the defaults: the global TracerProvider,
// MeterProvider and TextMapPropagator, no key attribute.
func newConfig(opts []Option) config {
	var c config
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	if c.tracerProvider == nil {
		c.tracerProvider = otel.GetTracerProvider()
	}
	if c.meterProvider == nil {
		c.meterProvider = otel.GetMeterProvider()
	}
	if c.propagator == nil {
		c.propagator = otel.GetTextMapPropagator()
	}
	return c
}

// WithTracerProvider makes NewTracer start its spans with tp. Default (and
// for nil): otel.GetTracerProvider() at the time NewTracer is called; the
// global provider forwards to one set later with otel.SetTracerProvider.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(c *config) { c.tracerProvider = tp }
}

// WithMeterProvider makes NewMeter create its instruments with mp.
// Default (and for nil): otel.GetMeterProvider() at the time NewMeter is
// called; the global provider forwards to one set later with
// otel.SetMeterProvider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) { c.meterProvider = mp }
}

// WithPropagators makes NewTracer, Inject and Extract read and write trace
// context in message headers with p, such as
// propagation.NewCompositeTextMapPropagator(propagation.TraceContext{},
// propagation.Baggage{}). Default (and for nil):
// otel.GetTextMapPropagator(), which propagates nothing until the program
// calls otel.SetTextMapPropagator.
func WithPropagators(p propagation.TextMapPropagator) Option {
	return func(c *config) { c.propagator = p }
}

// WithKeyAttribute makes the Tracer record each delivery's idempotency key
// (amqpidem.Event.Key) as the span attribute "amqpidem.key". It is off by
// default: a key is whatever Config.Key derives from the message (an
// order number, but just as well an e-mail address or an account number),
// and traces tend to travel further than logs, to exporters and vendors
// with their own retention and access rules. Turn it on when the keys are
// known to be opaque. Under the default Config.Key the key is the message
// id, which the span carries anyway as messaging.message.id.
func WithKeyAttribute() Option {
	return func(c *config) { c.keyAttribute = true }
}
