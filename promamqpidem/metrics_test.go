package promamqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// series finds the series name{labels} (labels: name, value, ... naming
// every label of the series) in what c collects; nil if there is none.
func series(t *testing.T, c prometheus.Collector, name string, labels ...string) *dto.Metric {
	t.Helper()
	if len(labels)%2 != 0 {
		t.Fatalf("series %s: odd label list %q", name, labels)
	}
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	metrics:
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) != len(labels)/2 {
				continue
			}
			for _, l := range m.GetLabel() {
				found := false
				for i := 0; i < len(labels); i += 2 {
					if labels[i] == l.GetName() && labels[i+1] == l.GetValue() {
						found = true
					}
				}
				if !found {
					continue metrics
				}
			}
			return m
		}
	}
	return nil
}

// value is a counter's or gauge's value, or a histogram's sample count,
// of the series name{labels}; 0 if there is no such series.
func value(t *testing.T, c prometheus.Collector, name string, labels ...string) float64 {
	t.Helper()
	m := series(t, c, name, labels...)
	switch {
	case m == nil:
		return 0
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Histogram != nil:
		return float64(m.GetHistogram().GetSampleCount())
	}
	t.Fatalf("%s: unexpected metric type", name)
	return 0
}

// lint fails t if promlint finds a problem in what c collects.
func lint(t *testing.T, c prometheus.Collector) {
	t.Helper()
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

const q = "orders"

func TestObserve(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	ctx := context.Background()
	now := time.Now()
	for _, e := range []amqpidem.Event{
		{Outcome: amqpidem.Completed, Handler: 20 * time.Millisecond, Total: 25 * time.Millisecond, Published: now.Add(-3 * time.Second)},
		{Outcome: amqpidem.Completed, Handler: time.Millisecond, Total: 2 * time.Millisecond},
		{Outcome: amqpidem.Duplicate, Total: time.Millisecond, Published: now.Add(-time.Second)},
		{Outcome: amqpidem.Busy, Reason: "in progress elsewhere", Delay: 1234 * time.Millisecond, Total: time.Millisecond},
		{Outcome: amqpidem.Busy, Reason: "in progress elsewhere", Delay: 1190 * time.Millisecond, Total: time.Millisecond},
		{Outcome: amqpidem.Retried, Reason: "handler error", Delay: 100 * time.Millisecond, Handler: time.Millisecond, Total: time.Millisecond},
		{Outcome: amqpidem.Abandoned, Reason: "shutdown", Handler: time.Millisecond, Total: time.Millisecond},
		{Outcome: amqpidem.DeadLettered, Reason: "permanent failure", Handler: time.Millisecond, Total: time.Millisecond},
		{Outcome: amqpidem.Dropped, Reason: "failed duplicate", Delay: time.Second, Total: time.Millisecond},
		// A publisher's clock ahead of ours.
		{Outcome: amqpidem.Duplicate, Total: time.Millisecond, Published: now.Add(time.Hour)},
	} {
		e.Queue = q
		m.Observe(ctx, e)
	}

	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"amqpidem_messages_total", []string{"outcome", "completed", "reason", ""}, 2},
		{"amqpidem_messages_total", []string{"outcome", "duplicate", "reason", ""}, 2},
		{"amqpidem_messages_total", []string{"outcome", "busy", "reason", "in progress elsewhere"}, 2},
		{"amqpidem_messages_total", []string{"outcome", "retried", "reason", "handler error"}, 1},
		{"amqpidem_messages_total", []string{"outcome", "abandoned", "reason", "shutdown"}, 1},
		{"amqpidem_messages_total", []string{"outcome", "dead_lettered", "reason", "permanent failure"}, 1},
		{"amqpidem_messages_total", []string{"outcome", "dropped", "reason", "failed duplicate"}, 1},
		// The handler's duration only where it ran.
		{"amqpidem_handler_duration_seconds", []string{"outcome", "completed"}, 2},
		{"amqpidem_handler_duration_seconds", []string{"outcome", "duplicate"}, 0},
		{"amqpidem_handler_duration_seconds", []string{"outcome", "busy"}, 0},
		{"amqpidem_handler_duration_seconds", []string{"outcome", "dead_lettered"}, 1},
		{"amqpidem_processing_duration_seconds", []string{"outcome", "completed"}, 2},
		{"amqpidem_processing_duration_seconds", []string{"outcome", "busy"}, 2},
		// End to end only where Published is known.
		{"amqpidem_end_to_end_duration_seconds", []string{"outcome", "completed"}, 1},
		{"amqpidem_end_to_end_duration_seconds", []string{"outcome", "duplicate"}, 2},
		// Requeues by the tier they wait in: 1234 and 1190 ms both wait
		// 1.2 s. Not the shutdown's immediate requeue, nor a dropped
		// delivery whatever its Delay.
		{"amqpidem_requeues_total", []string{"outcome", "busy", "delay_tier", "1.2"}, 2},
		{"amqpidem_requeues_total", []string{"outcome", "retried", "delay_tier", "0.1"}, 1},
		{"amqpidem_requeues_total", []string{"outcome", "abandoned", "delay_tier", "0"}, 0},
		{"amqpidem_requeues_total", []string{"outcome", "dropped", "delay_tier", "1"}, 0},
	} {
		if got := value(t, m, c.name, append([]string{"queue", q}, c.labels...)...); got != c.want {
			t.Errorf("%s%q: got %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if got := testutil.CollectAndCount(m, "amqpidem_requeues_total"); got != 2 {
		t.Errorf("requeues_total has %d series, want 2", got)
	}

	// The completed message published 3 s ago took about 3 s; the
	// duplicates about 1 s and 0 s (a clock ahead counts as 0).
	e2e := series(t, m, "amqpidem_end_to_end_duration_seconds", "queue", q, "outcome", "completed").GetHistogram()
	if got := e2e.GetSampleSum(); got < 3 || got > 4 {
		t.Errorf("end-to-end sum of the completed message: got %v s, want about 3", got)
	}
	e2e = series(t, m, "amqpidem_end_to_end_duration_seconds", "queue", q, "outcome", "duplicate").GetHistogram()
	if got := e2e.GetSampleSum(); got < 1 || got > 2 {
		t.Errorf("end-to-end sum of the duplicates: got %v s, want about 1", got)
	}
	h := series(t, m, "amqpidem_handler_duration_seconds", "queue", q, "outcome", "completed").GetHistogram()
	if got, want := h.GetSampleSum(), 0.021; math.Abs(got-want) > 1e-9 {
		t.Errorf("handler duration sum: got %v, want %v", got, want)
	}
	lint(t, m)
}

// What deliveries did with staged messages, added up by result.
func TestObserveOutbox(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	ctx := context.Background()
	for _, e := range []amqpidem.Event{
		// Staged three, published them.
		{Outcome: amqpidem.Completed, Outbox: amqpidem.OutboxCounts{Staged: 3, Published: 3}},
		// Staged two, stored them, published one before a publish failed.
		{Outcome: amqpidem.Abandoned, Reason: "outbox not published", Err: errors.New("channel closed"),
			Outbox: amqpidem.OutboxCounts{Staged: 2, Published: 1}},
		// Its copy, a duplicate, publishes the other.
		{Outcome: amqpidem.Duplicate, Outbox: amqpidem.OutboxCounts{Published: 1, Republished: 1}},
		// One returned for the last time, one published.
		{Outcome: amqpidem.Completed, Outbox: amqpidem.OutboxCounts{Staged: 2, Published: 1, Returned: 1}},
		// Nothing staged.
		{Outcome: amqpidem.Completed},
	} {
		e.Queue, e.Key = q, "alice@example.com"
		m.Observe(ctx, e)
	}
	for _, c := range []struct {
		result string
		want   float64
	}{
		{"staged", 3 + 2 + 2},
		{"published", 3 + 1 + 1 + 1},
		{"republished", 1},
		{"returned", 1},
	} {
		if got := value(t, m, "amqpidem_outbox_messages_total", "queue", q, "result", c.result); got != c.want {
			t.Errorf("outbox_messages_total{result=%q}: got %v, want %v", c.result, got, c.want)
		}
	}
	if got, want := testutil.CollectAndCount(m, "amqpidem_outbox_messages_total"), 4; got != want {
		t.Errorf("outbox_messages_total has %d series, want %d", got, want)
	}
	// No label carries the key or the error's text.
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				if strings.Contains(l.GetValue(), "alice") || strings.Contains(l.GetValue(), "channel closed") {
					t.Errorf("%s{%s=%q}: a label carries message data", f.GetName(), l.GetName(), l.GetValue())
				}
			}
		}
	}
	lint(t, m)
}

