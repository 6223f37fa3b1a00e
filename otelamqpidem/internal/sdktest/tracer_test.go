package sdktest_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/otelamqpidem"
)

// newTracer returns a Tracer recording into the returned SpanRecorder,
// propagating W3C trace context, and the provider it uses.
func newTracer(t *testing.T, opts ...otelamqpidem.Option) (*otelamqpidem.Tracer, *tracetest.SpanRecorder, *sdktrace.TracerProvider) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	opts = append([]otelamqpidem.Option{
		otelamqpidem.WithTracerProvider(tp),
		otelamqpidem.WithPropagators(propagation.TraceContext{}),
	}, opts...)
	return otelamqpidem.NewTracer(opts...), rec, tp
}

// attrs returns a span's attributes by key.
func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := make(map[attribute.Key]attribute.Value)
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// only returns the one span rec ended.
func only(t *testing.T, rec *tracetest.SpanRecorder) sdktrace.ReadOnlySpan {
	t.Helper()
	spans := rec.Ended()
	if len(spans) != 1 {
		t.Fatalf("got %d ended spans, want 1", len(spans))
	}
	return spans[0]
}

// delivery is a delivery whose headers carry the producer's trace context.
func delivery(t *testing.T) *amqp.Delivery {
	t.Helper()
	h := amqp.Table{"tenant": "acme"}
	otelamqpidem.Inject(producerContext(), h, otelamqpidem.WithPropagators(propagation.TraceContext{}))
	return &amqp.Delivery{
		Headers:       h,
		Exchange:      "orders",
		RoutingKey:    "created",
		DeliveryTag:   42,
		MessageId:     "order-1",
		CorrelationId: "conv-1",
		Body:          []byte("pay 10"),
	}
}

func TestTracerSpan(t *testing.T) {
	tr, rec, _ := newTracer(t)
	ctx := tr.Start(context.Background(), "orders-q", delivery(t))

	sc := trace.SpanContextFromContext(ctx)
	if got, want := sc.TraceID(), traceID; got != want {
		t.Fatalf("span's trace id: got %v, want the producer's %v", got, want)
	}
	started := rec.Started()
	if len(started) != 1 {
		t.Fatalf("got %d started spans, want 1", len(started))
	}
	if got, want := started[0].Name(), "process orders-q"; got != want {
		t.Fatalf("name at start: got %q, want %q", got, want)
	}
	if got, want := attrs(started[0])["messaging.destination.name"].AsString(), "orders:created:orders-q"; got != want {
		t.Fatalf("destination at start: got %q, want %q", got, want)
	}

	tr.End(ctx, amqpidem.Event{
		Queue: "orders-q", Consumer: "host/1", Key: "order-1", Outcome: amqpidem.Completed,
		Attempt: 2, Fence: 7, Handler: 1500 * time.Millisecond, Total: 2 * time.Second,
	})
	s := only(t, rec)
	if got, want := s.Name(), "process orders-q"; got != want {
		t.Fatalf("name: got %q, want %q", got, want)
	}
	if got, want := s.SpanKind(), trace.SpanKindConsumer; got != want {
		t.Fatalf("kind: got %v, want %v", got, want)
	}
	if got, want := s.Parent().SpanID(), spanID; got != want {
		t.Fatalf("parent: got %v, want the producer's span %v", got, want)
	}
	if !s.Parent().IsRemote() {
		t.Fatal("parent is not the remote producer's span")
	}
	if got, want := len(s.Links()), 1; got != want {
		t.Fatalf("links: got %d, want %d", got, want)
	}
	if got, want := s.Links()[0].SpanContext.SpanID(), spanID; got != want {
		t.Fatalf("link: got %v, want the creation context %v", got, want)
	}
	if got, want := s.Status().Code, codes.Unset; got != want {
		t.Fatalf("status: got %v, want %v", got, want)
	}
	if got, want := len(s.Events()), 0; got != want {
		t.Fatalf("events: got %d, want %d", got, want)
	}
	a := attrs(s)
	for k, want := range map[attribute.Key]any{
		"messaging.system":                           "rabbitmq",
		"messaging.operation.name":                   "process",
		"messaging.operation.type":                   "process",
		"messaging.destination.name":                 "orders:created:orders-q",
		"messaging.rabbitmq.destination.routing_key": "created",
		"messaging.rabbitmq.message.delivery_tag":    int64(42),
		"messaging.message.id":                       "order-1",
		"messaging.message.conversation_id":          "conv-1",
		"messaging.message.body.size":                int64(6),
		"messaging.client.id":                        "host/1",
		"amqpidem.queue":                             "orders-q",
		"amqpidem.outcome":                           "completed",
		"amqpidem.attempt":                           int64(2),
		"amqpidem.fence":                             int64(7),
		"amqpidem.handler.duration":                  1.5,
	} {
		v, ok := a[k]
		if !ok {
			t.Errorf("attribute %s missing", k)
			continue
		}
		if got := v.AsInterface(); got != want {
			t.Errorf("attribute %s: got %#v, want %#v", k, got, want)
		}
	}
	for _, k := range []attribute.Key{"amqpidem.key", "amqpidem.reason", "amqpidem.delay", "error.type"} {
		if v, ok := a[k]; ok {
			t.Errorf("attribute %s: got %v, want none", k, v.Emit())
		}
	}
}

