package promamqpidem

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/model"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// Options configures New. Every zero value is a documented default.
type Options struct {
	// Namespace is the prefix of every metric name. Default "amqpidem".
	Namespace string
	// ConstLabels are added to every metric, such as {"service": "orders"}.
	// Nil: none. They must not be named as a metric's own labels (queue,
	// outcome, reason, op, result, delay_tier).
	ConstLabels prometheus.Labels
	// DurationBuckets are the buckets, in seconds, of the handler and
	// processing duration histograms. Default 5 ms to 5 min:
	// 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300.
	DurationBuckets []float64
	// StoreBuckets are the buckets, in seconds, of the store call duration
	// histogram. Default 0.5 ms to 2.5 s:
	// 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5.
	StoreBuckets []float64
	// EndToEndBuckets are the buckets, in seconds, of the end-to-end
	// duration histogram, which includes requeue delays. Default 10 ms to
	// 1 h: 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300,
	// 900, 3600.
	EndToEndBuckets []float64
}

var (
	defaultDurationBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300}
	defaultStoreBuckets    = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}
	defaultEndToEndBuckets = []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600}
)

// withDefaults is o with every zero value replaced by its default.
func (o Options) withDefaults() Options {
	if o.Namespace == "" {
		o.Namespace = "amqpidem"
	}
	if o.DurationBuckets == nil {
		o.DurationBuckets = defaultDurationBuckets
	}
	if o.StoreBuckets == nil {
		o.StoreBuckets = defaultStoreBuckets
	}
	if o.EndToEndBuckets == nil {
		o.EndToEndBuckets = defaultEndToEndBuckets
	}
	// Copies: neither the caller nor the histograms can change another's.
	o.DurationBuckets = slices.Clone(o.DurationBuckets)
	o.StoreBuckets = slices.Clone(o.StoreBuckets)
	o.EndToEndBuckets = slices.Clone(o.EndToEndBuckets)
	return o
}

// Validate returns an error naming the first field of o that New cannot
// use: buckets that are empty (but not nil) or not strictly increasing, a
// Namespace that does not make classic metric names
// ([a-zA-Z_:][a-zA-Z0-9_:]*), ConstLabels with a name that is not a
// classic label name ([a-zA-Z_][a-zA-Z0-9_]*), is reserved ("__" prefix)
// or is one of the metrics' own labels.
func (o Options) Validate() error {
	o = o.withDefaults()
	for _, b := range []struct {
		field string
		v     []float64
	}{{"DurationBuckets", o.DurationBuckets}, {"StoreBuckets", o.StoreBuckets}, {"EndToEndBuckets", o.EndToEndBuckets}} {
		if len(b.v) == 0 {
			return fmt.Errorf("promamqpidem: Options.%s is empty (nil means the default)", b.field)
		}
		for i := 1; i < len(b.v); i++ {
			if !(b.v[i] > b.v[i-1]) {
				return fmt.Errorf("promamqpidem: Options.%s: %v is not strictly increasing", b.field, b.v)
			}
		}
	}
	// Classic names, which PromQL takes without quotes.
	if !model.LegacyValidation.IsValidMetricName(o.Namespace + "_messages_total") {
		return fmt.Errorf("promamqpidem: Options.Namespace %q: not a metric name prefix ([a-zA-Z_:][a-zA-Z0-9_:]*)", o.Namespace)
	}
	for name := range o.ConstLabels {
		if !model.LegacyValidation.IsValidLabelName(name) {
			return fmt.Errorf("promamqpidem: Options.ConstLabels: %q is not a label name ([a-zA-Z_][a-zA-Z0-9_]*)", name)
		}
	}
	// The rest (reserved names, clashes) as the registry will check them.
	if err := prometheus.NewPedanticRegistry().Register(newMetrics(o)); err != nil {
		return fmt.Errorf("promamqpidem: Options.Namespace %q or Options.ConstLabels: %w", o.Namespace, err)
	}
	return nil
}