// A count of zero adds no sample: a delivery that staged nothing makes no
// series, and one that only published makes only that series.
func TestObserveOutboxZero(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	ctx := context.Background()
	m.Observe(ctx, amqpidem.Event{Queue: q, Outcome: amqpidem.Completed})
	m.Observe(ctx, amqpidem.Event{Queue: q, Outcome: amqpidem.Duplicate, Outbox: amqpidem.OutboxCounts{}})
	// Not something amqpidem reports; a counter must not go down (Add
	// panics), so it is left out too.
	m.Observe(ctx, amqpidem.Event{Queue: q, Outcome: amqpidem.Completed, Outbox: amqpidem.OutboxCounts{Staged: -1}})
	if got := testutil.CollectAndCount(m, "amqpidem_outbox_messages_total"); got != 0 {
		t.Fatalf("outbox_messages_total has %d series after deliveries that staged nothing, want none", got)
	}
	m.Observe(ctx, amqpidem.Event{Queue: q, Outcome: amqpidem.Duplicate, Outbox: amqpidem.OutboxCounts{Published: 2, Republished: 2}})
	if got, want := testutil.CollectAndCount(m, "amqpidem_outbox_messages_total"), 2; got != want {
		t.Fatalf("outbox_messages_total has %d series, want %d (published and republished)", got, want)
	}
	for _, result := range []string{"staged", "returned"} {
		if s := series(t, m, "amqpidem_outbox_messages_total", "queue", q, "result", result); s != nil {
			t.Errorf("outbox_messages_total{result=%q}: a sample for a count of zero: %v", result, s)
		}
	}
}

