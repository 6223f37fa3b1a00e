package otelamqpidem

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// Metric attributes. None carries a key or a message id: every one has a
// bounded set of values.
const (
	// AttrOp is the store call (amqpidem.StoreCall.Op): "acquire",
	// "extend", "complete", "fail", "release", "cancel" or "amend", which
	// records what became of staged messages.
	AttrOp = attribute.Key("amqpidem.op")
	// AttrResult is how a store call or a lease extension went: "ok",
	// "lost" or "error" for a call, "renewed", "lost" or "error" for an
	// extension.
	AttrResult = attribute.Key("amqpidem.result")
	// AttrDelayTier is the delay a requeue waits, in seconds: the delay of
	// the delay queue it goes through (amqpidem.DelayTier).
	AttrDelayTier = attribute.Key("amqpidem.delay_tier")
	// AttrOutboxResult is what became of messages handlers staged
	// (amqpidem.Event.Outbox): "staged", "published", "republished" or
	// "returned".
	AttrOutboxResult = attribute.Key("amqpidem.outbox.result")
)

// Metric names (see Meter for their units and attributes): the messaging
// semantic conventions' where they define one, amqpidem's own under
// "amqpidem.".
const (
	// MetricMessages counts processed deliveries: the conventions'
	// messaging.client.consumed.messages (it was amqpidem.messages).
	MetricMessages = "messaging.client.consumed.messages"
	// MetricHandlerDuration is how long handlers ran.
	MetricHandlerDuration = "amqpidem.handler.duration"
	// MetricProcessingDuration is how long processing took, from before
	// the record is read to the settlement: the conventions'
	// messaging.process.duration (it was amqpidem.processing.duration).
	MetricProcessingDuration = "messaging.process.duration"
	// MetricEndToEndDuration is the time from a message's first publishing
	// to the settlement of a delivery of it.
	MetricEndToEndDuration = "amqpidem.end_to_end.duration"
	// MetricHandlersInFlight is how many handlers are running.
	MetricHandlersInFlight = "amqpidem.handlers.in_flight"
	// MetricStoreCallDuration is how long calls to the record store took.
	MetricStoreCallDuration = "amqpidem.store.call.duration"
	// MetricLeaseExtensions counts the leases the heartbeat extended, or
	// tried to.
	MetricLeaseExtensions = "amqpidem.lease.extensions"
	// MetricRequeues counts deliveries sent back after a delay.
	MetricRequeues = "amqpidem.requeues"
	// MetricOutboxMessages counts the messages handlers staged
	// (amqpidem.Stage), by what became of them.
	MetricOutboxMessages = "amqpidem.outbox.messages"
	// MetricBatchSize is the number of deliveries in each batch a batch
	// consumer (amqpidem.NewBatchConsumer) ran.
	MetricBatchSize = "amqpidem.batch.size"
	// MetricBatchDuration is how long each batch took, from the end of
	// its gathering to its records' completion.
	MetricBatchDuration = "amqpidem.batch.duration"
	// MetricBatchHandlerRuns counts calls of batch handlers: above the
	// batches' count when batch errors split them.
	MetricBatchHandlerRuns = "amqpidem.batch.handler.runs"
)

// Histogram bucket boundaries, in seconds, given to the SDK as advice (a
// View can override them).
var (
	// handlerBuckets: the messaging conventions' duration buckets, up to
	// five minutes for long jobs.
	handlerBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 30, 60, 120, 300}
	// endToEndBuckets reach an hour: the time since publishing includes
	// the queue's backlog and every requeue delay.
	endToEndBuckets = []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600}
	// storeBuckets start at half a millisecond: a Redis round trip.
	storeBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}
	// batchSizeBuckets count deliveries, not seconds.
	batchSizeBuckets = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000}
)

