// Package otelamqpidem traces and measures amqpidem consumers with
// OpenTelemetry: a Tracer (amqpidem.Config.Tracer) that gives every
// delivery a span continuing its producer's trace, a Meter
// (amqpidem.Config.Observer) that records metrics, and Inject, Extract and
// HeaderCarrier to carry W3C trace context in AMQP headers.
//
// It uses only the OpenTelemetry API: the program picks the SDK and the
// exporters. Without options, the Tracer, the Meter, Inject and Extract
// use the global TracerProvider, MeterProvider and TextMapPropagator. The
// global propagator propagates nothing until the program sets one:
//
//	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(
//		propagation.TraceContext{}, propagation.Baggage{}))
//
// # Producer
//
// A producer writes its trace context into the message's headers before
// publishing; the consumer's span then belongs to the producer's trace:
//
//	ctx, span := tracer.Start(ctx, "send orders", trace.WithSpanKind(trace.SpanKindProducer))
//	defer span.End()
//	msg := amqp.Publishing{MessageId: orderID, Headers: amqp.Table{}, Body: body}
//	otelamqpidem.Inject(ctx, msg.Headers)
//	err := pub.Publish(ctx, "", "orders", msg) // an amqpidem.Publisher
//
// # Consumer
//
//	meter, err := otelamqpidem.NewMeter()
//	...
//	cfg := amqpidem.Config{
//		Queue:    "orders",
//		Tracer:   otelamqpidem.NewTracer(),
//		Observer: meter, // or amqpidem.Observers(meter, others...)
//	}
//
// The handler's context holds the span: trace.SpanFromContext(ctx) gives
// it, and spans the handler starts from ctx are its children.
//
// # The span
//
// One span per delivery, of kind Consumer, from the start of the
// delivery's processing (before its key's record is read) to its
// settlement (the ack, the requeue or the dead letter, and the reply),
// as semantic conventions v1.43.0 describe a RabbitMQ "process" span:
//
//   - its parent is the context of the message's last publish, read from
//     its headers with the propagator (a "traceparent" header with the W3C
//     one): the producer's, or for a copy amqpidem published (a requeue, a
//     dead letter moved back) the producer span of that publish. It links
//     to the message's original producer (the creation context: see
//     Copies), and to the last publish when that was another; when the
//     context given to amqpidem already holds a span (a Wrapper called
//     under a request's span), that span is linked. A message without
//     trace headers starts a trace of its own, under the context's span if
//     any.
//   - its name is "process {queue}" (not the whole destination: a topic's
//     routing keys would make too many span names), and
//     messaging.destination.name is "{exchange}:{routing key}:{queue}",
//     leaving out empty parts (the
//     default exchange) and the routing key when it is the queue's name:
//     "process orders-exchange:created:orders".
//   - attributes from the messaging conventions: messaging.system
//     "rabbitmq", messaging.operation.name and messaging.operation.type
//     "process", messaging.destination.name,
//     messaging.rabbitmq.destination.routing_key,
//     messaging.rabbitmq.message.delivery_tag, messaging.message.id,
//     messaging.message.conversation_id (the correlation id),
//     messaging.message.body.size and messaging.client.id (the consumer's
//     Config.ConsumerName), server.address and server.port (the host and
//     port of ConsumerConfig.URL, never its credentials, or with
//     ConsumerConfig.Dial the connection's remote IP address and port; not
//     set for a Wrapper's deliveries: see amqpidem.ServerFromContext).
//   - amqpidem's own (see the Attr constants): amqpidem.queue,
//     amqpidem.outcome, amqpidem.reason, amqpidem.attempt, amqpidem.fence,
//     amqpidem.delay, amqpidem.handler.duration; for a delivery that did
//     something with staged messages (amqpidem.Stage), those of
//     amqpidem.outbox.staged, amqpidem.outbox.published,
//     amqpidem.outbox.republished and amqpidem.outbox.returned that are
//     not zero (amqpidem.Event.Outbox); and amqpidem.key only with
//     WithKeyAttribute (see there why not by default).
//   - the event's error, if any, as an exception event. The status is
//     Error, with error.type set to the reason, for the outcomes that need
//     attention: dead_lettered, abandoned and outbox_given_up. It stays
//     unset for the others, a retry included: retrying is the plan
//     working.
//
// # Copies
//
// Each message amqpidem publishes on a delivery's behalf (a delayed or
// immediate requeue, a dead letter, a reply, a staged message) gets a
// span of kind Producer, child of the delivery's span (StartPublish):
// "publish {exchange}", or "publish {queue}" through the default exchange
// ("publish" alone for a reply), with messaging.operation.name "publish",
// messaging.operation.type "send", messaging.destination.name
// "{exchange}:{routing key}" ("amq.default" for neither),
// messaging.rabbitmq.destination.routing_key, the message's id,
// correlation id and body size, server.address and server.port,
// amqpidem.queue, amqpidem.publish.kind ("requeue", "dead_letter",
// "reply", "outbox", "relay") and for a delayed requeue amqpidem.delay. A publish
// that failed has status Error and the error as an exception event.
//
// Their headers:
//
//   - "traceparent" (the propagator's headers): a requeued copy, a dead
//     letter and a reply carry the context of their producer span,
//     replacing the delivery's: the next delivery of a retried message is
//     a child of the publish of its copy, itself a child of the attempt
//     before, so a message's attempts form a chain in one trace, the time
//     spent in delay queues showing as gaps; a dead letter carries the
//     publish of the delivery that gave up on it, and whoever consumes the
//     dead-letter queue, or moves the message back, continues that trace.
//     A message published without trace context joins, on its second
//     attempt, the trace its first one started.
//   - "x-amqpidem-origin-traceparent" (HeaderOriginPrefix and the
//     propagator's header names): a requeued copy and a dead letter keep
//     there the context of the message's original producer, written on
//     its first copy and carried by every later one (and by a dead letter
//     moved back), so that every attempt's span links to the producer
//     that created the message, however many requeues came between.
//
// The messages a handler stages (amqpidem.Stage) get the trace context of
// the context given to Stage when they are staged: the delivery's span, or
// the span the handler started under it. Inject writes it into their
// headers, over whatever the handler put there under the same names, and
// their record keeps it: every publish of a staged message carries the
// context it was staged under, the publishes of a later delivery (after a
// crash or a failed publish) and `amqpidem outbox redrive` included. The
// producer span of a publish of it links to that context and does not
// replace it (a message staged without a Tracer gets the producer span's).
//
// pgstore's Relay takes the same Tracer (RelayConfig.Tracer) for the rows
// it publishes: each publish gets a producer span, amqpidem.publish.kind
// "relay", linked to the trace context written with the row
// (pgstore.Config.Inject), which the message keeps.
//
// # Metrics
//
// The Meter records the two metrics the messaging semantic conventions
// define that fit a consumer's work under their names,
// messaging.client.consumed.messages and messaging.process.duration,
// with messaging.system, messaging.operation.name and, for a failure,
// error.type; the metrics that are amqpidem's own keep the amqpidem.
// prefix (see Meter for the list).
//
// Breaking change: these two were amqpidem.messages and
// amqpidem.processing.duration. Dashboards, recording rules and alerts on
// the old names (amqpidem_messages_total and
// amqpidem_processing_duration_seconds through a Prometheus exporter)
// stop receiving data: change them to messaging.client.consumed.messages
// and messaging.process.duration (messaging_client_consumed_messages_total
// and messaging_process_duration_seconds), whose series also carry the
// new attributes. promamqpidem's Prometheus metric names are unchanged.
//
// # Limits
//
//   - Time a delivery waits in the consumer before processing starts (the
//     prefetch buffer, a free concurrency slot) is not in its span; it is
//     in amqpidem.end_to_end.duration.
//   - The span ends once the delivery is settled as far as amqpidem sees:
//     a Consumer may fold an ack into a multiple ack sent up to 20 ms
//     later.
//   - A duplicate's span is short (a record read and an ack): the work it
//     duplicates is in the span of the delivery that did it, in the same
//     trace only if the producer published both copies under the same
//     trace context.
//   - Deliveries a stopping Consumer hands back unprocessed get no span;
//     their copies keep the headers they came with.
//   - Trace headers are whatever the publisher wrote: a publisher can
//     attach its messages to any trace, and its baggage reaches the
//     handler's context. Do not make decisions from either.
//   - amqpidem.end_to_end.duration counts from the message's
//     amqpidem.HeaderTimestampMillis header (Publisher sets it), else its
//     AMQP timestamp property, which holds whole seconds: up to a second
//     off for messages from other publishers. It counts from the first
//     publishing, requeue delays included, and depends on the publisher's
//     clock agreeing with the consumer's.
package otelamqpidem