func TestTracerDestination(t *testing.T) {
	for _, tc := range []struct {
		exchange, routingKey, queue string
		atEnd                       string
	}{
		{"orders", "created", "q", "process orders:created:q"},
		{"", "q", "q", "process q"}, // default exchange: a copy, or a publish to the queue
		{"fanout", "", "q", "process fanout:q"},
		{"orders", "q", "q", "process orders:q"},
		{"", "", "q", "process q"},
	} {
		tr, rec, _ := newTracer(t)
		ctx := tr.Start(context.Background(), tc.queue, &amqp.Delivery{Exchange: tc.exchange, RoutingKey: tc.routingKey})
		tr.End(ctx, amqpidem.Event{Queue: tc.queue, Outcome: amqpidem.Completed})
		s := only(t, rec)
		if got, want := s.Name(), "process "+tc.queue; got != want {
			t.Errorf("%q %q %q: span name %q, want %q", tc.exchange, tc.routingKey, tc.queue, got, want)
		}
		if got, want := "process "+attrs(s)["messaging.destination.name"].AsString(), tc.atEnd; got != want {
			t.Errorf("%q %q %q destination: got %q, want %q", tc.exchange, tc.routingKey, tc.queue, got, want)
		}
	}
}

func TestTracerOutcomeStatus(t *testing.T) {
	boom := errors.New("card declined")
	for _, tc := range []struct {
		outcome   amqpidem.Outcome
		reason    string
		err       error
		status    codes.Code
		exception bool
		errorType string
	}{
		{amqpidem.Completed, "", nil, codes.Unset, false, ""},
		{amqpidem.Completed, "", boom, codes.Unset, true, ""}, // a reply dropped, say
		{amqpidem.Duplicate, "", nil, codes.Unset, false, ""},
		{amqpidem.Busy, "in progress elsewhere", nil, codes.Unset, false, ""},
		{amqpidem.Retried, "handler error", boom, codes.Unset, true, ""},
		{amqpidem.Dropped, "failed duplicate", boom, codes.Unset, true, ""},
		{amqpidem.DeadLettered, "permanent failure", boom, codes.Error, true, "permanent failure"},
		{amqpidem.Abandoned, "lease lost", boom, codes.Error, true, "lease lost"},
		{amqpidem.Abandoned, "", nil, codes.Error, false, "_OTHER"},
		{amqpidem.OutboxGivenUp, "staged message given up", boom, codes.Error, true, "staged message given up"},
	} {
		tr, rec, _ := newTracer(t)
		ctx := tr.Start(context.Background(), "q", delivery(t))
		tr.End(ctx, amqpidem.Event{Queue: "q", Outcome: tc.outcome, Reason: tc.reason, Err: tc.err, Delay: time.Second})
		s := only(t, rec)
		if got := s.Status().Code; got != tc.status {
			t.Errorf("%v: status: got %v, want %v", tc.outcome, got, tc.status)
		}
		if tc.status == codes.Error {
			want := tc.reason
			if tc.err != nil {
				want = tc.err.Error()
			}
			if got := s.Status().Description; got != want {
				t.Errorf("%v: status description: got %q, want %q", tc.outcome, got, want)
			}
		}
		if got := len(s.Events()) == 1 && s.Events()[0].Name == "exception"; got != tc.exception {
			t.Errorf("%v: exception event: got %v, want %v (events %v)", tc.outcome, got, tc.exception, s.Events())
		}
		a := attrs(s)
		if got := a["error.type"].AsString(); got != tc.errorType {
			t.Errorf("%v: error.type: got %q, want %q", tc.outcome, got, tc.errorType)
		}
		if got, want := a["amqpidem.outcome"].AsString(), tc.outcome.String(); got != want {
			t.Errorf("%v: amqpidem.outcome: got %q, want %q", tc.outcome, got, want)
		}
		if got := a["amqpidem.reason"].AsString(); got != tc.reason {
			t.Errorf("%v: amqpidem.reason: got %q, want %q", tc.outcome, got, tc.reason)
		}
		if got, want := a["amqpidem.delay"].AsFloat64(), 1.0; got != want {
			t.Errorf("%v: amqpidem.delay: got %v, want %v", tc.outcome, got, want)
		}
	}
}