// Metrics records what a Consumer or Wrapper does as Prometheus metrics:
// set it as amqpidem.Config.Observer (or as one of amqpidem.Observers) and
// register it, once, on a prometheus.Registerer. It implements
// amqpidem.Observer, amqpidem.HandlerObserver, amqpidem.StoreObserver,
// amqpidem.BatchObserver and prometheus.Collector. One Metrics may observe any number of consumers
// and queues; the queue label tells them apart.
//
// A Metrics is safe for concurrent use; each of its hooks costs a few
// label lookups and atomic adds.
type Metrics struct {
	messages   *prometheus.CounterVec
	handler    *prometheus.HistogramVec
	processing *prometheus.HistogramVec
	endToEnd   *prometheus.HistogramVec
	inFlight   *prometheus.GaugeVec
	storeCalls *prometheus.HistogramVec
	extensions *prometheus.CounterVec
	requeues   *prometheus.CounterVec
	outbox     *prometheus.CounterVec
	batchSize  *prometheus.HistogramVec
	batchTime  *prometheus.HistogramVec
	batchRuns  *prometheus.CounterVec
	oldest     *oldestHandlers
	all        []prometheus.Collector
	now        func() time.Time // time.Now; tests set their own
}

// Interface checks.
var (
	_ amqpidem.HandlerObserver = (*Metrics)(nil)
	_ amqpidem.StoreObserver   = (*Metrics)(nil)
	_ amqpidem.BatchObserver   = (*Metrics)(nil)
	_ prometheus.Collector     = (*Metrics)(nil)
)

// New returns the metrics described in the package documentation, named
// after opts.Namespace. It panics if opts.Validate fails, as the
// prometheus constructors do on invalid options.
func New(opts Options) *Metrics {
	if err := opts.Validate(); err != nil {
		panic(err)
	}
	return newMetrics(opts.withDefaults())
}

// newMetrics is New without the checks; o has its defaults.
func newMetrics(o Options) *Metrics {
	opts := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: o.Namespace, Name: name, Help: help, ConstLabels: o.ConstLabels}
	}
	histogram := func(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: o.Namespace, Name: name, Help: help, ConstLabels: o.ConstLabels, Buckets: buckets,
		}, labels)
	}
	m := &Metrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts(opts("messages_total",
			"Deliveries processed, by outcome (amqpidem.Outcome) and reason (amqpidem.Event.Reason, a fixed string; empty for most completed and duplicate deliveries).")),
			[]string{"queue", "outcome", "reason"}),
		handler: histogram("handler_duration_seconds",
			"How long the handler ran, for deliveries whose handler ran, by outcome.",
			o.DurationBuckets, "queue", "outcome"),
		processing: histogram("processing_duration_seconds",
			"How long a delivery's processing took, store calls, handler, publishes and ack included, by outcome.",
			o.DurationBuckets, "queue", "outcome"),
		endToEnd: histogram("end_to_end_duration_seconds",
			"Time from a message's first publication (its timestamp_in_ms header, else its timestamp property in whole seconds) to the end of its processing, requeue delays included, by outcome.",
			o.EndToEndBuckets, "queue", "outcome"),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("handlers_in_flight",
			"Handlers running now.")),
			[]string{"queue"}),
		storeCalls: histogram("store_call_duration_seconds",
			"Duration of the calls made to the idempotency record store, by operation and result (ok, lost: a lease was no longer held, error).",
			o.StoreBuckets, "queue", "op", "result"),
		extensions: prometheus.NewCounterVec(prometheus.CounterOpts(opts("lease_extensions_total",
			"Lease renewals by the heartbeat, per lease, by result (renewed, lost, error).")),
			[]string{"queue", "result"}),
		requeues: prometheus.NewCounterVec(prometheus.CounterOpts(opts("requeues_total",
			"Delayed requeues (busy, retried and abandoned deliveries sent back after a delay), by outcome and delay tier in seconds (amqpidem.DelayTier).")),
			[]string{"queue", "outcome", "delay_tier"}),
		outbox: prometheus.NewCounterVec(prometheus.CounterOpts(opts("outbox_messages_total",
			"Messages handlers staged (amqpidem.Stage), by result: staged (stored with the handler's outcome), published (published and confirmed, republished included), republished (published by a later delivery than the one that stored it, after a crash or a failed publish), returned (given up after the broker returned or refused it MaxAttempts times).")),
			[]string{"queue", "result"}),
		batchSize: histogram("batch_size",
			"Deliveries in each batch a batch consumer (amqpidem.NewBatchConsumer) ran: those whose handler was to run.",
			BatchSizeBuckets, "queue"),
		batchTime: histogram("batch_duration_seconds",
			"How long each batch took, from the end of its gathering to its records' completion (handler runs, transaction, record writes).",
			o.DurationBuckets, "queue"),
		batchRuns: prometheus.NewCounterVec(prometheus.CounterOpts(opts("batch_handler_runs_total",
			"Calls of batch handlers: above batch_size_count when batch errors split batches or lost leases ran them again.")),
			[]string{"queue"}),
	}
	m.now = time.Now
	m.oldest = &oldestHandlers{m: m, desc: prometheus.NewDesc(prometheus.BuildFQName(o.Namespace, "", "oldest_handler_age_seconds"),
		"Age of the oldest handler running now, 0 when none runs: a handler that does not return (its lease kept alive by the heartbeat) makes it grow.",
		[]string{"queue"}, o.ConstLabels)}
	m.all = []prometheus.Collector{m.messages, m.handler, m.processing, m.endToEnd, m.inFlight, m.storeCalls, m.extensions, m.requeues, m.outbox, m.batchSize, m.batchTime, m.batchRuns, m.oldest}
	return m
}

