package amqpidem_test

import (
	"context"
	"log"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// A batch handler stages a follow-up message per delivery, in that
// delivery's own outbox: stored with its record, published before its
// ack, once.
func ExampleDeliveryContext() {
	h := amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		// write the batch's effects ...
		for _, d := range ds {
			dctx := amqpidem.DeliveryContext(ctx, d)
			info, _ := amqpidem.FromContext(dctx) // d's key, attempt and fence
			if err := amqpidem.Stage(dctx, "", "shipping", amqp.Publishing{Body: []byte(info.Key)}); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	_ = h
}

// A delivery loop of one's own, with batches: Handle from a goroutine per
// delivery, so that the deliveries gather.
func ExampleWrapBatch() {
	conn, err := amqp.Dial("amqp://guest:guest@127.0.0.1:5672/")
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	store, _ := lock.NewRedisStore(redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"}), lock.Config{})
	w, err := amqpidem.WrapBatch(conn, store, amqpidem.Config{Queue: "orders"},
		amqpidem.BatchOptions{Size: 50, Wait: 10 * time.Millisecond},
		amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			return nil, nil // place the orders
		}))
	if err != nil {
		log.Fatal(err)
	}
	defer w.Shutdown(context.Background())

	ch, _ := conn.Channel()
	_ = ch.Qos(100, 0, false) // at least BatchOptions.Size
	msgs, _ := ch.Consume("orders", "", false, false, false, false, nil)
	for d := range msgs {
		go w.Handle(context.Background(), d) // blocks until d's batch ran and d is settled
	}
}
