package sdktest_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/otelamqpidem"
)

// newMeter returns a Meter recording into the returned reader.
func newMeter(t *testing.T) (*otelamqpidem.Meter, *sdkmetric.ManualReader) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m, err := otelamqpidem.NewMeter(otelamqpidem.WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	return m, reader
}

// collect returns the metrics of reader by name.
func collect(t *testing.T, reader *sdkmetric.ManualReader) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := make(map[string]metricdata.Metrics)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out
}

// sum returns the value of the data point of a counter with exactly kvs,
// and whether there is one.
func sum(t *testing.T, ms map[string]metricdata.Metrics, name string, kvs ...attribute.KeyValue) (int64, bool) {
	t.Helper()
	m, ok := ms[name]
	if !ok {
		return 0, false
	}
	s, ok := m.Data.(metricdata.Sum[int64])
	if !ok {
		t.Fatalf("%s: got %T, want an int64 sum", name, m.Data)
	}
	want := attribute.NewSet(kvs...)
	for _, dp := range s.DataPoints {
		if dp.Attributes.Equals(&want) {
			return dp.Value, true
		}
	}
	return 0, false
}

// hist returns the data point of a histogram with exactly kvs, and whether
// there is one.
func hist(t *testing.T, ms map[string]metricdata.Metrics, name string, kvs ...attribute.KeyValue) (metricdata.HistogramDataPoint[float64], bool) {
	t.Helper()
	m, ok := ms[name]
	if !ok {
		return metricdata.HistogramDataPoint[float64]{}, false
	}
	h, ok := m.Data.(metricdata.Histogram[float64])
	if !ok {
		t.Fatalf("%s: got %T, want a float64 histogram", name, m.Data)
	}
	want := attribute.NewSet(kvs...)
	for _, dp := range h.DataPoints {
		if dp.Attributes.Equals(&want) {
			return dp, true
		}
	}
	return metricdata.HistogramDataPoint[float64]{}, false
}

var (
	queue     = otelamqpidem.AttrQueue.String("orders")
	completed = otelamqpidem.AttrOutcome.String("completed")
	retried   = otelamqpidem.AttrOutcome.String("retried")
	busy      = otelamqpidem.AttrOutcome.String("busy")
	duplicate = otelamqpidem.AttrOutcome.String("duplicate")
	noReason  = otelamqpidem.AttrReason.String("")
	// conv are the attributes the messaging conventions require of the
	// metrics they define, for an outcome that is no failure.
	conv = []attribute.KeyValue{attribute.String("messaging.system", "rabbitmq"), attribute.String("messaging.operation.name", "process")}
)

