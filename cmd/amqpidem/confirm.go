package main

import (
	"context"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// confirmer publishes one message at a time, mandatory, on a channel in
// confirm mode, and waits for the broker's answer.
type confirmer struct {
	ch      *amqp.Channel
	returns chan amqp.Return
}

func newConfirmer(conn *amqp.Connection) (*confirmer, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, withCode(exitFailed, "RabbitMQ: opening a publishing channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return nil, withCode(exitFailed, "RabbitMQ: confirm mode: %w", err)
	}
	return &confirmer{ch: ch, returns: ch.NotifyReturn(make(chan amqp.Return, 1))}, nil
}

// publish sends msg and returns nil once the broker confirmed it routed
// to a queue; an error otherwise (returned as unroutable, nacked, or no
// answer within timeout).
func (c *confirmer) publish(ctx context.Context, exchange, key string, msg amqp.Publishing, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		return err
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("no confirm: %w", err)
	}
	// A mandatory message no queue took comes back before its confirm.
	select {
	case r := <-c.returns:
		return fmt.Errorf("unroutable: %d %s", r.ReplyCode, r.ReplyText)
	default:
	}
	if !acked {
		return fmt.Errorf("the broker refused it (nack)")
	}
	return nil
}
