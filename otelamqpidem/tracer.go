package otelamqpidem

import (
	"context"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// Span attributes amqpidem adds to the messaging conventions' own.
const (
	// AttrQueue is the queue the delivery was consumed from (Config.Queue).
	AttrQueue = attribute.Key("amqpidem.queue")
	// AttrOutcome is what became of the delivery: amqpidem.Outcome's
	// String, such as "completed" or "dead_lettered".
	AttrOutcome = attribute.Key("amqpidem.outcome")
	// AttrReason says why, for every outcome but completed and duplicate
	// (amqpidem.Event.Reason, such as "attempts exhausted").
	AttrReason = attribute.Key("amqpidem.reason")
	// AttrAttempt counts the executions of the key, this one included
	// (amqpidem.Event.Attempt); absent without a key.
	AttrAttempt = attribute.Key("amqpidem.attempt")
	// AttrFence is the lease's fencing token, or the key's latest
	// (amqpidem.Event.Fence); absent without a key.
	AttrFence = attribute.Key("amqpidem.fence")
	// AttrDelay is the requeue delay in seconds, for the busy, retried and
	// abandoned outcomes that have one (amqpidem.Event.Delay).
	AttrDelay = attribute.Key("amqpidem.delay")
	// AttrHandlerDuration is how long the handler ran, in seconds; absent
	// when it did not run (amqpidem.Event.Handler).
	AttrHandlerDuration = attribute.Key("amqpidem.handler.duration")
	// AttrOutboxStaged is how many messages the handler staged and had
	// stored with its outcome (amqpidem.OutboxCounts.Staged); absent when
	// none.
	AttrOutboxStaged = attribute.Key("amqpidem.outbox.staged")
	// AttrOutboxPublished is how many staged messages the delivery
	// published, confirmed (amqpidem.OutboxCounts.Published); absent when
	// none.
	AttrOutboxPublished = attribute.Key("amqpidem.outbox.published")
	// AttrOutboxRepublished is how many of those an earlier delivery had
	// stored but not finished publishing (amqpidem.OutboxCounts.Republished);
	// absent when none.
	AttrOutboxRepublished = attribute.Key("amqpidem.outbox.republished")
	// AttrOutboxReturned is how many staged messages the delivery gave up
	// on, returned or refused by the broker MaxAttempts times
	// (amqpidem.OutboxCounts.Returned); absent when none.
	AttrOutboxReturned = attribute.Key("amqpidem.outbox.returned")
	// AttrKey is the idempotency key, only with WithKeyAttribute.
	AttrKey = attribute.Key("amqpidem.key")
)

// operation is the messaging.operation.name of the span.
const operation = "process"

// Tracer is an amqpidem.Tracer that gives every delivery an OpenTelemetry
// span (see the package documentation for what it covers and carries).
// Set it in amqpidem.Config.Tracer. A Tracer is safe for concurrent use
// and may serve several Consumers and Wrappers.
type Tracer struct {
	tracer       trace.Tracer
	propagator   propagation.TextMapPropagator
	keyAttribute bool
}

var _ amqpidem.Tracer = (*Tracer)(nil)

// NewTracer returns a Tracer. Options: WithTracerProvider and
// WithPropagators (defaults: the global ones), WithKeyAttribute (default
// off).
func NewTracer(opts ...Option) *Tracer {
	c := newConfig(opts)
	return &Tracer{
		tracer:       c.tracerProvider.Tracer(scopeName, trace.WithSchemaURL(semconv.SchemaURL)),
		propagator:   c.propagator,
		keyAttribute: c.keyAttribute,
	}
}

// spanKey is the context key of the *delivery Start made.
type spanKey struct{}

// delivery is what End needs of what Start saw.
type delivery struct {
	span trace.Span
}

// Start reads the producer's trace context from d's headers and starts a
// Consumer span "process <destination>" as its child, linked to it as
// well, and to the span of ctx when there is one and the message brought
// another parent. It returns ctx with the span (and the message's
// baggage, with a baggage propagator), which amqpidem gives the handler.
func (t *Tracer) Start(ctx context.Context, queue string, d *amqp.Delivery) context.Context {
	ambient := trace.SpanContextFromContext(ctx)
	pctx := t.propagator.Extract(ctx, HeaderCarrier(d.Headers))
	creation := trace.SpanContextFromContext(pctx)

	var links []trace.Link
	if creation.IsValid() && !creation.Equal(ambient) {
		// The messaging conventions: a process span links to the message's
		// creation context, even when it is its parent, and to the ambient
		// span that it does not take as parent.
		links = append(links, trace.Link{SpanContext: creation})
		if ambient.IsValid() {
			links = append(links, trace.Link{SpanContext: ambient})
		}
	}

	dest := destination(d.Exchange, d.RoutingKey, queue)
	attrs := make([]attribute.KeyValue, 0, 10)
	attrs = append(attrs,
		AttrQueue.String(queue),
		semconv.MessagingSystemRabbitMQ,
		semconv.MessagingOperationName(operation),
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingDestinationName(dest),
		semconv.MessagingMessageBodySize(len(d.Body)),
	)
	if d.RoutingKey != "" {
		attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(d.RoutingKey))
	}
	if d.DeliveryTag != 0 {
		attrs = append(attrs, semconv.MessagingRabbitMQMessageDeliveryTag(int(d.DeliveryTag)))
	}
	if d.MessageId != "" {
		attrs = append(attrs, semconv.MessagingMessageID(d.MessageId))
	}
	if d.CorrelationId != "" {
		attrs = append(attrs, semconv.MessagingMessageConversationID(d.CorrelationId))
	}

	sctx, span := t.tracer.Start(pctx, spanName(queue),
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attrs...),
		trace.WithLinks(links...),
	)
	return context.WithValue(sctx, spanKey{}, &delivery{span: span})
}