// Meter is an amqpidem.Observer that is also a HandlerObserver, a
// StoreObserver and a BatchObserver, recording OpenTelemetry metrics:
//
//	messaging.client.consumed.messages  counter {message}: queue, outcome, reason (+ messaging, error.type)
//	messaging.process.duration     histogram s, from the start of processing to settlement: queue, outcome (+ messaging, error.type)
//	amqpidem.handler.duration      histogram s, of deliveries whose handler ran: queue, outcome
//	amqpidem.end_to_end.duration   histogram s, from first publishing to settlement: queue, outcome
//	amqpidem.handlers.in_flight    up-down counter {handler}: queue
//	amqpidem.store.call.duration   histogram s: queue, op, result (ok, lost, error)
//	amqpidem.lease.extensions      counter {lease}, heartbeat renewals: queue, result (renewed, lost, error)
//	amqpidem.requeues              counter {message}, delayed requeues (busy, retried, abandoned): queue, outcome, delay_tier
//	amqpidem.outbox.messages       counter {message}, staged messages: queue, outbox.result (staged, published, republished, returned)
//	amqpidem.batch.size            histogram {message}, deliveries per batch of a batch consumer: queue
//	amqpidem.batch.duration        histogram s, a batch from its gathering's end to its records' completion: queue
//	amqpidem.batch.handler.runs    counter {call}, batch handler calls (more than the batches when split): queue
//
// The attributes are amqpidem.queue, amqpidem.outcome, amqpidem.reason,
// amqpidem.op, amqpidem.result, amqpidem.delay_tier and
// amqpidem.outbox.result; no key or message id, so that every metric has
// a bounded number of series. The two metrics the messaging semantic
// conventions (v1.43.0) define have their names and the attributes they
// require as well: messaging.system "rabbitmq", messaging.operation.name
// "process" and, for the outcomes that need attention (dead_lettered,
// abandoned, outbox_given_up), error.type, the reason. messaging.destination.name is left
// out: amqpidem.queue names the queue, and the exchange and routing key a
// delivery came through would multiply the series.
//
// Renamed: amqpidem.messages is now messaging.client.consumed.messages,
// and amqpidem.processing.duration messaging.process.duration
// (messaging_client_consumed_messages_total and
// messaging_process_duration_seconds through a Prometheus exporter).
// Dashboards and alerts on the old names see no data until they are
// changed. amqpidem's own metrics, which the conventions do not define,
// keep their amqpidem.* names.
//
// amqpidem.outbox.messages adds up amqpidem.Event.Outbox: "staged", the
// messages a handler staged and had stored with its outcome, counted by
// the delivery whose execution stored them; "published", the staged
// messages a delivery published, each confirmed by the broker;
// "republished", those of the published that an earlier delivery had
// stored but not finished publishing (its process died, or a publish
// failed), so that published minus republished went out with the delivery
// that staged them; "returned", the staged messages given up after the
// broker returned or refused them MaxAttempts times, which stay in their
// record. Publishing is at least once: a message whose confirmed publish
// could not be recorded is published, and counted, again. The messages of
// a delivery whose process died after storing them are not counted as
// staged (that delivery is never observed), only as republished by the
// delivery that publishes them: published can exceed staged. A count of
// zero adds nothing: a delivery that staged and published nothing records
// no data point.
//
// Set it in
// amqpidem.Config.Observer, with amqpidem.Observers to combine it with
// others. A Meter is safe for concurrent use and may serve several
// Consumers and Wrappers: the queue tells them apart.
type Meter struct {
	messages   metric.Int64Counter
	handler    metric.Float64Histogram
	processing metric.Float64Histogram
	endToEnd   metric.Float64Histogram
	inFlight   metric.Int64UpDownCounter
	storeCall  metric.Float64Histogram
	extensions metric.Int64Counter
	requeues   metric.Int64Counter
	outbox     metric.Int64Counter
	batchSize  metric.Int64Histogram
	batchTime  metric.Float64Histogram
	batchRuns  metric.Int64Counter
}

var (
	_ amqpidem.HandlerObserver = (*Meter)(nil)
	_ amqpidem.StoreObserver   = (*Meter)(nil)
	_ amqpidem.BatchObserver   = (*Meter)(nil)
)