func TestMeterObserve(t *testing.T) {
	m, reader := newMeter(t)
	ctx := context.Background()
	published := time.Now().Add(-3 * time.Second)
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "k1", Outcome: amqpidem.Completed,
		Handler: 200 * time.Millisecond, Total: 250 * time.Millisecond, Published: published})
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "k2", Outcome: amqpidem.Completed,
		Handler: 100 * time.Millisecond, Total: 150 * time.Millisecond})
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "k1", Outcome: amqpidem.Duplicate,
		Total: 5 * time.Millisecond, Published: time.Now().Add(time.Hour)}) // a clock ahead
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "k3", Outcome: amqpidem.Retried, Reason: "handler error",
		Handler: time.Second, Total: time.Second, Delay: 1234 * time.Millisecond, Err: errors.New("x")})
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "k4", Outcome: amqpidem.Busy, Reason: "in progress elsewhere",
		Delay: 3 * time.Millisecond})
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "k5", Outcome: amqpidem.Abandoned, Reason: "shutdown"})
	ms := collect(t, reader)

	for _, tc := range []struct {
		kvs  []attribute.KeyValue
		want int64
	}{
		{[]attribute.KeyValue{queue, completed, noReason}, 2},
		{[]attribute.KeyValue{queue, duplicate, noReason}, 1},
		{[]attribute.KeyValue{queue, retried, otelamqpidem.AttrReason.String("handler error")}, 1},
		{[]attribute.KeyValue{queue, busy, otelamqpidem.AttrReason.String("in progress elsewhere")}, 1},
	} {
		if got, _ := sum(t, ms, "messaging.client.consumed.messages", append(tc.kvs, conv...)...); got != tc.want {
			t.Errorf("messaging.client.consumed.messages %v: got %d, want %d", tc.kvs, got, tc.want)
		}
	}

	dp, _ := hist(t, ms, "amqpidem.handler.duration", queue, completed)
	if got, want := dp.Count, uint64(2); got != want {
		t.Errorf("handler.duration count: got %d, want %d", got, want)
	}
	if got, want := dp.Sum, 0.3; math.Abs(got-want) > 1e-9 {
		t.Errorf("handler.duration sum: got %v, want %v", got, want)
	}
	if _, ok := hist(t, ms, "amqpidem.handler.duration", queue, duplicate); ok {
		t.Error("handler.duration recorded for a duplicate, whose handler did not run")
	}
	if dp, _ := hist(t, ms, "messaging.process.duration", append(conv, queue, completed)...); dp.Count != 2 || math.Abs(dp.Sum-0.4) > 1e-9 {
		t.Errorf("messaging.process.duration completed: got count %d sum %v, want 2 and 0.4", dp.Count, dp.Sum)
	}
	if dp, _ := hist(t, ms, "amqpidem.end_to_end.duration", queue, completed); dp.Count != 1 || dp.Sum < 3 || dp.Sum > 60 {
		t.Errorf("end_to_end.duration completed: got count %d sum %v, want 1 and about 3", dp.Count, dp.Sum)
	}
	if dp, _ := hist(t, ms, "amqpidem.end_to_end.duration", queue, duplicate); dp.Count != 1 || dp.Sum != 0 {
		t.Errorf("end_to_end.duration from a clock ahead: got count %d sum %v, want 1 and 0", dp.Count, dp.Sum)
	}
	if got, want := ms["amqpidem.end_to_end.duration"].Unit, "s"; got != want {
		t.Errorf("end_to_end.duration unit: got %q, want %q", got, want)
	}

	for _, tc := range []struct {
		outcome attribute.KeyValue
		tier    float64
	}{
		{retried, 1.2}, // 1234 ms: the 1200 ms tier
		{busy, 0.01},   // at least 10 ms
	} {
		got, ok := sum(t, ms, "amqpidem.requeues", queue, tc.outcome, otelamqpidem.AttrDelayTier.Float64(tc.tier))
		if !ok || got != 1 {
			t.Errorf("amqpidem.requeues %v tier %v: got %d (found %v), want 1", tc.outcome.Value.Emit(), tc.tier, got, ok)
		}
	}
	// The abandoned delivery went straight back: no delayed requeue.
	if s := ms["amqpidem.requeues"].Data.(metricdata.Sum[int64]); len(s.DataPoints) != 2 {
		t.Errorf("amqpidem.requeues: got %d series, want 2", len(s.DataPoints))
	}
}

func TestMeterNoKeyAttributes(t *testing.T) {
	m, reader := newMeter(t)
	ctx := context.Background()
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "alice@example.com", Outcome: amqpidem.Retried,
		Handler: time.Millisecond, Published: time.Now(), Delay: time.Second})
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "alice@example.com", Outcome: amqpidem.Completed,
		Outbox: amqpidem.OutboxCounts{Staged: 1, Published: 1, Republished: 1, Returned: 1}})
	m.HandlerStarted(ctx, amqpidem.Info{Queue: "orders", Key: "alice@example.com", Attempt: 1, Fence: 1})
	m.ObserveStore(ctx, amqpidem.StoreCall{Queue: "orders", Op: "extend", Leases: 1, Duration: time.Millisecond})
	for name, md := range collect(t, reader) {
		var sets []attribute.Set
		switch d := md.Data.(type) {
		case metricdata.Sum[int64]:
			for _, dp := range d.DataPoints {
				sets = append(sets, dp.Attributes)
			}
		case metricdata.Histogram[float64]:
			for _, dp := range d.DataPoints {
				sets = append(sets, dp.Attributes)
			}
		default:
			t.Fatalf("%s: unexpected %T", name, md.Data)
		}
		for _, s := range sets {
			for _, kv := range s.ToSlice() {
				if kv.Value.Emit() == "alice@example.com" || kv.Key == otelamqpidem.AttrKey {
					t.Errorf("%s carries the key: %v", name, s.Encoded(attribute.DefaultEncoder()))
				}
			}
		}
	}
}