// The outbox counts that are not zero become span attributes.
func TestTracerOutboxAttributes(t *testing.T) {
	keys := []attribute.Key{"amqpidem.outbox.staged", "amqpidem.outbox.published", "amqpidem.outbox.republished", "amqpidem.outbox.returned"}
	for _, tc := range []struct {
		outbox amqpidem.OutboxCounts
		want   []int64 // by keys; 0: absent
	}{
		{amqpidem.OutboxCounts{}, []int64{0, 0, 0, 0}},
		{amqpidem.OutboxCounts{Staged: 2, Published: 2}, []int64{2, 2, 0, 0}},
		{amqpidem.OutboxCounts{Published: 3, Republished: 3}, []int64{0, 3, 3, 0}},
		{amqpidem.OutboxCounts{Staged: 4, Published: 3, Returned: 1}, []int64{4, 3, 0, 1}},
		{amqpidem.OutboxCounts{Staged: 1}, []int64{1, 0, 0, 0}},
		{amqpidem.OutboxCounts{Staged: -1}, []int64{0, 0, 0, 0}}, // not reported by amqpidem
	} {
		tr, rec, _ := newTracer(t)
		ctx := tr.Start(context.Background(), "q", delivery(t))
		tr.End(ctx, amqpidem.Event{Queue: "q", Outcome: amqpidem.Completed, Attempt: 1, Fence: 1, Outbox: tc.outbox})
		a := attrs(only(t, rec))
		for i, k := range keys {
			v, ok := a[k]
			switch {
			case tc.want[i] == 0 && ok:
				t.Errorf("%+v: attribute %s: got %v, want none", tc.outbox, k, v.Emit())
			case tc.want[i] != 0 && !ok:
				t.Errorf("%+v: attribute %s missing, want %d", tc.outbox, k, tc.want[i])
			case ok && v.AsInt64() != tc.want[i]:
				t.Errorf("%+v: attribute %s: got %v, want %d", tc.outbox, k, v.Emit(), tc.want[i])
			}
		}
		if got, want := a["amqpidem.outcome"].AsString(), "completed"; got != want {
			t.Errorf("%+v: amqpidem.outcome: got %q, want %q", tc.outbox, got, want)
		}
	}
}

func TestTracerKeyAttribute(t *testing.T) {
	for _, with := range []bool{false, true} {
		var opts []otelamqpidem.Option
		if with {
			opts = append(opts, otelamqpidem.WithKeyAttribute())
		}
		tr, rec, _ := newTracer(t, opts...)
		ctx := tr.Start(context.Background(), "q", delivery(t))
		tr.End(ctx, amqpidem.Event{Queue: "q", Key: "alice@example.com", Outcome: amqpidem.Completed})
		v, ok := attrs(only(t, rec))["amqpidem.key"]
		if ok != with || with && v.AsString() != "alice@example.com" {
			t.Errorf("WithKeyAttribute %v: amqpidem.key = %v (present %v)", with, v.Emit(), ok)
		}
	}
}

func TestTracerInject(t *testing.T) {
	tr, rec, _ := newTracer(t)
	d := delivery(t)
	ctx := tr.Start(context.Background(), "q", d)
	// A copy's headers: the delivery's, which Inject overwrites.
	h := amqp.Table{}
	for k, v := range d.Headers {
		h[k] = v
	}
	tr.Inject(ctx, h)
	tr.Inject(ctx, nil) // nothing to write into: no panic
	tr.End(ctx, amqpidem.Event{Queue: "q", Outcome: amqpidem.Retried})

	s := only(t, rec)
	sc := trace.SpanContextFromContext(otelamqpidem.Extract(context.Background(), h,
		otelamqpidem.WithPropagators(propagation.TraceContext{})))
	if got, want := sc.TraceID(), traceID; got != want {
		t.Fatalf("copy's trace id: got %v, want %v", got, want)
	}
	if got, want := sc.SpanID(), s.SpanContext().SpanID(); got != want {
		t.Fatalf("copy's parent span: got %v, want the consumer span %v", got, want)
	}
	if got, want := h["tenant"], "acme"; got != want {
		t.Fatalf("other header: got %#v, want %q", got, want)
	}
}