// Describe sends the descriptors of every metric to ch
// (prometheus.Collector).
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.all {
		c.Describe(ch)
	}
}

// Collect sends the current value of every metric to ch
// (prometheus.Collector).
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.all {
		c.Collect(ch)
	}
}

// Observe records a processed delivery (amqpidem.Observer): its outcome
// and reason, its handler and processing durations, its end-to-end
// duration when it says when it was published, its requeue delay tier
// when it was sent back after a delay, and what it did with staged
// messages (amqpidem.Event.Outbox): each count that is not zero is added
// to outbox_messages_total, so a delivery that staged nothing touches no
// series of it.
func (m *Metrics) Observe(_ context.Context, e amqpidem.Event) {
	outcome := e.Outcome.String()
	m.messages.WithLabelValues(e.Queue, outcome, e.Reason).Inc()
	if e.Handler > 0 {
		m.handler.WithLabelValues(e.Queue, outcome).Observe(e.Handler.Seconds())
	}
	m.processing.WithLabelValues(e.Queue, outcome).Observe(e.Total.Seconds())
	if !e.Published.IsZero() {
		// A publisher's clock ahead of ours would make it negative.
		m.endToEnd.WithLabelValues(e.Queue, outcome).Observe(max(time.Since(e.Published), 0).Seconds())
	}
	if e.Delay > 0 {
		switch e.Outcome {
		case amqpidem.Busy, amqpidem.Retried, amqpidem.Abandoned:
			m.requeues.WithLabelValues(e.Queue, outcome, DelayTierLabel(e.Delay)).Inc()
		}
	}
	if e.Outbox != (amqpidem.OutboxCounts{}) {
		m.observeOutbox(e.Queue, e.Outbox)
	}
}

// observeOutbox adds the counts of o that are above zero to
// outbox_messages_total (a counter cannot go down: a negative count, which
// amqpidem does not report, is left out too).
func (m *Metrics) observeOutbox(queue string, o amqpidem.OutboxCounts) {
	for _, c := range [...]struct {
		result string
		n      int
	}{{"staged", o.Staged}, {"published", o.Published}, {"republished", o.Republished}, {"returned", o.Returned}} {
		if c.n > 0 {
			m.outbox.WithLabelValues(queue, c.result).Add(float64(c.n))
		}
	}
}

// DelayTierLabel is the delay_tier label of a requeue delay d: the delay
// the delay queue makes it wait, amqpidem.DelayTier(d), in seconds, in
// the shortest decimal form ("0.25", "1.5", "30", "300").
func DelayTierLabel(d time.Duration) string {
	return strconv.FormatFloat(amqpidem.DelayTier(d).Seconds(), 'f', -1, 64)
}

// HandlerStarted counts a handler in flight and notes when it started
// (amqpidem.HandlerObserver).
func (m *Metrics) HandlerStarted(ctx context.Context, info amqpidem.Info) {
	m.inFlight.WithLabelValues(info.Queue).Inc()
	m.oldest.started(ctx, info.Queue)
}

// HandlerEnded counts a handler no longer in flight
// (amqpidem.HandlerObserver). ctx must be the one HandlerStarted got, as
// amqpidem's are: it tells the handler from the others running.
func (m *Metrics) HandlerEnded(ctx context.Context, info amqpidem.Info) {
	m.inFlight.WithLabelValues(info.Queue).Dec()
	m.oldest.ended(ctx, info.Queue)
}

// oldestHandlers is the gauge oldest_handler_age_seconds: when each
// running handler started, per queue, each known by its context (which
// HandlerStarted and HandlerEnded both get). A queue seen once keeps its
// series, at 0 when none runs.
type oldestHandlers struct {
	m      *Metrics
	desc   *prometheus.Desc
	queues sync.Map // queue name -> *runningHandlers
}

