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
	// AttrPublishKind is why amqpidem published the message of a producer
	// span: amqpidem.PublishKind's String, "requeue", "dead_letter",
	// "reply" or "outbox".
	AttrPublishKind = attribute.Key("amqpidem.publish.kind")
)

// HeaderOriginPrefix prefixes the names of the headers in which the copies
// amqpidem publishes of a delivery (requeues, dead letters) keep the trace
// context of the message's original producer: with the W3C propagator,
// "x-amqpidem-origin-traceparent" (and "x-amqpidem-origin-tracestate").
// The propagator's own headers ("traceparent") hold the span of the
// publish that made the copy, so that a message's attempts form a chain;
// these keep the first producer's, written on the first copy and carried
// by every later one, so that the span of every attempt links to it.
const HeaderOriginPrefix = "x-amqpidem-origin-"

// operation is the messaging.operation.name of the process span, and
// publishOperation that of a producer span.
const (
	operation        = "process"
	publishOperation = "publish"
)

// Tracer is an amqpidem.Tracer that gives every delivery an OpenTelemetry
// span (see the package documentation for what it covers and carries).
// Set it in amqpidem.Config.Tracer. A Tracer is safe for concurrent use
// and may serve several Consumers and Wrappers.
type Tracer struct {
	tracer       trace.Tracer
	propagator   propagation.TextMapPropagator
	keyAttribute bool
}

var _ amqpidem.PublishTracer = (*Tracer)(nil)

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

// delivery is what End and StartPublish need of what Start saw.
type delivery struct {
	span trace.Span
	// origin is the message's original producer's span: from its
	// HeaderOriginPrefix headers, else its propagator's headers.
	origin trace.SpanContext
}

// originCarrier is a TextMapCarrier over the HeaderOriginPrefix headers.
type originCarrier amqp.Table

func (c originCarrier) Get(key string) string {
	return HeaderCarrier(c).Get(HeaderOriginPrefix + key)
}

func (c originCarrier) Set(key, value string) {
	c[HeaderOriginPrefix+key] = value
}

func (c originCarrier) Keys() []string {
	var keys []string
	for k := range c {
		if name, ok := strings.CutPrefix(k, HeaderOriginPrefix); ok {
			keys = append(keys, name)
		}
	}
	return keys
}

// serverAttributes appends server.address and server.port of the
// delivery of ctx (amqpidem.ServerFromContext), when known.
func serverAttributes(ctx context.Context, attrs []attribute.KeyValue) []attribute.KeyValue {
	s, ok := amqpidem.ServerFromContext(ctx)
	if !ok {
		return attrs
	}
	attrs = append(attrs, semconv.ServerAddress(s.Address))
	if s.Port > 0 {
		attrs = append(attrs, semconv.ServerPort(s.Port))
	}
	return attrs
}

// Start reads the trace context of d's last publisher from d's headers
// and starts a Consumer span "process <queue>" as its child. The span
// links to the message's original producer (its HeaderOriginPrefix
// headers, which amqpidem's copies of it carry, else the last
// publisher's), to the last publisher when that was another (the publish
// of a requeued copy), and to the span of ctx when there is one and the
// message brought another parent. It returns ctx with the span (and the
// message's baggage, with a baggage propagator), which amqpidem gives the
// handler.
func (t *Tracer) Start(ctx context.Context, queue string, d *amqp.Delivery) context.Context {
	ambient := trace.SpanContextFromContext(ctx)
	pctx := t.propagator.Extract(ctx, HeaderCarrier(d.Headers))
	last := trace.SpanContextFromContext(pctx)
	origin := trace.SpanContextFromContext(t.propagator.Extract(context.Background(), originCarrier(d.Headers)))
	switch {
	case !origin.IsValid():
		origin = last
	case !last.IsValid():
		// An origin without a last publisher (headers stripped on the
		// way): the origin is the parent.
		pctx, last = trace.ContextWithRemoteSpanContext(pctx, origin), origin
	}

	var links []trace.Link
	if last.IsValid() && !last.Equal(ambient) {
		// The messaging conventions: a process span links to the message's
		// creation context, even when it is its parent, and to the ambient
		// span that it does not take as parent. The creation context is
		// the original producer's; the publish of a requeued copy is
		// linked too.
		links = append(links, trace.Link{SpanContext: origin})
		if !last.Equal(origin) {
			links = append(links, trace.Link{SpanContext: last})
		}
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
	attrs = serverAttributes(ctx, attrs)

	sctx, span := t.tracer.Start(pctx, spanName(queue),
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attrs...),
		trace.WithLinks(links...),
	)
	return context.WithValue(sctx, spanKey{}, &delivery{span: span, origin: origin})
}

