package kit

import (
	"context"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// Broker stands in for RabbitMQ: what the processing publishes goes to it.
type Broker interface {
	// Publish is a confirmed publish (a dead letter, a reply, a staged
	// message).
	Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error
	// Requeue sends msg, a copy of a delivery, back to queue after delay.
	Requeue(ctx context.Context, queue string, msg amqp.Publishing, delay time.Duration) error
}

// Wrap, set by package amqpidem, returns the processing a Wrapper does
// for cfg (an amqpidem.Config) and h (an amqpidem.Handler) on store:
// process processes one delivery, publishing to b, and returns its
// amqpidem.Event; stop ends the heartbeat keeper. The types are any so
// that this package need not import amqpidem, which imports it.
var Wrap func(store lock.Store, cfg, h any) (process func(ctx context.Context, b Broker, d *amqp.Delivery) any, stop func(context.Context) error, err error)