// What deliveries did with staged messages, added up by result.
func TestMeterOutbox(t *testing.T) {
	m, reader := newMeter(t)
	ctx := context.Background()
	for _, e := range []amqpidem.Event{
		// Staged three, published them.
		{Outcome: amqpidem.Completed, Outbox: amqpidem.OutboxCounts{Staged: 3, Published: 3}},
		// Staged two, stored them, published one before a publish failed.
		{Outcome: amqpidem.Abandoned, Reason: "outbox not published", Outbox: amqpidem.OutboxCounts{Staged: 2, Published: 1}},
		// Its copy, a duplicate, publishes the other.
		{Outcome: amqpidem.Duplicate, Outbox: amqpidem.OutboxCounts{Published: 1, Republished: 1}},
		// One returned for the last time, one published.
		{Outcome: amqpidem.Completed, Outbox: amqpidem.OutboxCounts{Staged: 2, Published: 1, Returned: 1}},
		// Nothing staged.
		{Outcome: amqpidem.Completed},
	} {
		e.Queue = "orders"
		m.Observe(ctx, e)
	}
	ms := collect(t, reader)
	for _, tc := range []struct {
		result string
		want   int64
	}{
		{"staged", 3 + 2 + 2},
		{"published", 3 + 1 + 1 + 1},
		{"republished", 1},
		{"returned", 1},
	} {
		got, ok := sum(t, ms, "amqpidem.outbox.messages", queue, otelamqpidem.AttrOutboxResult.String(tc.result))
		if !ok || got != tc.want {
			t.Errorf("amqpidem.outbox.messages %s: got %d (found %v), want %d", tc.result, got, ok, tc.want)
		}
	}
	md := ms["amqpidem.outbox.messages"]
	s, ok := md.Data.(metricdata.Sum[int64])
	if !ok {
		t.Fatalf("amqpidem.outbox.messages: got %T, want an int64 sum", md.Data)
	}
	if got, want := len(s.DataPoints), 4; got != want {
		t.Errorf("amqpidem.outbox.messages: got %d series, want %d", got, want)
	}
	if !s.IsMonotonic {
		t.Error("amqpidem.outbox.messages is not monotonic")
	}
	if got, want := md.Unit, "{message}"; got != want {
		t.Errorf("amqpidem.outbox.messages unit: got %q, want %q", got, want)
	}
	if got, want := md.Description, "Messages handlers staged (amqpidem.Stage), by result: staged (stored with the handler's outcome), published (published and confirmed, republished included), republished (published by a later delivery than the one that stored it, after a crash or a failed publish), returned (given up after the broker returned or refused it MaxAttempts times)."; got != want {
		t.Errorf("amqpidem.outbox.messages description: got %q, want %q", got, want)
	}
}

// A count of zero records nothing: deliveries that staged nothing make no
// data point, and one that only published makes only that one.
func TestMeterOutboxZero(t *testing.T) {
	m, reader := newMeter(t)
	ctx := context.Background()
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Outcome: amqpidem.Completed})
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Outcome: amqpidem.Duplicate, Outbox: amqpidem.OutboxCounts{}})
	// Not something amqpidem reports; a counter does not go down.
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Outcome: amqpidem.Completed, Outbox: amqpidem.OutboxCounts{Staged: -1}})
	points := func() int {
		md, ok := collect(t, reader)["amqpidem.outbox.messages"]
		if !ok {
			return 0
		}
		return len(md.Data.(metricdata.Sum[int64]).DataPoints)
	}
	if got := points(); got != 0 {
		t.Fatalf("amqpidem.outbox.messages: got %d data points after deliveries that staged nothing, want none", got)
	}
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Outcome: amqpidem.Duplicate, Outbox: amqpidem.OutboxCounts{Published: 2, Republished: 2}})
	if got, want := points(), 2; got != want {
		t.Fatalf("amqpidem.outbox.messages: got %d data points, want %d (published and republished)", got, want)
	}
	ms := collect(t, reader)
	for _, result := range []string{"staged", "returned"} {
		if v, ok := sum(t, ms, "amqpidem.outbox.messages", queue, otelamqpidem.AttrOutboxResult.String(result)); ok {
			t.Errorf("amqpidem.outbox.messages %s: a data point (%d) for a count of zero", result, v)
		}
	}
}