// NewMeter returns a Meter whose instruments come from the MeterProvider
// of WithMeterProvider, else otel.GetMeterProvider(). It returns the
// provider's errors creating them.
func NewMeter(opts ...Option) (*Meter, error) {
	c := newConfig(opts)
	mt := c.meterProvider.Meter(scopeName, metric.WithSchemaURL(semconv.SchemaURL))
	var m Meter
	var err, e error
	m.messages, e = mt.Int64Counter(MetricMessages, metric.WithUnit("{message}"),
		metric.WithDescription("Messages delivered to the consumer and processed, by outcome."))
	err = errors.Join(err, e)
	m.handler, e = mt.Float64Histogram(MetricHandlerDuration, metric.WithUnit("s"),
		metric.WithDescription("How long handlers ran, for the deliveries whose handler ran."),
		metric.WithExplicitBucketBoundaries(handlerBuckets...))
	err = errors.Join(err, e)
	m.processing, e = mt.Float64Histogram(MetricProcessingDuration, metric.WithUnit("s"),
		metric.WithDescription("How long a delivery's processing took, from reading its record to its settlement."),
		metric.WithExplicitBucketBoundaries(handlerBuckets...))
	err = errors.Join(err, e)
	m.endToEnd, e = mt.Float64Histogram(MetricEndToEndDuration, metric.WithUnit("s"),
		metric.WithDescription("Time from the message's first publishing to the settlement of this delivery, requeue delays included."),
		metric.WithExplicitBucketBoundaries(endToEndBuckets...))
	err = errors.Join(err, e)
	m.inFlight, e = mt.Int64UpDownCounter(MetricHandlersInFlight, metric.WithUnit("{handler}"),
		metric.WithDescription("Handlers running."))
	err = errors.Join(err, e)
	m.storeCall, e = mt.Float64Histogram(MetricStoreCallDuration, metric.WithUnit("s"),
		metric.WithDescription("How long calls to the record store took."),
		metric.WithExplicitBucketBoundaries(storeBuckets...))
	err = errors.Join(err, e)
	m.extensions, e = mt.Int64Counter(MetricLeaseExtensions, metric.WithUnit("{lease}"),
		metric.WithDescription("Leases the heartbeat tried to extend, by result."))
	err = errors.Join(err, e)
	m.requeues, e = mt.Int64Counter(MetricRequeues, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries sent back to their queue after a delay (busy, retried, abandoned), by delay tier in seconds."))
	err = errors.Join(err, e)
	m.outbox, e = mt.Int64Counter(MetricOutboxMessages, metric.WithUnit("{message}"),
		metric.WithDescription("Messages handlers staged (amqpidem.Stage), by result: staged (stored with the handler's outcome), published (published and confirmed, republished included), republished (published by a later delivery than the one that stored it, after a crash or a failed publish), returned (given up after the broker returned or refused it MaxAttempts times)."))
	err = errors.Join(err, e)
	m.batchSize, e = mt.Int64Histogram(MetricBatchSize, metric.WithUnit("{message}"),
		metric.WithDescription("Deliveries in each batch a batch consumer ran: those whose handler was to run."),
		metric.WithExplicitBucketBoundaries(batchSizeBuckets...))
	err = errors.Join(err, e)
	m.batchTime, e = mt.Float64Histogram(MetricBatchDuration, metric.WithUnit("s"),
		metric.WithDescription("How long each batch took, from the end of its gathering to its records' completion."),
		metric.WithExplicitBucketBoundaries(handlerBuckets...))
	err = errors.Join(err, e)
	m.batchRuns, e = mt.Int64Counter(MetricBatchHandlerRuns, metric.WithUnit("{call}"),
		metric.WithDescription("Calls of batch handlers: above the batches' count when batch errors split them."))
	err = errors.Join(err, e)
	if err != nil {
		return nil, err
	}
	return &m, nil
}

// Observe records e: a message, its processing time, its handler's time
// if it ran, its time since publishing if known (amqpidem.Event.Published;
// a negative one, from clocks that disagree, counts as 0) and, for the
// busy, retried and abandoned outcomes sent back after a delay
// (amqpidem.Event.Delay), a requeue. A copy sent straight back to its
// queue (on shutdown, say) is not counted in amqpidem.requeues. Each
// count of e.Outbox above zero is added to amqpidem.outbox.messages.
func (m *Meter) Observe(ctx context.Context, e amqpidem.Event) {
	queue, outcome := AttrQueue.String(e.Queue), AttrOutcome.String(e.Outcome.String())
	qo := metric.WithAttributeSet(attribute.NewSet(queue, outcome))
	conv := []attribute.KeyValue{semconv.MessagingSystemRabbitMQ, semconv.MessagingOperationName(operation), queue, outcome}
	if failed(e.Outcome) {
		conv = append(conv, errorType(e))
	}
	m.processing.Record(ctx, e.Total.Seconds(), metric.WithAttributes(conv...))
	m.messages.Add(ctx, 1, metric.WithAttributes(append(conv, AttrReason.String(e.Reason))...))
	if e.Handler > 0 {
		m.handler.Record(ctx, e.Handler.Seconds(), qo)
	}
	if !e.Published.IsZero() {
		m.endToEnd.Record(ctx, max(time.Since(e.Published), 0).Seconds(), qo)
	}
	if e.Delay > 0 {
		switch e.Outcome {
		case amqpidem.Busy, amqpidem.Retried, amqpidem.Abandoned:
			tier := AttrDelayTier.Float64(amqpidem.DelayTier(e.Delay).Seconds())
			m.requeues.Add(ctx, 1, metric.WithAttributes(queue, outcome, tier))
		}
	}
	if e.Outbox != (amqpidem.OutboxCounts{}) {
		m.observeOutbox(ctx, queue, e.Outbox)
	}
}

// observeOutbox adds the counts of o that are above zero to
// amqpidem.outbox.messages (a counter does not go down: a negative count,
// which amqpidem does not report, is left out too).
func (m *Meter) observeOutbox(ctx context.Context, queue attribute.KeyValue, o amqpidem.OutboxCounts) {
	for _, c := range [...]struct {
		result string
		n      int
	}{{"staged", o.Staged}, {"published", o.Published}, {"republished", o.Republished}, {"returned", o.Returned}} {
		if c.n > 0 {
			m.outbox.Add(ctx, int64(c.n), metric.WithAttributes(queue, AttrOutboxResult.String(c.result)))
		}
	}
}

// HandlerStarted counts a handler in flight.
func (m *Meter) HandlerStarted(ctx context.Context, info amqpidem.Info) {
	m.inFlight.Add(ctx, 1, metric.WithAttributes(AttrQueue.String(info.Queue)))
}

// HandlerEnded counts a handler out of flight.
func (m *Meter) HandlerEnded(ctx context.Context, info amqpidem.Info) {
	m.inFlight.Add(ctx, -1, metric.WithAttributes(AttrQueue.String(info.Queue)))
}

// ObserveStore records c's duration, with result "error" when the store
// did not answer (c.Err), else "lost" when it reported a lease lost, else
// "ok". An extend, the heartbeat's renewal of every held lease in one
// call, also counts each lease in amqpidem.lease.extensions: as "lost",
// "error" (c.Failed) or "renewed".
func (m *Meter) ObserveStore(ctx context.Context, c amqpidem.StoreCall) {
	queue := AttrQueue.String(c.Queue)
	result := "ok"
	switch {
	case c.Err != nil:
		result = "error"
	case c.Lost > 0:
		result = "lost"
	}
	m.storeCall.Record(ctx, c.Duration.Seconds(), metric.WithAttributes(queue, AttrOp.String(c.Op), AttrResult.String(result)))
	if c.Op != "extend" {
		return
	}
	lost := min(max(c.Lost, 0), c.Leases)
	failed := min(max(c.Failed, 0), c.Leases-lost)
	for _, n := range []struct {
		result string
		count  int
	}{{"lost", lost}, {"error", failed}, {"renewed", c.Leases - lost - failed}} {
		if n.count > 0 {
			m.extensions.Add(ctx, int64(n.count), metric.WithAttributes(queue, AttrResult.String(n.result)))
		}
	}
}

// ObserveBatch records a batch a batch consumer ran
// (amqpidem.BatchObserver): its size, its duration and its handler calls.
func (m *Meter) ObserveBatch(ctx context.Context, b amqpidem.BatchInfo) {
	queue := metric.WithAttributes(AttrQueue.String(b.Queue))
	m.batchSize.Record(ctx, int64(b.Size), queue)
	m.batchTime.Record(ctx, b.Duration.Seconds(), queue)
	if b.Runs > 0 {
		m.batchRuns.Add(ctx, int64(b.Runs), queue)
	}
}