// The whole exposition of outbox_messages_total: name, help, type,
// labels.
func TestOutboxMetricText(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	m.Observe(context.Background(), amqpidem.Event{Queue: q, Outcome: amqpidem.Completed,
		Outbox: amqpidem.OutboxCounts{Staged: 2, Published: 2}})
	want := `# HELP amqpidem_outbox_messages_total Messages handlers staged (amqpidem.Stage), by result: staged (stored with the handler's outcome), published (published and confirmed, republished included), republished (published by a later delivery than the one that stored it, after a crash or a failed publish), returned (given up after the broker returned or refused it MaxAttempts times).
# TYPE amqpidem_outbox_messages_total counter
amqpidem_outbox_messages_total{queue="orders",result="published"} 2
amqpidem_outbox_messages_total{queue="orders",result="staged"} 2
`
	if err := testutil.CollectAndCompare(m, strings.NewReader(want), "amqpidem_outbox_messages_total"); err != nil {
		t.Error(err)
	}
}

func TestDelayTierLabel(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want string
	}{
		{time.Millisecond, "0.01"},
		{250 * time.Millisecond, "0.25"},
		{1234 * time.Millisecond, "1.2"},
		{1500 * time.Millisecond, "1.5"},
		{30 * time.Second, "30"},
		{299600 * time.Millisecond, "300"},
		{time.Hour, "3600"},
	} {
		if got := promamqpidem.DelayTierLabel(c.d); got != c.want {
			t.Errorf("DelayTierLabel(%v): got %q, want %q", c.d, got, c.want)
		}
	}
}