func TestMeterInFlight(t *testing.T) {
	m, reader := newMeter(t)
	ctx := context.Background()
	info := amqpidem.Info{Queue: "orders", Key: "k", Attempt: 1, Fence: 3}
	m.HandlerStarted(ctx, info)
	m.HandlerStarted(ctx, info)
	m.HandlerEnded(ctx, info)
	ms := collect(t, reader)
	if got, want := ms["amqpidem.handlers.in_flight"].Data.(metricdata.Sum[int64]).IsMonotonic, false; got != want {
		t.Errorf("in_flight monotonic: got %v, want %v", got, want)
	}
	if got, _ := sum(t, ms, "amqpidem.handlers.in_flight", queue); got != 1 {
		t.Errorf("in_flight: got %d, want 1", got)
	}
	m.HandlerEnded(ctx, info)
	if got, _ := sum(t, collect(t, reader), "amqpidem.handlers.in_flight", queue); got != 0 {
		t.Errorf("in_flight after both ended: got %d, want 0", got)
	}
}

func TestMeterObserveStore(t *testing.T) {
	m, reader := newMeter(t)
	ctx := context.Background()
	down := errors.New("connection refused")
	for _, c := range []amqpidem.StoreCall{
		{Queue: "orders", Op: "acquire", Leases: 1, Duration: 2 * time.Millisecond},
		{Queue: "orders", Op: "complete", Leases: 1, Lost: 1, Duration: time.Millisecond},
		{Queue: "orders", Op: "fail", Leases: 1, Failed: 1, Err: down, Duration: time.Second},
		{Queue: "orders", Op: "extend", Leases: 5, Duration: time.Millisecond},
		{Queue: "orders", Op: "extend", Leases: 4, Lost: 1, Duration: time.Millisecond},
		{Queue: "orders", Op: "extend", Leases: 3, Lost: 1, Failed: 2, Err: down, Duration: time.Millisecond},
		{Queue: "orders", Op: "extend", Leases: 1, Lost: 2, Duration: time.Millisecond}, // more lost than asked: 1
	} {
		m.ObserveStore(ctx, c)
	}
	ms := collect(t, reader)
	op, result := otelamqpidem.AttrOp, otelamqpidem.AttrResult
	for _, tc := range []struct {
		op, result string
		count      uint64
	}{
		{"acquire", "ok", 1},
		{"complete", "lost", 1},
		{"fail", "error", 1},
		{"extend", "ok", 1},
		{"extend", "lost", 2},
		{"extend", "error", 1},
	} {
		dp, _ := hist(t, ms, "amqpidem.store.call.duration", queue, op.String(tc.op), result.String(tc.result))
		if dp.Count != tc.count {
			t.Errorf("store.call.duration %s %s: got %d, want %d", tc.op, tc.result, dp.Count, tc.count)
		}
	}
	for _, tc := range []struct {
		result string
		want   int64
	}{
		{"renewed", 5 + 3},
		{"lost", 1 + 1 + 1},
		{"error", 2},
	} {
		if got, _ := sum(t, ms, "amqpidem.lease.extensions", queue, result.String(tc.result)); got != tc.want {
			t.Errorf("lease.extensions %s: got %d, want %d", tc.result, got, tc.want)
		}
	}
}

