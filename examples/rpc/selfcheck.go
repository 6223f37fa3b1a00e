// This file is not part of the template: copy main.go alone.
//
// It turns `go run ./examples/rpc` into a self-checking run of main.go's
// server: a client sends a request with ReplyTo (its exclusive reply
// queue) and a CorrelationId, then sends the same request again, as a
// client that timed out and retried would: same MessageId, new
// CorrelationId. The handler runs once; the second request is a duplicate,
// answered with the result stored by the first, so both replies carry the
// same quote. The program exits non-zero otherwise. It uses a queue and
// Redis prefix of its own and deletes them at the end.

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
)

// init runs the self-check in place of main, and exits.
func init() {
	if !testing.Testing() {
		demo.Main("rpc", timeLimit, selfCheck)
	}
}

const (
	requestID = "quote-request-8f3a" // the idempotency key: the client's request id
	timeLimit = 60 * time.Second
)

func selfCheck(ctx context.Context) (err error) {
	log := demo.Logger()
	// The store is shared by every consumer of the run: the lease on a key
	// is what keeps two of them from running it at once.
	env, store, err := demo.Start(ctx, "rpc", log)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := env.Close(); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()

	// ---- server: main.go's, with its handler runs counted ----
	var runs atomic.Int32
	quotes := quoteHandler(log)
	counted := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		runs.Add(1)
		return quotes.Handle(ctx, d)
	})
	tally := demo.NewTally()
	cfg := config(env.Name, log)
	cfg.Observer = tally
	w, err := amqpidem.Wrap(env.Conn, store, cfg, counted)
	if err != nil {
		return err
	}
	stop, stopServer := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serve(stop, env.Conn, w, env.Name, 10*time.Second) }()
	defer func() {
		stopServer()
		if serr := <-served; serr != nil {
			err = errors.Join(err, fmt.Errorf("server: %w", serr))
		}
	}()

	// ---- client, on a connection of its own ----
	client, err := newClient(env.AMQPURL, env.Name+"-client", env.Name)
	if err != nil {
		return err
	}
	defer client.close()
	body, _ := json.Marshal(quoteRequest{SKU: "chair-oak", Quantity: 4})

	first, err := client.call(ctx, log, requestID, "corr-1", body)
	if err != nil {
		return err
	}
	// The client retries: same request id, new correlation id.
	second, err := client.call(ctx, log, requestID, "corr-2", body)
	if err != nil {
		return err
	}

	// Handle reports after it replied: wait for both outcomes.
	err = tally.Wait(ctx, func(c demo.Counts) bool {
		return c.Key(requestID, amqpidem.Completed) == 1 && c.Key(requestID, amqpidem.Duplicate) == 1
	})
	if err != nil {
		return fmt.Errorf("waiting for the server's outcomes: %w", err)
	}

	var problems []string
	fmt.Printf("\nsummary\n")
	fmt.Printf("  %-16s %s\n", "reply to corr-1", first)
	fmt.Printf("  %-16s %s\n", "reply to corr-2", second)
	fmt.Printf("  %-16s %d\n", "handler ran", runs.Load())
	if !bytes.Equal(first, second) {
		problems = append(problems, "the two replies differ")
	}
	if n := runs.Load(); n != 1 {
		problems = append(problems, fmt.Sprintf("the handler ran %d times, want once", n))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	fmt.Printf("  %-16s both replies carry the stored result; the handler ran once\n", "ok")
	return nil
}

// client sends requests and waits for their replies on an exclusive,
// server-named reply queue.
type client struct {
	conn    *amqp.Connection
	ch      *amqp.Channel
	pub     *amqpidem.Publisher
	queue   string // where requests go
	replyTo string
	replies <-chan amqp.Delivery
}

func newClient(url, name, queue string) (*client, error) {
	conn, err := demo.Dial(url, name)
	if err != nil {
		return nil, err
	}
	c := &client{conn: conn, queue: queue}
	if c.ch, err = conn.Channel(); err != nil {
		conn.Close()
		return nil, err
	}
	q, err := c.ch.QueueDeclare("", false, true, true, false, nil) // exclusive, deleted with the connection
	if err != nil {
		conn.Close()
		return nil, err
	}
	c.replyTo = q.Name
	if c.replies, err = c.ch.Consume(q.Name, "", true, true, false, false, nil); err != nil {
		conn.Close()
		return nil, err
	}
	c.pub = amqpidem.NewPublisher(conn)
	return c, nil
}

// call sends one request and waits up to 10 s for the reply with its
// correlation id.
func (c *client) call(ctx context.Context, log *slog.Logger, requestID, corrID string, body []byte) ([]byte, error) {
	log.Info("client: sending request", "message_id", requestID, "correlation_id", corrID, "reply_to", c.replyTo)
	err := c.pub.Publish(ctx, "", c.queue, amqp.Publishing{
		MessageId:     requestID,
		CorrelationId: corrID,
		ReplyTo:       c.replyTo,
		ContentType:   "application/json",
		Body:          body,
	})
	if err != nil {
		return nil, err
	}
	timeout := time.NewTimer(10 * time.Second)
	defer timeout.Stop()
	for {
		select {
		case d, ok := <-c.replies:
			if !ok {
				return nil, errors.New("client: reply queue closed")
			}
			if d.CorrelationId != corrID {
				log.Warn("client: reply for another call", "correlation_id", d.CorrelationId)
				continue
			}
			var q quote
			_ = json.Unmarshal(d.Body, &q)
			log.Info("client: got reply", "correlation_id", corrID, "quote_id", q.QuoteID)
			return d.Body, nil
		case <-timeout.C:
			return nil, fmt.Errorf("client: no reply to %s within 10s", corrID)
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
}

func (c *client) close() {
	c.pub.Close()
	c.conn.Close()
}