func TestObserveStore(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	ctx := context.Background()
	down := errors.New("connection refused")
	for _, c := range []amqpidem.StoreCall{
		{Op: "acquire", Leases: 1, Duration: time.Millisecond},
		{Op: "acquire", Leases: 1, Duration: time.Millisecond},
		{Op: "acquire", Leases: 1, Failed: 1, Duration: time.Second, Err: down},
		{Op: "complete", Leases: 1, Duration: time.Millisecond},
		{Op: "complete", Leases: 1, Lost: 1, Duration: time.Millisecond},
		{Op: "fail", Leases: 1, Duration: time.Millisecond},
		{Op: "release", Leases: 1, Duration: time.Millisecond},
		{Op: "cancel", Leases: 1, Duration: time.Millisecond},
		{Op: "extend", Leases: 5, Duration: 2 * time.Millisecond},
		{Op: "extend", Leases: 4, Lost: 1, Duration: 2 * time.Millisecond},
		{Op: "extend", Leases: 5, Lost: 1, Failed: 2, Duration: time.Second, Err: down},
	} {
		c.Queue = q
		m.ObserveStore(ctx, c)
	}
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"amqpidem_store_call_duration_seconds", []string{"op", "acquire", "result", "ok"}, 2},
		{"amqpidem_store_call_duration_seconds", []string{"op", "acquire", "result", "error"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "complete", "result", "ok"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "complete", "result", "lost"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "fail", "result", "ok"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "release", "result", "ok"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "cancel", "result", "ok"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "extend", "result", "ok"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "extend", "result", "lost"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "extend", "result", "error"}, 1},
		// Per lease: 5 + 3 + 2 renewed, 1 + 1 lost, 2 failed.
		{"amqpidem_lease_extensions_total", []string{"result", "renewed"}, 10},
		{"amqpidem_lease_extensions_total", []string{"result", "lost"}, 2},
		{"amqpidem_lease_extensions_total", []string{"result", "error"}, 2},
	} {
		if got := value(t, m, c.name, append([]string{"queue", q}, c.labels...)...); got != c.want {
			t.Errorf("%s%q: got %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	s := series(t, m, "amqpidem_store_call_duration_seconds", "queue", q, "op", "acquire", "result", "ok").GetHistogram()
	if got, want := s.GetSampleSum(), 0.002; math.Abs(got-want) > 1e-9 {
		t.Errorf("acquire duration sum: got %v, want %v", got, want)
	}
	lint(t, m)
}

func TestHandlersInFlight(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	ctx := context.Background()
	a, b := amqpidem.Info{Queue: "a"}, amqpidem.Info{Queue: "b"}
	m.HandlerStarted(ctx, a)
	m.HandlerStarted(ctx, a)
	m.HandlerStarted(ctx, b)
	m.HandlerEnded(ctx, a)
	if got, want := value(t, m, "amqpidem_handlers_in_flight", "queue", "a"), 1.0; got != want {
		t.Errorf("in flight on a: got %v, want %v", got, want)
	}
	if got, want := value(t, m, "amqpidem_handlers_in_flight", "queue", "b"), 1.0; got != want {
		t.Errorf("in flight on b: got %v, want %v", got, want)
	}
	m.HandlerEnded(ctx, a)
	m.HandlerEnded(ctx, b)
	if got, want := value(t, m, "amqpidem_handlers_in_flight", "queue", "a"), 0.0; got != want {
		t.Errorf("in flight on a at the end: got %v, want %v", got, want)
	}
	lint(t, m)
}

// Observers hands a Metrics every hook.
func TestThroughObservers(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	o := amqpidem.Observers(nil, m)
	ctx := context.Background()
	o.(amqpidem.HandlerObserver).HandlerStarted(ctx, amqpidem.Info{Queue: q})
	o.(amqpidem.StoreObserver).ObserveStore(ctx, amqpidem.StoreCall{Queue: q, Op: "extend", Leases: 2})
	o.Observe(ctx, amqpidem.Event{Queue: q, Outcome: amqpidem.Completed})
	for _, c := range []struct {
		name   string
		labels []string
	}{
		{"amqpidem_handlers_in_flight", nil},
		{"amqpidem_messages_total", []string{"outcome", "completed", "reason", ""}},
		{"amqpidem_store_call_duration_seconds", []string{"op", "extend", "result", "ok"}},
	} {
		if got := value(t, m, c.name, append([]string{"queue", q}, c.labels...)...); got != 1 {
			t.Errorf("%s%q: got %v, want 1", c.name, c.labels, got)
		}
	}
}

func TestOptions(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{
		Namespace:       "shop",
		ConstLabels:     prometheus.Labels{"service": "orders"},
		DurationBuckets: []float64{0.1, 1},
		StoreBuckets:    []float64{0.001},
		EndToEndBuckets: []float64{1, 60},
	})
	ctx := context.Background()
	m.Observe(ctx, amqpidem.Event{Queue: q, Outcome: amqpidem.Completed, Handler: time.Second, Total: time.Second, Published: time.Now()})
	m.ObserveStore(ctx, amqpidem.StoreCall{Queue: q, Op: "acquire", Leases: 1})
	for _, c := range []struct {
		name   string
		labels []string
		bounds []float64
	}{
		{"shop_handler_duration_seconds", []string{"outcome", "completed"}, []float64{0.1, 1}},
		{"shop_processing_duration_seconds", []string{"outcome", "completed"}, []float64{0.1, 1}},
		{"shop_end_to_end_duration_seconds", []string{"outcome", "completed"}, []float64{1, 60}},
		{"shop_store_call_duration_seconds", []string{"op", "acquire", "result", "ok"}, []float64{0.001}},
	} {
		s := series(t, m, c.name, append([]string{"service", "orders", "queue", q}, c.labels...)...)
		if s == nil {
			t.Errorf("%s: no series with the const label", c.name)
			continue
		}
		var bounds []float64
		for _, b := range s.GetHistogram().GetBucket() {
			bounds = append(bounds, b.GetUpperBound())
		}
		if got, want := fmt.Sprint(bounds), fmt.Sprint(c.bounds); got != want {
			t.Errorf("%s buckets: got %s, want %s", c.name, got, want)
		}
	}
	if got := value(t, m, "shop_messages_total", "service", "orders", "queue", q, "outcome", "completed", "reason", ""); got != 1 {
		t.Errorf("shop_messages_total: got %v, want 1", got)
	}
	lint(t, m)
}

func TestValidate(t *testing.T) {
	if err := (promamqpidem.Options{}).Validate(); err != nil {
		t.Errorf("zero Options: %v", err)
	}
	for _, c := range []struct {
		opts promamqpidem.Options
		want string // in the error
	}{
		{promamqpidem.Options{DurationBuckets: []float64{1, 1}}, "Options.DurationBuckets"},
		{promamqpidem.Options{StoreBuckets: []float64{}}, "Options.StoreBuckets"},
		{promamqpidem.Options{EndToEndBuckets: []float64{2, 1}}, "Options.EndToEndBuckets"},
		{promamqpidem.Options{Namespace: "bad name"}, "Options.Namespace"},
		{promamqpidem.Options{ConstLabels: prometheus.Labels{"queue": "x"}}, "Options.ConstLabels"},
		{promamqpidem.Options{ConstLabels: prometheus.Labels{"__reserved": "x"}}, "Options.ConstLabels"},
		{promamqpidem.Options{ConstLabels: prometheus.Labels{"service.name": "x"}}, "Options.ConstLabels"},
	} {
		err := c.opts.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Validate(%+v): got %v, want an error naming %s", c.opts, err, c.want)
		}
	}
	defer func() {
		if recover() == nil {
			t.Error("New with invalid Options did not panic")
		}
	}()
	promamqpidem.New(promamqpidem.Options{StoreBuckets: []float64{1, 0}})
}