// StartPublish starts a Producer span "publish <destination>", child of
// the span of ctx (the delivery's), for a message amqpidem publishes on a
// delivery's behalf, and writes its trace context into p.Headers:
//
//   - a requeued copy and a dead letter carry the producer span's context
//     in the propagator's headers, replacing the delivery's, and the
//     original producer's in the HeaderOriginPrefix headers;
//   - a reply carries the producer span's context;
//   - a staged message keeps the context it was staged under (Stage wrote
//     it; the span links to it), and gets the producer span's only when
//     it has none (staged without a Tracer).
//
// The span has the messaging conventions' attributes for a publish
// (messaging.operation.name "publish", messaging.operation.type "send",
// messaging.destination.name "{exchange}:{routing key}"), server.address
// and server.port when known, amqpidem.queue, amqpidem.publish.kind and,
// for a delayed requeue, amqpidem.delay. The end it returns ends it, with
// status Error and the error recorded when the publish failed.
func (t *Tracer) StartPublish(ctx context.Context, p amqpidem.Publish) (end func(err error)) {
	var links []trace.Link
	var staged trace.SpanContext
	if p.Kind == amqpidem.PublishOutbox || p.Kind == amqpidem.PublishRelay {
		staged = trace.SpanContextFromContext(t.propagator.Extract(context.Background(), HeaderCarrier(p.Headers)))
		if staged.IsValid() {
			links = append(links, trace.Link{SpanContext: staged})
		}
	}
	dest := publishDestination(p.Exchange, p.RoutingKey)
	attrs := make([]attribute.KeyValue, 0, 14)
	attrs = append(attrs,
		AttrQueue.String(p.Queue),
		AttrPublishKind.String(p.Kind.String()),
		semconv.MessagingSystemRabbitMQ,
		semconv.MessagingOperationName(publishOperation),
		semconv.MessagingOperationTypeSend,
		semconv.MessagingDestinationName(dest),
		semconv.MessagingMessageBodySize(p.BodySize),
	)
	if p.RoutingKey != "" {
		attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(p.RoutingKey))
	}
	if p.MessageID != "" {
		attrs = append(attrs, semconv.MessagingMessageID(p.MessageID))
	}
	if p.CorrelationID != "" {
		attrs = append(attrs, semconv.MessagingMessageConversationID(p.CorrelationID))
	}
	if p.Delay > 0 {
		attrs = append(attrs, AttrDelay.Float64(p.Delay.Seconds()))
	}
	if p.Kind == amqpidem.PublishReply {
		attrs = append(attrs, semconv.MessagingDestinationTemporary(true))
	}
	attrs = serverAttributes(ctx, attrs)
	name := publishSpanName(p)
	sctx, span := t.tracer.Start(ctx, name,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(attrs...),
		trace.WithLinks(links...),
	)
	if p.Headers != nil {
		switch p.Kind {
		case amqpidem.PublishOutbox, amqpidem.PublishRelay:
			if !staged.IsValid() {
				t.propagator.Inject(sctx, HeaderCarrier(p.Headers))
			}
		case amqpidem.PublishRequeue, amqpidem.PublishDeadLetter:
			t.propagator.Inject(sctx, HeaderCarrier(p.Headers))
			if dl, ok := ctx.Value(spanKey{}).(*delivery); ok && dl.origin.IsValid() {
				octx := trace.ContextWithRemoteSpanContext(context.Background(), dl.origin)
				t.propagator.Inject(octx, originCarrier(p.Headers))
			}
		default:
			t.propagator.Inject(sctx, HeaderCarrier(p.Headers))
		}
	}
	return func(err error) {
		if err != nil && span.IsRecording() {
			span.RecordError(err)
			span.SetAttributes(semconv.ErrorTypeOther)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// publishSpanName is "publish {exchange}", or without an exchange (the
// default one) "publish {routing key}", a queue's name: not the whole
// destination, since a topic's routing keys would make too many span
// names. A reply's is "publish" alone: a reply queue's name is the
// client's, often random.
func publishSpanName(p amqpidem.Publish) string {
	switch {
	case p.Kind == amqpidem.PublishReply:
		return publishOperation
	case p.Exchange != "":
		return publishOperation + " " + p.Exchange
	case p.RoutingKey != "":
		return publishOperation + " " + p.RoutingKey
	}
	return publishOperation + " amq.default"
}

// publishDestination is messaging.destination.name on the producer side,
// as semantic conventions v1.43.0 have it for RabbitMQ:
// "{exchange}:{routing key}", the one that is not empty alone, or
// "amq.default" for the default exchange without a routing key.
func publishDestination(exchange, routingKey string) string {
	switch {
	case exchange != "" && routingKey != "":
		return exchange + ":" + routingKey
	case exchange != "":
		return exchange
	case routingKey != "":
		return routingKey
	}
	return "amq.default"
}

// Inject writes the trace context of ctx into headers: amqpidem calls it
// on the headers of each message a handler stages, when it is staged
// (StartPublish, not Inject, handles the copies amqpidem publishes). Its
// method value fits pgstore.Config.Inject. It does nothing when headers
// is nil.
func (t *Tracer) Inject(ctx context.Context, headers amqp.Table) {
	if headers == nil {
		return
	}
	t.propagator.Inject(ctx, HeaderCarrier(headers))
}

// End completes the span Start put in ctx with what became of the delivery
// and ends it: amqpidem's attributes are set; e.Err, if any, is recorded
// as an exception event; and the status is Error, described by e.Err, for
// the outcomes that need attention: dead_lettered, abandoned and
// outbox_given_up. A
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
// message was given up on (dead-lettered), a message it staged was
// (outbox_given_up), or its execution could not finish (abandoned). A retry is the plan working, a busy requeue or a
// dropped duplicate is amqpidem doing its job: their status stays unset.
func failed(o amqpidem.Outcome) bool {
	return o == amqpidem.DeadLettered || o == amqpidem.Abandoned || o == amqpidem.OutboxGivenUp
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
