package workload

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Op is one operation of a workload: an id (the message-id, the
// idempotency key), the plan its handler follows, how many copies of it
// are published, and extra headers.
type Op struct {
	ID      string
	Plan    Plan
	Copies  int
	Headers amqp.Table
}

// Message is one message to publish.
type Message struct {
	// ID is the message-id property; empty publishes none.
	ID      string
	Body    []byte
	Headers amqp.Table
}

// Messages expands ops into their copies, shuffled with rng so that the
// copies of one operation arrive at different consumers at once.
func Messages(ops []Op, rng *rand.Rand) []Message {
	var msgs []Message
	for _, o := range ops {
		p := o.Plan
		p.Op = o.ID
		body := p.Body()
		for range max(o.Copies, 1) {
			msgs = append(msgs, Message{ID: o.ID, Body: body, Headers: o.Headers})
		}
	}
	rng.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	return msgs
}

// Storm makes n operations named prefix0 … prefix(n-1), each with 1 to
// maxCopies copies and up to maxWorkMS of work.
func Storm(prefix string, n, maxCopies, maxWorkMS int, rng *rand.Rand) []Op {
	ops := make([]Op, n)
	for i := range ops {
		ops[i] = Op{
			ID:     prefix + strconv.Itoa(i),
			Copies: 1 + rng.IntN(max(maxCopies, 1)),
			Plan:   Plan{WorkMS: rng.IntN(maxWorkMS + 1)},
		}
	}
	return ops
}

// window is how many publishes may wait for their confirms at once.
const window = 256

// Publisher publishes persistent, mandatory messages with confirms on a
// connection of its own. It is not safe for concurrent use.
type Publisher struct {
	conn    *amqp.Connection
	ch      *amqp.Channel
	returns chan amqp.Return
}

// Dial opens a publisher's connection, named name in the broker.
func Dial(url, name string) (*Publisher, error) {
	conn, err := amqp.DialConfig(url, amqp.Config{Properties: amqp.Table{"connection_name": name}})
	if err != nil {
		return nil, fmt.Errorf("workload: dial: %w", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("workload: channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		conn.Close()
		return nil, fmt.Errorf("workload: confirm mode: %w", err)
	}
	return &Publisher{conn: conn, ch: ch, returns: ch.NotifyReturn(make(chan amqp.Return, window))}, nil
}

// Channel returns the publisher's channel, for declarations.
func (p *Publisher) Channel() *amqp.Channel { return p.ch }

// Close closes the connection.
func (p *Publisher) Close() error { return p.conn.Close() }

// Publish sends msgs to queue through the default exchange and waits for
// every confirm. It fails if the broker returns or nacks any of them.
func (p *Publisher) Publish(ctx context.Context, queue string, msgs []Message) error {
	pending := make([]*amqp.DeferredConfirmation, 0, window)
	wait := func() error {
		for _, dc := range pending {
			ok, err := dc.WaitContext(ctx)
			if err != nil {
				return fmt.Errorf("workload: waiting for confirms: %w", err)
			}
			if !ok {
				return errors.New("workload: the broker nacked a publish")
			}
		}
		pending = pending[:0]
		select {
		case r := <-p.returns:
			return fmt.Errorf("workload: message %q returned: %d %s", r.MessageId, r.ReplyCode, r.ReplyText)
		default:
		}
		return nil
	}
	for _, m := range msgs {
		dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp.Publishing{
			MessageId:    m.ID,
			DeliveryMode: amqp.Persistent,
			ContentType:  "application/json",
			Headers:      m.Headers,
			Body:         m.Body,
		})
		if err != nil {
			return fmt.Errorf("workload: publish to %q: %w", queue, err)
		}
		pending = append(pending, dc)
		if len(pending) == window {
			if err := wait(); err != nil {
				return err
			}
		}
	}
	return wait()
}
