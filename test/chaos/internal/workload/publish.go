package workload

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
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

// parallel is how many publishes wait for their confirms at once:
// amqpidem.Publisher keeps up to 8 confirm-mode channels, one publish in
// flight on each.
const parallel = 8

// Publisher publishes a workload's messages on a connection of its own,
// through amqpidem.Publisher (persistent, mandatory, confirmed) when they
// have a message-id. A message without one, which amqpidem.Publisher
// refuses (the missing-key cases of the bad-input scenario), goes through a
// confirm-mode channel of its own. It is not safe for concurrent use.
type Publisher struct {
	conn *amqp.Connection
	ch   *amqp.Channel
	pub  *amqpidem.Publisher
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
	return &Publisher{conn: conn, ch: ch, pub: amqpidem.NewPublisher(conn)}, nil
}

// Channel returns a channel of the publisher's connection, for
// declarations.
func (p *Publisher) Channel() *amqp.Channel { return p.ch }

// Close closes the connection.
func (p *Publisher) Close() error {
	p.pub.Close()
	return p.conn.Close()
}

// Publish sends msgs to queue through the default exchange and waits for
// every confirm, up to parallel publishes at a time, so they reach the
// queue in about the order given (those without a message-id last). It
// fails if the broker returns or nacks any of them.
func (p *Publisher) Publish(ctx context.Context, queue string, msgs []Message) error {
	var keyless []Message
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	next := make(chan Message)
	var wg sync.WaitGroup
	for range parallel {
		wg.Go(func() {
			for m := range next {
				if err := p.pub.Publish(ctx, "", queue, publishing(m)); err != nil {
					cancel(fmt.Errorf("workload: publish %q to %q: %w", m.ID, queue, err))
					return
				}
			}
		})
	}
feed:
	for _, m := range msgs {
		if m.ID == "" {
			keyless = append(keyless, m)
			continue
		}
		select {
		case next <- m:
		case <-ctx.Done():
			break feed
		}
	}
	close(next)
	wg.Wait()
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return p.publishKeyless(ctx, queue, keyless)
}

// publishKeyless publishes msgs, which have no message-id, on a
// confirm-mode channel opened for the purpose, and waits for their
// confirms.
func (p *Publisher) publishKeyless(ctx context.Context, queue string, msgs []Message) error {
	if len(msgs) == 0 {
		return nil
	}
	ch, err := p.conn.Channel()
	if err != nil {
		return fmt.Errorf("workload: channel: %w", err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("workload: confirm mode: %w", err)
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, len(msgs)))
	pending := make([]*amqp.DeferredConfirmation, 0, len(msgs))
	for _, m := range msgs {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, publishing(m))
		if err != nil {
			return fmt.Errorf("workload: publish to %q: %w", queue, err)
		}
		pending = append(pending, dc)
	}
	for _, dc := range pending {
		ok, err := dc.WaitContext(ctx)
		if err != nil {
			return fmt.Errorf("workload: waiting for confirms: %w", err)
		}
		if !ok {
			return errors.New("workload: the broker nacked a publish")
		}
	}
	select { // the broker sends a return before the confirm
	case r := <-returns:
		return fmt.Errorf("workload: a message without message-id returned: %d %s", r.ReplyCode, r.ReplyText)
	default:
	}
	return nil
}

// publishing is m as published: persistent JSON.
func publishing(m Message) amqp.Publishing {
	return amqp.Publishing{
		MessageId:    m.ID,
		DeliveryMode: amqp.Persistent,
		ContentType:  "application/json",
		Headers:      m.Headers,
		Body:         m.Body,
	}
}