// runningHandlers are the handlers running on one queue.
type runningHandlers struct {
	mu sync.Mutex
	// byCtx holds when each started; n counts the handlers that share a
	// context (a caller's own hooks may give them one), kept until the
	// last ended, with the first one's start.
	byCtx map[context.Context]handlerStart
}

type handlerStart struct {
	at time.Time
	n  int
}

// running returns queue's handlers, made on first use.
func (o *oldestHandlers) running(queue string) *runningHandlers {
	if r, ok := o.queues.Load(queue); ok {
		return r.(*runningHandlers)
	}
	r, _ := o.queues.LoadOrStore(queue, &runningHandlers{byCtx: make(map[context.Context]handlerStart)})
	return r.(*runningHandlers)
}

// handlerKey is ctx as a map key; a context of a type that cannot be one
// (none of the standard library's, nor amqpidem's) shares the nil key.
func handlerKey(ctx context.Context) context.Context {
	if ctx == nil || !reflect.TypeOf(ctx).Comparable() {
		return nil
	}
	return ctx
}

func (o *oldestHandlers) started(ctx context.Context, queue string) {
	r, k, now := o.running(queue), handlerKey(ctx), o.m.now()
	r.mu.Lock()
	s, ok := r.byCtx[k]
	if !ok {
		s.at = now
	}
	s.n++
	r.byCtx[k] = s
	r.mu.Unlock()
}

func (o *oldestHandlers) ended(ctx context.Context, queue string) {
	r, k := o.running(queue), handlerKey(ctx)
	r.mu.Lock()
	if s, ok := r.byCtx[k]; ok {
		if s.n--; s.n > 0 {
			r.byCtx[k] = s
		} else {
			delete(r.byCtx, k)
		}
	}
	r.mu.Unlock()
}

// Describe implements prometheus.Collector.
func (o *oldestHandlers) Describe(ch chan<- *prometheus.Desc) { ch <- o.desc }

// Collect implements prometheus.Collector: one pass over the handlers
// running, at most the consumers' Concurrency per queue.
func (o *oldestHandlers) Collect(ch chan<- prometheus.Metric) {
	now := o.m.now()
	o.queues.Range(func(q, v any) bool {
		r := v.(*runningHandlers)
		var age time.Duration
		r.mu.Lock()
		for _, s := range r.byCtx {
			age = max(age, now.Sub(s.at))
		}
		r.mu.Unlock()
		ch <- prometheus.MustNewConstMetric(o.desc, prometheus.GaugeValue, age.Seconds(), q.(string))
		return true
	})
}

// ObserveStore records a store call (amqpidem.StoreObserver): its
// duration by operation and result (error when any of its leases failed,
// else lost when any was lost, else ok), and for a heartbeat's "extend"
// its leases by result: StoreCall.Lost lost, StoreCall.Failed error, the
// others renewed.
func (m *Metrics) ObserveStore(_ context.Context, c amqpidem.StoreCall) {
	result := "ok"
	switch {
	case c.Failed > 0 || c.Err != nil:
		result = "error"
	case c.Lost > 0:
		result = "lost"
	}
	m.storeCalls.WithLabelValues(c.Queue, c.Op, result).Observe(c.Duration.Seconds())
	if c.Op != "extend" {
		return
	}
	lost := min(max(c.Lost, 0), c.Leases)
	failed := min(max(c.Failed, 0), c.Leases-lost)
	if renewed := c.Leases - lost - failed; renewed > 0 {
		m.extensions.WithLabelValues(c.Queue, "renewed").Add(float64(renewed))
	}
	if lost > 0 {
		m.extensions.WithLabelValues(c.Queue, "lost").Add(float64(lost))
	}
	if failed > 0 {
		m.extensions.WithLabelValues(c.Queue, "error").Add(float64(failed))
	}
}

// BatchSizeBuckets are the bucket boundaries of batch_size, in deliveries.
var BatchSizeBuckets = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000}

// ObserveBatch records a batch a batch consumer ran
// (amqpidem.BatchObserver): its size, its duration and its handler calls.
func (m *Metrics) ObserveBatch(_ context.Context, b amqpidem.BatchInfo) {
	m.batchSize.WithLabelValues(b.Queue).Observe(float64(b.Size))
	m.batchTime.WithLabelValues(b.Queue).Observe(b.Duration.Seconds())
	if b.Runs > 0 {
		m.batchRuns.WithLabelValues(b.Queue).Add(float64(b.Runs))
	}
}
