package sdktest_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/otelamqpidem"
)

// handlerSpans keeps the span context each handler execution found in its
// context, by message id and attempt.
type handlerSpans struct {
	mu sync.Mutex
	sc map[string]trace.SpanContext
}

func (h *handlerSpans) add(id string, attempt int, sc trace.SpanContext) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.sc == nil {
		h.sc = make(map[string]trace.SpanContext)
	}
	h.sc[fmt.Sprintf("%s/%d", id, attempt)] = sc
}

func (h *handlerSpans) get(id string, attempt int) trace.SpanContext {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.sc[fmt.Sprintf("%s/%d", id, attempt)]
}

// processSpan returns the ended process span of message id's attempt.
func processSpan(rec *tracetest.SpanRecorder, id string, attempt int) sdktrace.ReadOnlySpan {
	for _, s := range rec.Ended() {
		a := attrs(s)
		if a["messaging.message.id"].AsString() == id && a["amqpidem.attempt"].AsInt64() == int64(attempt) {
			return s
		}
	}
	return nil
}

// publishSpan returns the ended producer span of kind (amqpidem.publish.kind)
// of message id.
func publishSpan(rec *tracetest.SpanRecorder, id, kind string) sdktrace.ReadOnlySpan {
	for _, s := range rec.Ended() {
		a := attrs(s)
		if s.SpanKind() == trace.SpanKindProducer && a["messaging.message.id"].AsString() == id && a["amqpidem.publish.kind"].AsString() == kind {
			return s
		}
	}
	return nil
}

// spanNames lists the ended spans, for failure messages.
func spanNames(rec *tracetest.SpanRecorder) []string {
	var names []string
	for _, s := range rec.Ended() {
		names = append(names, fmt.Sprintf("%s %v", s.Name(), s.Attributes()))
	}
	return names
}

// linksTo reports whether s links to sc.
func linksTo(s sdktrace.ReadOnlySpan, sc trace.SpanContext) bool {
	for _, l := range s.Links() {
		if l.SpanContext.TraceID() == sc.TraceID() && l.SpanContext.SpanID() == sc.SpanID() {
			return true
		}
	}
	return false
}

// originHeaders returns the HeaderOriginPrefix headers of h, without the
// prefix: the original producer's trace context.
func originHeaders(h amqp.Table) propagation.MapCarrier {
	m := propagation.MapCarrier{}
	for k, v := range h {
		if name, ok := strings.CutPrefix(k, otelamqpidem.HeaderOriginPrefix); ok {
			m[name], _ = v.(string)
		}
	}
	return m
}

// rig is what the integration tests share: a queue of their own on the
// real broker, a RedisStore, and OpenTelemetry SDK providers whose spans
// and metrics they read back.
type rig struct {
	url, name string
	ch        *amqp.Channel
	store     *lock.RedisStore
	prop      propagation.TraceContext
	rec       *tracetest.SpanRecorder
	tp        *sdktrace.TracerProvider
	reader    *sdkmetric.ManualReader
	meter     *otelamqpidem.Meter
}

// newRig declares the test's queue, and one more per suffix (its name
// and the suffix), and deletes them, the dead-letter queue and the
// store's keys when the test ends.
func newRig(t *testing.T, suffixes ...string) *rig {
	t.Helper()
	url := testenv.AMQPURL(t)
	rdb := testenv.RedisClient(t)
	name := testenv.Name(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	queues := []string{name}
	for _, s := range suffixes {
		queues = append(queues, name+s)
	}
	testenv.DeleteQueues(t, url, append(queues, name+".dlq")...)
	for _, q := range queues {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	testenv.DeleteKeys(t, rdb, name+":*")
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: name})
	if err != nil {
		t.Fatal(err)
	}
	prop := propagation.TraceContext{}
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	meter, err := otelamqpidem.NewMeter(otelamqpidem.WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}

	return &rig{url: url, name: name, ch: ch, store: store, prop: prop, rec: rec, tp: tp, reader: reader, meter: meter}
}