// The Meter's metrics that the messaging semantic conventions define go
// by their names, with their required attributes (messaging.system,
// messaging.operation.name, error.type for a failure); amqpidem's own
// stay under amqpidem.*, and the old names are gone.
func TestMeterSemconvNames(t *testing.T) {
	m, reader := newMeter(t)
	ctx := context.Background()
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "k1", Outcome: amqpidem.Completed,
		Handler: 200 * time.Millisecond, Total: 250 * time.Millisecond})
	m.Observe(ctx, amqpidem.Event{Queue: "orders", Key: "k2", Outcome: amqpidem.DeadLettered, Reason: "permanent failure",
		Handler: time.Millisecond, Total: 2 * time.Millisecond, Err: errors.New("no")})
	ms := collect(t, reader)
	system := attribute.String("messaging.system", "rabbitmq")
	op := attribute.String("messaging.operation.name", "process")
	dead := otelamqpidem.AttrOutcome.String("dead_lettered")
	failure := otelamqpidem.AttrReason.String("permanent failure")
	errType := attribute.String("error.type", "permanent failure")

	if got, _ := sum(t, ms, "messaging.client.consumed.messages", system, op, queue, completed, noReason); got != 1 {
		t.Errorf("messaging.client.consumed.messages completed: got %d, want 1", got)
	}
	if got, _ := sum(t, ms, "messaging.client.consumed.messages", system, op, queue, dead, failure, errType); got != 1 {
		t.Errorf("messaging.client.consumed.messages dead_lettered: got %d, want 1", got)
	}
	if dp, _ := hist(t, ms, "messaging.process.duration", system, op, queue, completed); dp.Count != 1 || math.Abs(dp.Sum-0.25) > 1e-9 {
		t.Errorf("messaging.process.duration completed: got count %d sum %v, want 1 and 0.25", dp.Count, dp.Sum)
	}
	if dp, _ := hist(t, ms, "messaging.process.duration", system, op, queue, dead, errType); dp.Count != 1 {
		t.Errorf("messaging.process.duration dead_lettered: got count %d, want 1", dp.Count)
	}
	if got, want := ms["messaging.process.duration"].Unit, "s"; got != want {
		t.Errorf("messaging.process.duration unit: got %q, want %q", got, want)
	}
	if got, want := ms["messaging.client.consumed.messages"].Unit, "{message}"; got != want {
		t.Errorf("messaging.client.consumed.messages unit: got %q, want %q", got, want)
	}
	for _, old := range []string{"amqpidem.messages", "amqpidem.processing.duration"} {
		if _, ok := ms[old]; ok {
			t.Errorf("%s: still recorded, want it renamed", old)
		}
	}
	if _, ok := hist(t, ms, "amqpidem.handler.duration", queue, completed); !ok {
		t.Error("amqpidem.handler.duration: not recorded; amqpidem's own metrics keep their names")
	}
}

// ObserveBatch records a batch's size, duration and handler calls.
func TestMeterObserveBatch(t *testing.T) {
	m, reader := newMeter(t)
	ctx := context.Background()
	m.ObserveBatch(ctx, amqpidem.BatchInfo{Queue: "orders", Size: 100, Runs: 1, Duration: 20 * time.Millisecond})
	m.ObserveBatch(ctx, amqpidem.BatchInfo{Queue: "orders", Size: 7, Runs: 5, Duration: 30 * time.Millisecond})
	ms := collect(t, reader)
	size, ok := ms[otelamqpidem.MetricBatchSize].Data.(metricdata.Histogram[int64])
	if !ok || len(size.DataPoints) != 1 {
		t.Fatalf("%s: got %+v, want one int64 histogram point", otelamqpidem.MetricBatchSize, ms[otelamqpidem.MetricBatchSize].Data)
	}
	if dp := size.DataPoints[0]; dp.Count != 2 || dp.Sum != 107 {
		t.Errorf("batch.size: got count %d sum %d, want 2 and 107", dp.Count, dp.Sum)
	}
	dp, _ := hist(t, ms, otelamqpidem.MetricBatchDuration, queue)
	if dp.Count != 2 || math.Abs(dp.Sum-0.05) > 1e-9 {
		t.Errorf("batch.duration: got count %d sum %v, want 2 and 0.05", dp.Count, dp.Sum)
	}
	if got, _ := sum(t, ms, otelamqpidem.MetricBatchHandlerRuns, queue); got != 6 {
		t.Errorf("batch.handler.runs: got %d, want 6", got)
	}
}
