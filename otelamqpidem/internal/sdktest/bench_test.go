package sdktest_test

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/otelamqpidem"
)

// BenchmarkTracerPerMessage is what one message costs the Tracer with a
// recording SDK: Start (extracting the producer's context), one Inject (a
// copy's headers) and End. Spans go to an in-memory recorder, which is
// cleared as it goes.
func BenchmarkTracerPerMessage(b *testing.B) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	tr := otelamqpidem.NewTracer(otelamqpidem.WithTracerProvider(tp),
		otelamqpidem.WithPropagators(propagation.TraceContext{}))
	d := &amqp.Delivery{Exchange: "orders", RoutingKey: "created", MessageId: "order-1", DeliveryTag: 7, Body: make([]byte, 200),
		Headers: amqp.Table{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}
	ev := amqpidem.Event{Queue: "orders", Key: "order-1", Outcome: amqpidem.Completed, Attempt: 1, Fence: 42, Handler: time.Millisecond}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		ctx := tr.Start(context.Background(), "orders", d)
		tr.Inject(ctx, amqp.Table{})
		tr.End(ctx, ev)
		if i%1024 == 0 {
			rec.Reset()
		}
	}
}

// BenchmarkMeterPerMessage is what one completed message costs the Meter
// with the SDK's metrics: its event, its handler's start and end, and two
// store calls.
func BenchmarkMeterPerMessage(b *testing.B) {
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	defer mp.Shutdown(context.Background())
	m, err := otelamqpidem.NewMeter(otelamqpidem.WithMeterProvider(mp))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	info := amqpidem.Info{Queue: "orders", Key: "k", Attempt: 1}
	ev := amqpidem.Event{Queue: "orders", Outcome: amqpidem.Completed, Handler: time.Millisecond, Total: 2 * time.Millisecond, Published: time.Now()}
	b.ReportAllocs()
	for b.Loop() {
		m.ObserveStore(ctx, amqpidem.StoreCall{Queue: "orders", Op: "acquire", Leases: 1, Duration: time.Millisecond})
		m.HandlerStarted(ctx, info)
		m.HandlerEnded(ctx, info)
		m.ObserveStore(ctx, amqpidem.StoreCall{Queue: "orders", Op: "complete", Leases: 1, Duration: time.Millisecond})
		m.Observe(ctx, ev)
	}
}