// TestIntegrationTrace runs a Consumer with a Tracer and a Meter against
// the real RabbitMQ and Redis: the consumer's spans continue the
// producers' traces, and so do a retried message's requeued copy and a
// dead letter.
func TestIntegrationTrace(t *testing.T) {
	r := newRig(t)
	testenv.DeleteQueues(t, r.url, r.name+".delay.50")
	url, name, ch, store, prop, rec, tp, reader, meter := r.url, r.name, r.ch, r.store, r.prop, r.rec, r.tp, r.reader, r.meter

	var seen handlerSpans
	var flakyRuns int
	var flakyMu sync.Mutex
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		info, _ := amqpidem.FromContext(ctx)
		seen.add(d.MessageId, info.Attempt, trace.SpanFromContext(ctx).SpanContext())
		switch d.Type {
		case "permanent":
			return nil, amqpidem.Permanent(errors.New("card declined"))
		case "flaky":
			flakyMu.Lock()
			flakyRuns++
			n := flakyRuns
			flakyMu.Unlock()
			if n == 1 {
				return nil, errors.New("gateway timeout")
			}
		}
		return []byte("done"), nil
	})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL: url,
		Config: amqpidem.Config{
			Queue:       name,
			MaxAttempts: 3,
			Backoff:     func() backoff.BackOff { return backoff.NewConstantBackOff(50 * time.Millisecond) },
			Tracer:      otelamqpidem.NewTracer(otelamqpidem.WithTracerProvider(tp), otelamqpidem.WithPropagators(prop)),
			Observer:    meter,
		},
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)

	// The producer: one trace per message, its context in the headers.
	pconn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pconn.Close() })
	pub := amqpidem.NewPublisher(pconn)
	t.Cleanup(pub.Close)
	producer := tp.Tracer("producer")
	producers := make(map[string]trace.SpanContext)
	for _, m := range []struct{ id, typ string }{{"ok", ""}, {"perm", "permanent"}, {"flaky", "flaky"}} {
		ctx, span := producer.Start(context.Background(), "send "+name, trace.WithSpanKind(trace.SpanKindProducer))
		msg := amqp.Publishing{MessageId: m.id, Type: m.typ, Headers: amqp.Table{}, Body: []byte("pay " + m.id)}
		otelamqpidem.Inject(ctx, msg.Headers, otelamqpidem.WithPropagators(prop))
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := pub.Publish(pctx, "", name, msg)
		cancel()
		span.End()
		if err != nil {
			t.Fatalf("Publish %s: %v", m.id, err)
		}
		producers[m.id] = span.SpanContext()
	}

	// Wait for the four process spans: ok, perm, flaky twice.
	want := []struct {
		id      string
		attempt int
	}{{"ok", 1}, {"perm", 1}, {"flaky", 1}, {"flaky", 2}}
	deadline := time.Now().Add(15 * time.Second)
	for {
		missing := ""
		for _, w := range want {
			if processSpan(rec, w.id, w.attempt) == nil {
				missing += fmt.Sprintf(" %s/%d", w.id, w.attempt)
			}
		}
		if missing == "" {
			break
		}
		if time.Now().After(deadline) {
			var got []string
			for _, s := range rec.Ended() {
				got = append(got, fmt.Sprintf("%s %v", s.Name(), s.Attributes()))
			}
			t.Fatalf("timed out waiting for the process spans of%s; ended spans: %v", missing, got)
		}
		time.Sleep(20 * time.Millisecond)
	}

	// Each first execution: a Consumer child of its producer's span.
	for _, id := range []string{"ok", "perm", "flaky"} {
		s, p := processSpan(rec, id, 1), producers[id]
		if got, want := s.SpanContext().TraceID(), p.TraceID(); got != want {
			t.Errorf("%s: trace id: got %v, want the producer's %v", id, got, want)
		}
		if got, want := s.Parent().SpanID(), p.SpanID(); got != want {
			t.Errorf("%s: parent: got %v, want the producer's span %v", id, got, want)
		}
		if got, want := s.SpanKind(), trace.SpanKindConsumer; got != want {
			t.Errorf("%s: kind: got %v, want %v", id, got, want)
		}
		if got, want := s.Name(), "process "+name; got != want {
			t.Errorf("%s: name: got %q, want %q", id, got, want)
		}
		if got, want := attrs(s)["amqpidem.queue"].AsString(), name; got != want {
			t.Errorf("%s: amqpidem.queue: got %q, want %q", id, got, want)
		}
		if got, want := seen.get(id, 1), s.SpanContext(); !got.Equal(want) {
			t.Errorf("%s: the handler's span: got %v, want the process span %v", id, got, want)
		}
	}
	for _, tc := range []struct {
		id      string
		attempt int
		outcome string
		reason  string
		status  codes.Code
	}{
		{"ok", 1, "completed", "", codes.Unset},
		{"perm", 1, "dead_lettered", "permanent failure", codes.Error},
		{"flaky", 1, "retried", "handler error", codes.Unset},
		{"flaky", 2, "completed", "", codes.Unset},
	} {
		s := processSpan(rec, tc.id, tc.attempt)
		a := attrs(s)
		if got := a["amqpidem.outcome"].AsString(); got != tc.outcome {
			t.Errorf("%s/%d: amqpidem.outcome: got %q, want %q", tc.id, tc.attempt, got, tc.outcome)
		}
		if got := a["amqpidem.reason"].AsString(); got != tc.reason {
			t.Errorf("%s/%d: amqpidem.reason: got %q, want %q", tc.id, tc.attempt, got, tc.reason)
		}
		if a["amqpidem.fence"].AsInt64() <= 0 {
			t.Errorf("%s/%d: amqpidem.fence: got %v, want a fencing token", tc.id, tc.attempt, a["amqpidem.fence"].Emit())
		}
		if got := s.Status().Code; got != tc.status {
			t.Errorf("%s/%d: status: got %v, want %v", tc.id, tc.attempt, got, tc.status)
		}
	}

	// The retried message's requeued copy continued the trace: its
	// execution is a child of the requeue's producer span, a child of the
	// first execution's span; and it links to the original producer.
	first, second := processSpan(rec, "flaky", 1), processSpan(rec, "flaky", 2)
	if got, want := second.SpanContext().TraceID(), producers["flaky"].TraceID(); got != want {
		t.Errorf("flaky/2: trace id: got %v, want the producer's %v", got, want)
	}
	if !linksTo(second, producers["flaky"]) {
		t.Errorf("flaky/2: links %v, want one to the original producer %v", second.Links(), producers["flaky"])
	}
	uri, err := amqp.ParseURI(url)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []sdktrace.ReadOnlySpan{first, second} {
		a := attrs(s)
		if a["server.address"].AsString() != uri.Host || a["server.port"].AsInt64() != int64(uri.Port) {
			t.Errorf("%s: server.address %q, server.port %d; want the URL's %s:%d", s.Name(), a["server.address"].AsString(), a["server.port"].AsInt64(), uri.Host, uri.Port)
		}
	}
	requeue := publishSpan(rec, "flaky", "requeue")
	if requeue == nil {
		t.Fatalf("flaky: no producer span of kind requeue; ended spans: %v", spanNames(rec))
	}
	if got, want := requeue.Parent().SpanID(), first.SpanContext().SpanID(); got != want {
		t.Errorf("flaky requeue span: parent %v, want the first execution's span %v", got, want)
	}
	if a := attrs(requeue); a["server.address"].AsString() != uri.Host || a["server.port"].AsInt64() != int64(uri.Port) {
		t.Errorf("requeue span: server.address %q, server.port %d; want the URL's %s:%d", a["server.address"].AsString(), a["server.port"].AsInt64(), uri.Host, uri.Port)
	}
	if got, want := second.Parent().SpanID(), requeue.SpanContext().SpanID(); got != want {
		t.Errorf("flaky/2: parent: got %v, want the requeue's producer span %v", got, want)
	}
	if got, want := seen.get("flaky", 2).TraceID(), producers["flaky"].TraceID(); got != want {
		t.Errorf("flaky/2: the handler's trace id: got %v, want %v", got, want)
	}

	// The dead letter carries the trace of the execution that gave up.
	var dl amqp.Delivery
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		m, ok, err := ch.Get(name+".dlq", true)
		if err != nil {
			t.Fatalf("get %s.dlq: %v", name, err)
		}
		if ok {
			dl = m
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no dead letter")
		}
	}
	if got, want := dl.MessageId, "perm"; got != want {
		t.Fatalf("dead letter: got message %q, want %q", got, want)
	}
	sc := trace.SpanContextFromContext(otelamqpidem.Extract(context.Background(), dl.Headers, otelamqpidem.WithPropagators(prop)))
	if got, want := sc.TraceID(), producers["perm"].TraceID(); got != want {
		t.Errorf("dead letter's traceparent: trace id %v, want the producer's %v (headers %v)", got, want, dl.Headers)
	}
	dlSpan := publishSpan(rec, "perm", "dead_letter")
	if dlSpan == nil {
		t.Fatalf("perm: no producer span of kind dead_letter; ended spans: %v", spanNames(rec))
	}
	if got, want := dlSpan.Parent().SpanID(), processSpan(rec, "perm", 1).SpanContext().SpanID(); got != want {
		t.Errorf("dead letter's producer span: parent %v, want the dead-lettering span %v", got, want)
	}
	if got, want := sc.SpanID(), dlSpan.SpanContext().SpanID(); got != want {
		t.Errorf("dead letter's traceparent: span id %v, want its producer span %v", got, want)
	}
	if got, want := dlSpan.Name(), "publish "+name+".dlq"; got != want {
		t.Errorf("dead letter's producer span: name %q, want %q", got, want)
	}
	if a := attrs(dlSpan); dlSpan.SpanKind() != trace.SpanKindProducer || a["messaging.operation.type"].AsString() != "send" ||
		a["messaging.destination.name"].AsString() != name+".dlq" || a["messaging.system"].AsString() != "rabbitmq" {
		t.Errorf("dead letter's producer span: kind %v, attributes %v", dlSpan.SpanKind(), dlSpan.Attributes())
	}
	origin := trace.SpanContextFromContext(prop.Extract(context.Background(), originHeaders(dl.Headers)))
	if got, want := origin.SpanID(), producers["perm"].SpanID(); got != want {
		t.Errorf("dead letter's %straceparent: span id %v, want the original producer's %v (headers %v)", otelamqpidem.HeaderOriginPrefix, got, want, dl.Headers)
	}

	// The Meter saw the same.
	ms := collect(t, reader)
	q := otelamqpidem.AttrQueue.String(name)
	for _, tc := range []struct {
		kvs  []attribute.KeyValue
		want int64
	}{
		{[]attribute.KeyValue{q, otelamqpidem.AttrOutcome.String("completed"), otelamqpidem.AttrReason.String("")}, 2},
		{[]attribute.KeyValue{q, otelamqpidem.AttrOutcome.String("dead_lettered"), otelamqpidem.AttrReason.String("permanent failure"), attribute.String("error.type", "permanent failure")}, 1},
		{[]attribute.KeyValue{q, otelamqpidem.AttrOutcome.String("retried"), otelamqpidem.AttrReason.String("handler error")}, 1},
	} {
		if got, _ := sum(t, ms, "messaging.client.consumed.messages", append(tc.kvs, conv...)...); got != tc.want {
			t.Errorf("messaging.client.consumed.messages %v: got %d, want %d", tc.kvs, got, tc.want)
		}
	}
	if got, _ := sum(t, ms, "amqpidem.requeues", q, otelamqpidem.AttrOutcome.String("retried"), otelamqpidem.AttrDelayTier.Float64(0.05)); got != 1 {
		t.Errorf("amqpidem.requeues retried at 0.05 s: got %d, want 1", got)
	}
	if got, _ := sum(t, ms, "amqpidem.handlers.in_flight", q); got != 0 {
		t.Errorf("amqpidem.handlers.in_flight: got %d, want 0", got)
	}
	if dp, _ := hist(t, ms, "amqpidem.store.call.duration", q, otelamqpidem.AttrOp.String("acquire"), otelamqpidem.AttrResult.String("ok")); dp.Count != 4 {
		t.Errorf("amqpidem.store.call.duration acquire ok: got %d calls, want 4", dp.Count)
	}
	if dp, _ := hist(t, ms, "amqpidem.end_to_end.duration", q, otelamqpidem.AttrOutcome.String("completed")); dp.Count != 2 {
		t.Errorf("amqpidem.end_to_end.duration completed: got %d, want 2 (the Publisher's timestamp_in_ms)", dp.Count)
	}
}