// Every hook at once from many goroutines (run with -race).
func TestConcurrent(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	ctx := context.Background()
	const workers, each = 8, 500
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			queue := fmt.Sprintf("q%d", w%2)
			for i := range each {
				info := amqpidem.Info{Queue: queue}
				m.HandlerStarted(ctx, info)
				m.ObserveStore(ctx, amqpidem.StoreCall{Queue: queue, Op: "extend", Leases: 2})
				m.HandlerEnded(ctx, info)
				m.Observe(ctx, amqpidem.Event{Queue: queue, Outcome: amqpidem.Retried, Reason: "handler error",
					Delay: time.Duration(100+i%7) * time.Millisecond, Handler: time.Millisecond, Total: time.Millisecond})
			}
		})
	}
	wg.Add(1)
	go func() { // scrapes meanwhile
		defer wg.Done()
		for range 20 {
			_ = testutil.CollectAndCount(m)
		}
	}()
	wg.Wait()
	total := 0.0
	for _, queue := range []string{"q0", "q1"} {
		total += value(t, m, "amqpidem_messages_total", "queue", queue, "outcome", "retried", "reason", "handler error")
		if got := value(t, m, "amqpidem_handlers_in_flight", "queue", queue); got != 0 {
			t.Errorf("in flight on %s: got %v, want 0", queue, got)
		}
	}
	if got, want := total, float64(workers*each); got != want {
		t.Errorf("messages: got %v, want %v", got, want)
	}
}

