package demo

import (
	"context"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Publisher publishes persistent messages to a queue through the default
// exchange and waits for the broker's confirm, so that a message counted
// as published is in the queue. It is safe for concurrent use.
type Publisher struct {
	mu      sync.Mutex
	ch      *amqp.Channel
	returns chan amqp.Return
}

// NewPublisher opens a confirm-mode channel on conn.
func NewPublisher(conn *amqp.Connection) (*Publisher, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Confirm(false); err != nil {
		ch.Close()
		return nil, err
	}
	return &Publisher{ch: ch, returns: ch.NotifyReturn(make(chan amqp.Return, 1))}, nil
}

// Publish sends msg to queue (mandatory, persistent) and waits for the
// confirm. A message no queue took is an error.
func (p *Publisher) Publish(ctx context.Context, queue string, msg amqp.Publishing) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if msg.DeliveryMode == 0 {
		msg.DeliveryMode = amqp.Persistent
	}
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, msg)
	if err != nil {
		return fmt.Errorf("publish %s to %s: %w", msg.MessageId, queue, err)
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("publish %s to %s: %w", msg.MessageId, queue, err)
	}
	select {
	case r := <-p.returns: // the broker sends a return before the confirm
		return fmt.Errorf("publish %s to %s: returned: %s", msg.MessageId, queue, r.ReplyText)
	default:
	}
	if !acked {
		return fmt.Errorf("publish %s to %s: nacked by the broker", msg.MessageId, queue)
	}
	return nil
}

// Close closes the channel.
func (p *Publisher) Close() error { return p.ch.Close() }