// TestIntegrationOutboxTrace runs a Consumer with a Tracer and a Meter
// whose handler stages a message: the staged message, as published, carries
// the trace context of the delivery's span (over a traceparent the handler
// put in its headers), and the span and the Meter count it.
func TestIntegrationOutboxTrace(t *testing.T) {
	r := newRig(t, ".out")
	url, name, ch, store, prop, rec, tp, reader, meter := r.url, r.name, r.ch, r.store, r.prop, r.rec, r.tp, r.reader, r.meter

	// A traceparent of another trace, which the delivery's must replace.
	const stale = "00-11111111111111111111111111111111-2222222222222222-01"
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		msg := amqp.Publishing{Headers: amqp.Table{"traceparent": stale, "tenant": "acme"}, Body: []byte("shipped " + d.MessageId)}
		return nil, amqpidem.Stage(ctx, "", name+".out", msg)
	})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL: url,
		Config: amqpidem.Config{
			Queue:    name,
			Tracer:   otelamqpidem.NewTracer(otelamqpidem.WithTracerProvider(tp), otelamqpidem.WithPropagators(prop)),
			Observer: meter,
		},
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)

	pconn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pconn.Close() })
	pub := amqpidem.NewPublisher(pconn)
	t.Cleanup(pub.Close)
	pctx, span := tp.Tracer("producer").Start(context.Background(), "send "+name, trace.WithSpanKind(trace.SpanKindProducer))
	msg := amqp.Publishing{MessageId: "order-1", Headers: amqp.Table{}, Body: []byte("pay")}
	otelamqpidem.Inject(pctx, msg.Headers, otelamqpidem.WithPropagators(prop))
	ctx, cancel := context.WithTimeout(pctx, 10*time.Second)
	err = pub.Publish(ctx, "", name, msg)
	cancel()
	span.End()
	if err != nil {
		t.Fatalf("Publish: %v", err)
	}
	producer := span.SpanContext()

	// The staged message, published before the delivery's ack.
	var out amqp.Delivery
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		m, ok, err := ch.Get(name+".out", true)
		if err != nil {
			t.Fatalf("get %s.out: %v", name, err)
		}
		if ok {
			out = m
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no staged message published")
		}
	}
	// The span ends once the delivery is settled, after the publish.
	var s sdktrace.ReadOnlySpan
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if s = processSpan(rec, "order-1", 1); s != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no process span")
		}
	}
	if got, want := s.SpanContext().TraceID(), producer.TraceID(); got != want {
		t.Fatalf("process span's trace id: got %v, want the producer's %v", got, want)
	}
	sc := trace.SpanContextFromContext(otelamqpidem.Extract(context.Background(), out.Headers, otelamqpidem.WithPropagators(prop)))
	if got, want := sc.TraceID(), s.SpanContext().TraceID(); got != want {
		t.Errorf("staged message's traceparent: trace id %v, want the delivery's %v (headers %v)", got, want, out.Headers)
	}
	if got, want := sc.SpanID(), s.SpanContext().SpanID(); got != want {
		t.Errorf("staged message's traceparent: span id %v, want the delivery's span %v (headers %v)", got, want, out.Headers)
	}
	if got, want := out.Headers["tenant"], "acme"; got != want {
		t.Errorf("staged message's other header: got %#v, want %q", got, want)
	}
	if got, want := string(out.Body), "shipped order-1"; got != want {
		t.Errorf("staged message's body: got %q, want %q", got, want)
	}

	a := attrs(s)
	for k, want := range map[attribute.Key]int64{"amqpidem.outbox.staged": 1, "amqpidem.outbox.published": 1} {
		if v, ok := a[k]; !ok || v.AsInt64() != want {
			t.Errorf("attribute %s: got %v (present %v), want %d", k, v.Emit(), ok, want)
		}
	}
	for _, k := range []attribute.Key{"amqpidem.outbox.republished", "amqpidem.outbox.returned"} {
		if v, ok := a[k]; ok {
			t.Errorf("attribute %s: got %v, want none", k, v.Emit())
		}
	}

	// Observe follows the span's end: wait for the Meter.
	q := otelamqpidem.AttrQueue.String(name)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ms := collect(t, reader)
		staged, _ := sum(t, ms, "amqpidem.outbox.messages", q, otelamqpidem.AttrOutboxResult.String("staged"))
		published, _ := sum(t, ms, "amqpidem.outbox.messages", q, otelamqpidem.AttrOutboxResult.String("published"))
		if staged == 1 && published == 1 {
			// The record was told it was published.
			if dp, _ := hist(t, ms, "amqpidem.store.call.duration", q, otelamqpidem.AttrOp.String("amend"), otelamqpidem.AttrResult.String("ok")); dp.Count != 1 {
				t.Errorf("amqpidem.store.call.duration amend ok: got %d calls, want 1", dp.Count)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("amqpidem.outbox.messages: got staged %d, published %d, want 1 and 1", staged, published)
		}
	}
}