// The Metrics of a real Consumer: one message completes, its copy is a
// duplicate, and a message that fails for good is dead-lettered.
func TestConsumer(t *testing.T) {
	url := testenv.AMQPURL(t)
	rdb := testenv.RedisClient(t)
	name := testenv.Name(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	testenv.DeleteQueues(t, url, name, name+".dlq")
	testenv.DeleteKeys(t, rdb, name+"*")
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: name})
	if err != nil {
		t.Fatal(err)
	}

	m := promamqpidem.New(promamqpidem.Options{})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL: url,
		Config: amqpidem.Config{
			Queue:     name,
			Observer:  m,
			Retention: time.Minute,
			Logger:    slog.New(slog.NewTextHandler(t.Output(), nil)),
		},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		if string(d.Body) == "fail" {
			return nil, amqpidem.Permanent(errors.New("declined"))
		}
		return []byte("ok"), nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// Ready once the queue is declared and consumed.
	for c.Ready(ctx) != nil {
		select {
		case <-ctx.Done():
			t.Fatalf("consumer not ready: %v", c.Ready(context.Background()))
		case <-time.After(10 * time.Millisecond):
		}
	}
	pub := amqpidem.NewPublisher(conn)
	defer pub.Close()
	publish := func(id, body string) {
		t.Helper()
		if err := pub.Publish(ctx, "", name, amqp.Publishing{MessageId: id, Body: []byte(body)}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor := func(want float64, labels ...string) {
		t.Helper()
		labels = append([]string{"queue", name}, labels...)
		for {
			got := value(t, m, "amqpidem_messages_total", labels...)
			if got == want {
				return
			}
			select {
			case <-ctx.Done():
				t.Fatalf("messages_total%q: got %v, want %v", labels, got, want)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	// One at a time, so that the copy comes after the first is completed
	// (a duplicate), not while it runs (busy).
	publish("k1", "ok")
	waitFor(1, "outcome", "completed", "reason", "")
	publish("k1", "ok")
	waitFor(1, "outcome", "duplicate", "reason", "")
	publish("k2", "fail")
	waitFor(1, "outcome", "dead_lettered", "reason", "permanent failure")

	if got := testutil.CollectAndCount(m, "amqpidem_messages_total"); got != 3 {
		t.Errorf("messages_total has %d series, want 3", got)
	}
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"amqpidem_handler_duration_seconds", []string{"outcome", "completed"}, 1},
		{"amqpidem_handler_duration_seconds", []string{"outcome", "duplicate"}, 0},
		{"amqpidem_handler_duration_seconds", []string{"outcome", "dead_lettered"}, 1},
		{"amqpidem_processing_duration_seconds", []string{"outcome", "duplicate"}, 1},
		// The Publisher sets the timestamp_in_ms header.
		{"amqpidem_end_to_end_duration_seconds", []string{"outcome", "completed"}, 1},
		{"amqpidem_end_to_end_duration_seconds", []string{"outcome", "duplicate"}, 1},
		{"amqpidem_end_to_end_duration_seconds", []string{"outcome", "dead_lettered"}, 1},
		{"amqpidem_handlers_in_flight", nil, 0},
		{"amqpidem_store_call_duration_seconds", []string{"op", "acquire", "result", "ok"}, 3},
		{"amqpidem_store_call_duration_seconds", []string{"op", "complete", "result", "ok"}, 1},
		{"amqpidem_store_call_duration_seconds", []string{"op", "fail", "result", "ok"}, 1},
	} {
		if got := value(t, m, c.name, append([]string{"queue", name}, c.labels...)...); got != c.want {
			t.Errorf("%s%q: got %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if got := testutil.CollectAndCount(m, "amqpidem_requeues_total"); got != 0 {
		t.Errorf("requeues_total has %d series, want none", got)
	}
	lint(t, m)
}

// The outbox counts of a real Consumer: a message whose handler stages
// two messages for a bound queue, and one whose staged message no queue
// is bound to, given up at once (MaxAttempts 1).
func TestConsumerOutbox(t *testing.T) {
	url := testenv.AMQPURL(t)
	rdb := testenv.RedisClient(t)
	name := testenv.Name(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	testenv.DeleteQueues(t, url, name, name+".dlq", name+".out")
	testenv.DeleteKeys(t, rdb, name+"*")
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(name+".out", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: name})
	if err != nil {
		t.Fatal(err)
	}

	m := promamqpidem.New(promamqpidem.Options{})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL: url,
		Config: amqpidem.Config{
			Queue:       name,
			Observer:    m,
			MaxAttempts: 1,
			Retention:   time.Minute,
			Logger:      slog.New(slog.NewTextHandler(t.Output(), nil)),
		},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		to, n := name+".out", 2
		if string(d.Body) == "nowhere" {
			to, n = name+".unbound", 1
		}
		for i := range n {
			if err := amqpidem.Stage(ctx, "", to, amqp.Publishing{Body: fmt.Appendf(nil, "%s %d", d.Body, i)}); err != nil {
				return nil, err
			}
		}
		return []byte("ok"), nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for c.Ready(ctx) != nil {
		select {
		case <-ctx.Done():
			t.Fatalf("consumer not ready: %v", c.Ready(context.Background()))
		case <-time.After(10 * time.Millisecond):
		}
	}
	pub := amqpidem.NewPublisher(conn)
	defer pub.Close()
	for _, id := range []string{"k1", "k2"} {
		body := "pay"
		if id == "k2" {
			body = "nowhere"
		}
		if err := pub.Publish(ctx, "", name, amqp.Publishing{MessageId: id, Body: []byte(body)}); err != nil {
			t.Fatal(err)
		}
	}
	// Observe adds the outbox counts after messages_total: wait for all.
	want := map[string]float64{"staged": 3, "published": 2, "republished": 0, "returned": 1}
	for {
		got := make(map[string]float64)
		for result := range want {
			got[result] = value(t, m, "amqpidem_outbox_messages_total", "queue", name, "result", result)
		}
		if fmt.Sprint(got) == fmt.Sprint(want) {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("outbox_messages_total by result: got %v, want %v", got, want)
		case <-time.After(10 * time.Millisecond):
		}
	}
	if got, want := value(t, m, "amqpidem_messages_total", "queue", name, "outcome", "completed", "reason", ""), 1.0; got != want {
		t.Errorf("messages_total completed: got %v, want %v", got, want)
	}
	// k2's staged message was given up: its own outcome, not completed.
	if got, want := value(t, m, "amqpidem_messages_total", "queue", name, "outcome", "outbox_given_up", "reason", "staged message given up"), 1.0; got != want {
		t.Errorf("messages_total outbox_given_up: got %v, want %v", got, want)
	}
	// Each delivery recorded what became of its staged messages: k1 both
	// published, k2 its one returned.
	if got, want := value(t, m, "amqpidem_store_call_duration_seconds", "queue", name, "op", "amend", "result", "ok"), 2.0; got != want {
		t.Errorf("store_call_duration_seconds{op=\"amend\"}: got %v calls, want %v", got, want)
	}
	if got, want := testutil.CollectAndCount(m, "amqpidem_outbox_messages_total"), 3; got != want {
		t.Errorf("outbox_messages_total has %d series, want %d", got, want)
	}
	// The published ones are there.
	out, err := ch.QueueDeclarePassive(name+".out", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := out.Messages, 2; got != want {
		t.Errorf("%s.out holds %d messages, want %d", name, got, want)
	}
	lint(t, m)
}

func ExampleNew() {
	m := promamqpidem.New(promamqpidem.Options{})
	reg := prometheus.NewRegistry() // or prometheus.MustRegister(m)
	reg.MustRegister(m)
	cfg := amqpidem.Config{Queue: "payments", Observer: m}
	_ = cfg // amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{Config: cfg, ...}, handler)

	// What a dead-lettered delivery does to the metrics.
	m.Observe(context.Background(), amqpidem.Event{Queue: "payments", Outcome: amqpidem.DeadLettered, Reason: "permanent failure"})
	text, _ := testutil.GatherAndFormat(reg, expfmt.TypeTextPlain, "amqpidem_messages_total")
	for line := range strings.Lines(string(text)) {
		if !strings.HasPrefix(line, "#") {
			fmt.Print(line)
		}
	}
	// Output: amqpidem_messages_total{outcome="dead_lettered",queue="payments",reason="permanent failure"} 1
}
