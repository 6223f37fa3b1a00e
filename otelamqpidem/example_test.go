package otelamqpidem_test

import (
	"context"
	"log"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/otelamqpidem"
)

// A consumer traced and measured with OpenTelemetry. The program sets up
// the SDK (otel.SetTracerProvider, otel.SetMeterProvider) and the
// propagator; the Tracer and the Meter use the global ones.
func ExampleNewTracer() {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(
		propagation.TraceContext{}, propagation.Baggage{}))

	meter, err := otelamqpidem.NewMeter()
	if err != nil {
		log.Fatal(err)
	}
	store, err := lock.NewRedisStore(redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"}), lock.Config{Prefix: "orders"})
	if err != nil {
		log.Fatal(err)
	}
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		// ctx holds the delivery's span, a child of the producer's.
		_, span := otel.Tracer("orders").Start(ctx, "charge card")
		defer span.End()
		return []byte("charged"), nil
	})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL: "amqp://guest:guest@127.0.0.1:5672/",
		Config: amqpidem.Config{
			Queue:    "orders",
			Tracer:   otelamqpidem.NewTracer(),
			Observer: meter,
		},
	}, h)
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = c.Run(context.Background()) }()
}

// A producer puts its trace context into the message's headers before
// publishing, so that the consumer's span continues its trace.
func ExampleInject() {
	conn, err := amqp.Dial("amqp://guest:guest@127.0.0.1:5672/")
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	pub := amqpidem.NewPublisher(conn)
	defer pub.Close()

	ctx, span := otel.Tracer("checkout").Start(context.Background(), "send orders",
		trace.WithSpanKind(trace.SpanKindProducer))
	defer span.End()
	msg := amqp.Publishing{MessageId: "order-1042", Headers: amqp.Table{}, Body: []byte(`{"total":10}`)}
	otelamqpidem.Inject(ctx, msg.Headers)
	if err := pub.Publish(ctx, "", "orders", msg); err != nil {
		log.Fatal(err)
	}
}
