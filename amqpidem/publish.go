package amqpidem

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Publisher publishes the messages an amqpidem consumer takes: each one
// with a MessageId (its idempotency key under the default Config.Key),
// mandatory (a message no queue takes is an error, not dropped silently)
// and confirmed by the broker before Publish returns. It is the producer's
// half of exactly-once: when Publish returns an error the message may or
// may not have been taken, so publish it again with the same MessageId,
// and the consumer runs it once.
//
// Publisher is safe for concurrent use. Concurrent publishes share
// confirm-mode channels, up to 16 awaiting their confirm on each and 64
// channels: a returned message fails its own Publish, matched by its
// MessageId, and when the broker closes a channel over one message (an
// exchange that does not exist, a property it refuses), the other
// publishes in flight on it are published again, each alone on a channel,
// so that only the one the broker refuses fails with a refusal
// (IsRefused); a message the broker took before it closed the channel so
// reaches its queue twice, with the same MessageId. Close it when done.
type Publisher struct {
	p   *publisher
	own *pubConn // the connection DialPublisher dials, closed by Close; nil for NewPublisher
}

// NewPublisher returns a Publisher opening its channels with conn (an
// *amqp.Connection will do; RabbitMQ advises a connection for publishing
// apart from the one consuming). It makes no network call. Publishes on
// an *amqp.Connection with automatic recovery on (amqp.Config.Recovery)
// fail with ErrAutoRecovery.
func NewPublisher(conn ChannelOpener) *Publisher {
	return &Publisher{p: newPublisher(conn, queueClassic)}
}

// DialPublisher returns a Publisher on a connection of its own, dialled
// with dial when the first publish needs it and again after it closed (a
// broker restart, a lost network): a long-lived producer, such as a relay,
// need not watch the connection itself. Close closes that connection. It
// makes no network call; a dial error is the error of the publish that
// needed it. connection.blocked notifications (a resource alarm on the
// broker) are logged to log, or to slog.Default() when log is nil. A
// dialled connection with automatic recovery on (amqp.Config.Recovery) is
// closed, and the publish fails with ErrAutoRecovery.
func DialPublisher(dial func() (*amqp.Connection, error), log *slog.Logger) *Publisher {
	if log == nil {
		log = slog.Default()
	}
	own := newPubConn(userDial(dial), false, log, "")
	return &Publisher{p: newPublisher(own, queueClassic), own: own}
}

// Publish sends msg to exchange with routing key key and waits until the
// broker confirms it or ctx ends. msg.MessageId is required: pick it from
// the operation (an order id, a payment id), never per call, or a retried
// publish is a new operation. A zero DeliveryMode is made Persistent.
//
// It returns ErrNoKey without a MessageId, ErrUnroutable when no queue was
// bound to take the message, ErrNotConfirmed when it was not confirmed
// (nacked, or its channel closed: by the broker over the message, or with
// the connection), and a connection error otherwise; IsRefused tells a
// refusal of the message from a broker or network that failed. After any
// error but ErrNoKey, publish again with the same MessageId.
func (p *Publisher) Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if msg.MessageId == "" {
		return fmt.Errorf("%w: Publisher.Publish needs msg.MessageId, the operation's idempotency key", ErrNoKey)
	}
	if msg.DeliveryMode == 0 {
		msg.DeliveryMode = amqp.Persistent
	}
	now := time.Now()
	if msg.Timestamp.IsZero() {
		msg.Timestamp = now
	}
	if _, ok := msg.Headers[HeaderTimestampMillis]; !ok {
		h := make(amqp.Table, len(msg.Headers)+1)
		for k, v := range msg.Headers {
			h[k] = v
		}
		h[HeaderTimestampMillis] = now.UnixMilli()
		msg.Headers = h
	}
	return p.p.publish(ctx, exchange, key, msg)
}

// Close closes the Publisher's channels (those in use once their publish
// returns). Publishing after Close fails. Close does not close the conn of
// NewPublisher; it closes the connection DialPublisher dialled, within a
// second, and waits for its channels. A channel is closed in the
// background, since a connection the broker has blocked (a resource
// alarm) answers channel.close only once unblocked: on NewPublisher's
// conn, such a close ends when the broker unblocks the connection or it
// closes.
func (p *Publisher) Close() {
	p.p.close()
	if p.own != nil {
		p.own.close()
		p.p.wait()
	}
}
