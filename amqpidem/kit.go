package amqpidem

import (
	"context"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem/internal/kit"
	"github.com/amqpidem/amqpidem/lock"
)

// The processing of package amqpidemtest: a Wrapper's, without a broker.
func init() {
	kit.Wrap = func(store lock.Store, cfg, h any) (func(context.Context, kit.Broker, *amqp.Delivery) any, func(context.Context) error, error) {
		c := cfg.(Config)
		c.DelayInProcess = false // the copy is returned to the test, not waited for
		p, err := newProcessor(store, c, h.(Handler))
		if err != nil {
			return nil, nil, err
		}
		process := func(ctx context.Context, b kit.Broker, d *amqp.Delivery) any {
			return p.process(ctx, kitBroker{b}, d, nil)
		}
		return process, p.keeper.Shutdown, nil
	}
}

// kitBroker is a kit.Broker as the processing's broker.
type kitBroker struct{ b kit.Broker }

func (k kitBroker) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	return k.b.Publish(ctx, exchange, key, msg)
}

func (k kitBroker) publishAlone(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	return k.b.Publish(ctx, exchange, key, msg)
}

func (k kitBroker) declare(context.Context, string, amqp.Table, bool) error { return nil }

func (k kitBroker) forget(string) {}

func (k kitBroker) requeue(ctx context.Context, queue string, msg amqp.Publishing, delay time.Duration) error {
	return k.b.Requeue(ctx, queue, msg, delay)
}
