package amqpidem_test

import (
	"context"
	"errors"
	"log"
	"os"
	"os/signal"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

func chargeCard(ctx context.Context, body []byte, fence int64) (string, error) {
	return "receipt-1", nil
}

// A payment consumer: one handler, run once per message id.
func ExampleNewConsumer() {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: "payments"})
	if err != nil {
		log.Fatal(err)
	}
	handler := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		info, _ := amqpidem.FromContext(ctx)
		receipt, err := chargeCard(ctx, d.Body, info.Fence)
		if errors.Is(err, errCardDeclined) {
			return nil, amqpidem.Permanent(err) // dead-letter, do not retry
		}
		return []byte(receipt), err // other errors are retried with backoff
	})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL:    "amqp://guest:guest@127.0.0.1:5672/",
		Config: amqpidem.Config{Queue: "payments", LeaseTTL: 30 * time.Second},
	}, handler)
	if err != nil {
		log.Fatal(err)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = c.Shutdown(shutdown)
	}()
	if err := c.Run(context.Background()); !errors.Is(err, amqpidem.ErrConsumerClosed) {
		log.Fatal(err)
	}
}

var errCardDeclined = errors.New("card declined")

// Wrapping one handler inside a delivery loop you keep.
func ExampleWrap() {
	conn, err := amqp.Dial("amqp://guest:guest@127.0.0.1:5672/")
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	store, _ := lock.NewRedisStore(redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"}), lock.Config{})
	w, err := amqpidem.Wrap(conn, store, amqpidem.Config{Queue: "orders"},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			return nil, nil // place the order
		}))
	if err != nil {
		log.Fatal(err)
	}
	defer w.Shutdown(context.Background())

	ch, _ := conn.Channel()
	_ = ch.Qos(32, 0, false)
	msgs, _ := ch.Consume("orders", "", false, false, false, false, nil)
	for d := range msgs {
		go w.Handle(context.Background(), d) // acks, requeues or dead-letters d
	}
}

// A handler calling a rate-limited API retries after the delay the API
// asks for; other errors by kind, through Config.RetryDelay.
func ExampleRetryAfter() {
	errRateLimited := errors.New("rate limited")
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		// resp, err := client.Do(req) ...
		retryAfter := 30 * time.Second // from the 429's Retry-After header
		return nil, amqpidem.RetryAfter(errRateLimited, retryAfter)
	})
	cfg := amqpidem.Config{
		Queue: "calls",
		RetryDelay: func(n int, err error, d *amqp.Delivery) time.Duration {
			if errors.Is(err, context.DeadlineExceeded) {
				return time.Duration(n) * 10 * time.Second // a slow API: back off gently
			}
			return time.Duration(1<<min(n, 8)) * time.Second
		},
	}
	_, _ = h, cfg
}
