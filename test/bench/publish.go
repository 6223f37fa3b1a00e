package main

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// The publish variant (issue 40): what a user does without the outbox.
// unique, but the handler publishes its follow-up message itself, inside
// the handler, through amqpidem.Publisher (confirmed, mandatory, on a
// connection of its own): at-least-once, and a phantom message when the
// work rolls back after the publish. It publishes the outbox variant's
// message (stagedBody, 64 bytes) to the same kind of queue (outboxSink,
// openSink: of the run's queue type, consumed or not as -outbox-sink
// says), so that outbox/publish is the price of exactly-once publishing
// over at-least-once publishing.

// publishingHandler publishes one message to queue sink (through the
// default exchange) with pub and returns no result. Its MessageId is
// derived from the delivery's, as a user picks one from the operation.
func publishingHandler(pub *amqpidem.Publisher, sink string) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		return nil, pub.Publish(ctx, "", sink, amqp.Publishing{
			ContentType: "application/octet-stream",
			MessageId:   d.MessageId + ".follow-up",
			Body:        stagedBody,
		})
	})
}

// publishing is the publish variant's consumer and its Publisher, which
// stop closes once the consumer is gone.
type publishing struct {
	*idem
	pub *amqpidem.Publisher
}

func (p *publishing) stop(ctx context.Context) error {
	err := p.idem.stop(ctx)
	p.pub.Close()
	return err
}

// startPublishing starts the publish variant's consumer on queue, its
// Publisher dialling a connection of its own.
func (e *env) startPublishing(ctx context.Context, store lock.Store, cfg idemConfig, t *tally) (consumer, error) {
	url := e.opts.AMQPURL
	pub := amqpidem.DialPublisher(func() (*amqp.Connection, error) { return amqp.Dial(url) }, nil)
	cfg.handler = publishingHandler(pub, outboxSink(cfg.queue))
	i, err := startIdem(ctx, store, cfg, t)
	if err != nil {
		pub.Close()
		return nil, err
	}
	return &publishing{idem: i, pub: pub}, nil
}