// TestIntegrationOutboxStoredTrace: a staged message's trace context is
// written when it is staged, so the record keeps it (what `amqpidem outbox
// redrive` republishes) and the message as published carries it: the span
// the handler staged it under, here a child of the delivery's span.
func TestIntegrationOutboxStoredTrace(t *testing.T) {
	r := newRig(t, ".out")
	url, name, ch, store, prop, rec, tp := r.url, r.name, r.ch, r.store, r.prop, r.rec, r.tp

	composed := make(chan trace.SpanContext, 1)
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		ctx, span := tp.Tracer("handler").Start(ctx, "compose")
		defer span.End()
		composed <- span.SpanContext()
		return nil, amqpidem.Stage(ctx, "", name+".out", amqp.Publishing{Body: []byte("shipped")})
	})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL: url,
		Config: amqpidem.Config{
			Queue:  name,
			Tracer: otelamqpidem.NewTracer(otelamqpidem.WithTracerProvider(tp), otelamqpidem.WithPropagators(prop)),
		},
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	if err := ch.Publish("", name, false, false, amqp.Publishing{MessageId: "order-1", Body: []byte("pay")}); err != nil {
		t.Fatal(err)
	}
	var out amqp.Delivery
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		m, ok, err := ch.Get(name+".out", true)
		if err != nil {
			t.Fatalf("get %s.out: %v", name, err)
		}
		if ok {
			out = m
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no staged message published")
		}
	}
	want := <-composed
	if processSpan(rec, "order-1", 1) == nil {
		// The delivery's span ends after the publish: wait for it, then
		// read the record its settlement wrote.
		for deadline := time.Now().Add(5 * time.Second); processSpan(rec, "order-1", 1) == nil; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("no process span")
			}
		}
	}
	extract := func(h amqp.Table) trace.SpanContext {
		return trace.SpanContextFromContext(otelamqpidem.Extract(context.Background(), h, otelamqpidem.WithPropagators(prop)))
	}
	if got := extract(out.Headers); !got.Equal(want.WithRemote(true)) {
		t.Errorf("published staged message: trace context %v, want the span it was staged under %v (headers %v)", got, want, out.Headers)
	}
	rd, err := store.Inspect(context.Background(), amqpidem.StoreKey(name, "order-1"))
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := amqpidem.StoredOutbox(rd.Value)
	if err != nil || len(msgs) != 1 {
		t.Fatalf("StoredOutbox: %d messages, %v; want 1", len(msgs), err)
	}
	if got := extract(msgs[0].Msg.Headers); !got.Equal(want.WithRemote(true)) {
		t.Errorf("the record's staged message: trace context %v, want the span it was staged under %v (headers %v)", got, want, msgs[0].Msg.Headers)
	}
	// Its publish has a producer span of its own, under the delivery's,
	// linked to the context the message carries.
	ps := publishSpan(rec, msgs[0].Msg.MessageId, "outbox")
	if ps == nil {
		t.Fatalf("no producer span of kind outbox; ended spans: %v", spanNames(rec))
	}
	if got, want := ps.Parent().SpanID(), processSpan(rec, "order-1", 1).SpanContext().SpanID(); got != want {
		t.Errorf("outbox producer span: parent %v, want the delivery's span %v", got, want)
	}
	if !linksTo(ps, want) {
		t.Errorf("outbox producer span: links %v, want one to the span it was staged under %v", ps.Links(), want)
	}
	if got, want := ps.Name(), "publish "+name+".out"; got != want {
		t.Errorf("outbox producer span: name %q, want %q", got, want)
	}
}