// Inject writes the trace context of ctx, the delivery's span, into
// headers, the headers of a copy amqpidem publishes (a requeue, a dead
// letter, a reply), replacing the producer's: whoever takes the copy
// continues the trace from this delivery's span. It does nothing when
// headers is nil.
func (t *Tracer) Inject(ctx context.Context, headers amqp.Table) {
	if headers == nil {
		return
	}
	t.propagator.Inject(ctx, HeaderCarrier(headers))
}

// End completes the span Start put in ctx with what became of the delivery
// and ends it: amqpidem's attributes are set; e.Err, if any, is recorded
// as an exception event; and the status is Error, described by e.Err, for
// the outcomes that need attention: dead_lettered and abandoned. A
// context without a span from Start (Start panicked) ends nothing.
func (t *Tracer) End(ctx context.Context, e amqpidem.Event) {
	dl, ok := ctx.Value(spanKey{}).(*delivery)
	if !ok {
		return
	}
	span := dl.span
	defer span.End()
	if !span.IsRecording() {
		return
	}
	attrs := make([]attribute.KeyValue, 0, 10)
	attrs = append(attrs, AttrOutcome.String(e.Outcome.String()))
	if e.Consumer != "" {
		attrs = append(attrs, semconv.MessagingClientID(e.Consumer))
	}
	if e.Reason != "" {
		attrs = append(attrs, AttrReason.String(e.Reason))
	}
	if e.Attempt != 0 {
		attrs = append(attrs, AttrAttempt.Int(e.Attempt))
	}
	if e.Fence != 0 {
		attrs = append(attrs, AttrFence.Int64(e.Fence))
	}
	if e.Delay > 0 {
		attrs = append(attrs, AttrDelay.Float64(e.Delay.Seconds()))
	}
	if e.Handler > 0 {
		attrs = append(attrs, AttrHandlerDuration.Float64(e.Handler.Seconds()))
	}
	if o := e.Outbox; o != (amqpidem.OutboxCounts{}) {
		attrs = appendOutbox(attrs, o)
	}
	if t.keyAttribute && e.Key != "" {
		attrs = append(attrs, AttrKey.String(e.Key))
	}
	if failed(e.Outcome) {
		attrs = append(attrs, errorType(e))
	}
	span.SetAttributes(attrs...)
	if e.Err != nil {
		span.RecordError(e.Err)
	}
	if failed(e.Outcome) {
		desc := e.Reason
		if e.Err != nil {
			desc = e.Err.Error()
		}
		span.SetStatus(codes.Error, desc)
	}
}

// appendOutbox appends to attrs the counts of o that are above zero.
func appendOutbox(attrs []attribute.KeyValue, o amqpidem.OutboxCounts) []attribute.KeyValue {
	for _, c := range [...]struct {
		key attribute.Key
		n   int
	}{{AttrOutboxStaged, o.Staged}, {AttrOutboxPublished, o.Published}, {AttrOutboxRepublished, o.Republished}, {AttrOutboxReturned, o.Returned}} {
		if c.n > 0 {
			attrs = append(attrs, c.key.Int(c.n))
		}
	}
	return attrs
}

// failed reports whether o is an outcome whose span has status Error: the
// message was given up on (dead-lettered) or its execution could not
// finish (abandoned). A retry is the plan working, a busy requeue or a
// dropped duplicate is amqpidem doing its job: their status stays unset.
func failed(o amqpidem.Outcome) bool {
	return o == amqpidem.DeadLettered || o == amqpidem.Abandoned
}

// errorType is the error.type attribute of a failed span: the reason (a
// fixed set of phrases, so low in cardinality), or "_OTHER" without one.
func errorType(e amqpidem.Event) attribute.KeyValue {
	if e.Reason == "" {
		return semconv.ErrorTypeOther
	}
	return semconv.ErrorTypeKey.String(e.Reason)
}

// destination is messaging.destination.name on the consumer side, as
// semantic conventions v1.43.0 have it for RabbitMQ:
// "{exchange}:{routing key}:{queue}", leaving out the empty ones (the
// default exchange is "") and the routing key when it is the queue's name.
func destination(exchange, routingKey, queue string) string {
	parts := make([]string, 0, 3)
	if exchange != "" {
		parts = append(parts, exchange)
	}
	if routingKey != "" && routingKey != queue {
		parts = append(parts, routingKey)
	}
	if queue != "" {
		parts = append(parts, queue)
	}
	return strings.Join(parts, ":")
}

// spanName is "{messaging.operation.name} {queue}", or the operation alone
// without a queue. The queue, not the whole destination: a routing key
// (a topic's, say) can take many values, and span names should not.
func spanName(queue string) string {
	if queue == "" {
		return operation
	}
	return operation + " " + queue
}