func TestTracerWithoutTraceHeaders(t *testing.T) {
	tr, rec, tp := newTracer(t)

	// No ambient span, no trace headers: a root span, no links.
	ctx := tr.Start(context.Background(), "q", &amqp.Delivery{RoutingKey: "q"})
	tr.End(ctx, amqpidem.Event{Queue: "q", Outcome: amqpidem.Completed})
	s := only(t, rec)
	if s.Parent().IsValid() {
		t.Fatalf("parent: got %v, want none", s.Parent())
	}
	if got := len(s.Links()); got != 0 {
		t.Fatalf("links: got %d, want 0", got)
	}

	// An ambient span, no trace headers: its child, no links.
	tr, rec, tp = newTracer(t)
	actx, ambient := tp.Tracer("test").Start(context.Background(), "request")
	ctx = tr.Start(actx, "q", &amqp.Delivery{RoutingKey: "q"})
	tr.End(ctx, amqpidem.Event{Queue: "q", Outcome: amqpidem.Completed})
	ambient.End()
	var s2 sdktrace.ReadOnlySpan
	for _, sp := range rec.Ended() {
		if sp.Name() == "process q" {
			s2 = sp
		}
	}
	if s2 == nil {
		t.Fatal("no process span")
	}
	if got, want := s2.Parent().SpanID(), ambient.SpanContext().SpanID(); got != want {
		t.Fatalf("parent: got %v, want the ambient span %v", got, want)
	}
	if got := len(s2.Links()); got != 0 {
		t.Fatalf("links: got %d, want 0", got)
	}
}

func TestTracerAmbientAndHeaders(t *testing.T) {
	tr, rec, tp := newTracer(t)
	actx, ambient := tp.Tracer("test").Start(context.Background(), "request")
	defer ambient.End()
	ctx := tr.Start(actx, "q", delivery(t))
	tr.End(ctx, amqpidem.Event{Queue: "q", Outcome: amqpidem.Completed})
	s := only(t, rec)
	if got, want := s.Parent().SpanID(), spanID; got != want {
		t.Fatalf("parent: got %v, want the producer's span %v", got, want)
	}
	var linked []trace.SpanID
	for _, l := range s.Links() {
		linked = append(linked, l.SpanContext.SpanID())
	}
	if len(linked) != 2 || linked[0] != spanID || linked[1] != ambient.SpanContext().SpanID() {
		t.Fatalf("links: got %v, want the producer's %v and the ambient %v", linked, spanID, ambient.SpanContext().SpanID())
	}
}

func TestTracerEndWithoutStart(t *testing.T) {
	tr, rec, tp := newTracer(t)
	ctx, ambient := tp.Tracer("test").Start(context.Background(), "request")
	// Start panicked, say: End gets a context without the Tracer's span,
	// and must not end the one it holds.
	tr.End(ctx, amqpidem.Event{Queue: "q", Outcome: amqpidem.Completed})
	if got := len(rec.Ended()); got != 0 {
		t.Fatalf("End without Start ended %d spans, want 0", got)
	}
	ambient.End()
}

func TestTracerGlobalDefaults(t *testing.T) {
	// With the global no-op provider and propagator: no panic, and the
	// context given back is usable.
	tr := otelamqpidem.NewTracer()
	ctx := tr.Start(context.Background(), "q", delivery(t))
	h := amqp.Table{}
	tr.Inject(ctx, h)
	tr.End(ctx, amqpidem.Event{Queue: "q", Outcome: amqpidem.DeadLettered, Err: errors.New("x")})
}

// A relayed row's producer span links to the trace context written with
// the row, which the message keeps: its consumer's span follows the
// writer's trace, not the relay's.
func TestTracerRelayPublish(t *testing.T) {
	tr, rec, _ := newTracer(t)
	h := amqp.Table{}
	otelamqpidem.Inject(producerContext(), h, otelamqpidem.WithPropagators(propagation.TraceContext{}))
	written := h["traceparent"]
	end := tr.StartPublish(context.Background(), amqpidem.Publish{Kind: amqpidem.PublishRelay, Exchange: "orders", RoutingKey: "placed",
		Headers: h, MessageID: "m1", BodySize: 3})
	end(nil)
	s := only(t, rec)
	if s.SpanKind() != trace.SpanKindProducer || len(s.Links()) != 1 || s.Links()[0].SpanContext.TraceID() != trace.SpanContextFromContext(producerContext()).TraceID() {
		t.Errorf("span %q kind %v links %v: want a producer span linked to the row's context", s.Name(), s.SpanKind(), s.Links())
	}
	if a := attrs(s); a[otelamqpidem.AttrPublishKind].AsString() != "relay" {
		t.Errorf("attributes %v: want publish kind relay", a)
	}
	if h["traceparent"] != written {
		t.Errorf("traceparent %v, want the row's %v kept", h["traceparent"], written)
	}
}
