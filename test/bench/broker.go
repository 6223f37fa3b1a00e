package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/secret"
)

// broker is the harness's own connection to RabbitMQ, for declaring,
// deleting and filling queues. It remembers every queue it declared so that
// close can delete whatever a failed run left behind.
type broker struct {
	conn *amqp.Connection

	mu     sync.Mutex
	queues map[string]bool
}

func dialBroker(url string) (*broker, error) {
	// amqp091-go's parse error quotes the URL, password included.
	if _, err := amqp.ParseURI(url); err != nil {
		return nil, secret.ParseError("amqp", url, err)
	}
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
	if err != nil {
		return nil, fmt.Errorf("amqp %s: %w", redactURL(url), err)
	}
	return &broker{conn: conn, queues: map[string]bool{}}, nil
}

// version is the server's product version, as it announces it.
func (b *broker) version() string {
	if v, ok := b.conn.Properties["version"].(string); ok {
		return v
	}
	return "?"
}

// queueArgs are the arguments every queue of type qt is declared with, by
// the harness and by amqpidem's default declaration alike.
func queueArgs(qt string) amqp.Table {
	return amqp.Table{"x-queue-type": qt}
}

// declare declares a durable queue of type qt, empty.
func (b *broker) declare(name, qt string) error {
	b.mu.Lock()
	b.queues[name] = true
	b.mu.Unlock()
	ch, err := b.conn.Channel()
	if err != nil {
		return fmt.Errorf("declare %s: %w", name, err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(name, true, false, false, false, queueArgs(qt)); err != nil {
		return fmt.Errorf("declare %s: %w", name, err)
	}
	if _, err := ch.QueuePurge(name, false); err != nil {
		return fmt.Errorf("purge %s: %w", name, err)
	}
	return nil
}

// depth is the number of messages ready in queue name.
func (b *broker) depth(name string) (int, error) {
	ch, err := b.conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("inspect %s: %w", name, err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("inspect %s: %w", name, err)
	}
	return q.Messages, nil
}

// remove deletes queue name and the queues amqpidem may have made for it
// (its dead-letter queue and the delay tier of the default delays). Deleting
// a queue that does not exist is not an error for RabbitMQ.
func (b *broker) remove(name string) error {
	b.mu.Lock()
	delete(b.queues, name)
	b.mu.Unlock()
	var errs []error
	for _, q := range []string{name, name + ".dlq", name + ".delay.5000"} {
		ch, err := b.conn.Channel()
		if err != nil {
			return fmt.Errorf("delete %s: %w", q, err)
		}
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			errs = append(errs, fmt.Errorf("delete %s: %w", q, err))
		}
		_ = ch.Close()
	}
	return errors.Join(errs...)
}

// close deletes the queues still remembered and closes the connection.
func (b *broker) close() error {
	b.mu.Lock()
	left := make([]string, 0, len(b.queues))
	for q := range b.queues {
		left = append(left, q)
	}
	b.mu.Unlock()
	var errs []error
	for _, q := range left {
		errs = append(errs, b.remove(q))
	}
	errs = append(errs, b.conn.Close())
	return errors.Join(errs...)
}

// message is what every publish sends: a persistent message whose
// message-id is the idempotency key.
func message(id string, body []byte) amqp.Publishing {
	return amqp.Publishing{
		MessageId:    id,
		DeliveryMode: amqp.Persistent,
		ContentType:  "application/octet-stream",
		Body:         body,
	}
}

// prefill publishes n messages with ids idPrefix+"0" .. idPrefix+"<n-1>" to
// queue through a confirm-mode channel, keeping up to window confirms
// outstanding, and returns once the broker confirmed every one.
//
// It is not amqpidem.Publisher, which waits for each message's confirm
// (up to 8 at once, one per channel): filling a queue with 10,000 to 50,000
// messages of 128 bytes that way took 3 to 6 times as long on the 2-core
// development machine (classic 1,700-3,400 msg/s against 5,400-11,000
// pipelined, quorum 3,200-5,500 against 21,000-25,000): minutes more for a
// full make bench, which prefills N messages (the bare consumer's rate
// times -duration) for every round of every variant.
func (b *broker) prefill(ctx context.Context, queue, idPrefix string, n int, body []byte) error {
	ch, err := b.conn.Channel()
	if err != nil {
		return fmt.Errorf("prefill %s: %w", queue, err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("prefill %s: confirm mode: %w", queue, err)
	}
	const window = 2048
	pending := make([]*amqp.DeferredConfirmation, 0, window)
	settle := func(keep int) error {
		done := 0
		for ; len(pending)-done > keep; done++ {
			ok, err := pending[done].WaitContext(ctx)
			if err != nil {
				return fmt.Errorf("prefill %s: waiting for confirm: %w", queue, err)
			}
			if !ok {
				return fmt.Errorf("prefill %s: broker nacked message %d", queue, pending[done].DeliveryTag)
			}
		}
		pending = append(pending[:0], pending[done:]...)
		return nil
	}
	for i := range n {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false,
			message(idPrefix+strconv.Itoa(i), body))
		if err != nil {
			return fmt.Errorf("prefill %s: publish: %w", queue, err)
		}
		pending = append(pending, dc)
		if len(pending) == window {
			if err := settle(window / 2); err != nil {
				return err
			}
		}
	}
	return settle(0)
}

// paced publishes n messages to each of queues at a steady rate (messages
// per second, to each) with ids idPrefix+"<i>", message i to every queue
// back to back, the first of them rotating with i, calling sent(q, i, t)
// with the time just before the publish of message i to queues[q]. The
// channel is in confirm mode; confirms are counted as they come and
// waited for at the end, never per message (as amqpidem.Publisher does),
// which would hold the pace to the confirms' round trips. It returns the
// rate achieved and when the last message was handed to the broker.
func (b *broker) paced(ctx context.Context, queues []string, idPrefix string, n int, rate float64, body []byte, sent func(q, i int, t time.Time)) (achieved float64, last time.Time, err error) {
	name := strings.Join(queues, ", ")
	ch, err := b.conn.Channel()
	if err != nil {
		return 0, last, fmt.Errorf("publish %s: %w", name, err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return 0, last, fmt.Errorf("publish %s: confirm mode: %w", name, err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 1024))
	var acked, nacked atomic.Int64
	drained := make(chan struct{})
	go func() {
		defer close(drained)
		for c := range confirms { // closed when the channel closes
			if c.Ack {
				acked.Add(1)
			} else {
				nacked.Add(1)
			}
		}
	}()
	defer func() {
		_ = ch.Close()
		<-drained
	}()

	interval := float64(time.Second) / rate
	start := time.Now()
	for i := 0; i < n; {
		due := min(n, int(float64(time.Since(start))/interval)+1)
		for ; i < due; i++ {
			msg := message(idPrefix+strconv.Itoa(i), body)
			for k := range queues {
				q := (i + k) % len(queues) // the first queue rotates
				sent(q, i, time.Now())
				if err := ch.PublishWithContext(ctx, "", queues[q], false, false, msg); err != nil {
					return 0, last, fmt.Errorf("publish %s: %w", queues[q], err)
				}
			}
		}
		if i < n {
			next := start.Add(time.Duration(float64(i) * interval))
			if err := sleepCtx(ctx, time.Until(next)); err != nil {
				return 0, last, err
			}
		}
	}
	last = time.Now()
	achieved = float64(n) / last.Sub(start).Seconds()
	// Wait (bounded by ctx) for the broker to confirm everything.
	for acked.Load()+nacked.Load() < int64(n*len(queues)) {
		if err := sleepCtx(ctx, time.Millisecond); err != nil {
			return achieved, last, fmt.Errorf("publish %s: waiting for confirms: %w", name, err)
		}
	}
	if k := nacked.Load(); k > 0 {
		return achieved, last, fmt.Errorf("publish %s: broker nacked %d messages", name, k)
	}
	return achieved, last, nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// redactURL hides the password of an AMQP URL, also of one that does not
// parse.
func redactURL(url string) string { return secret.URL(url) }
