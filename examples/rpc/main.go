// Command rpc is an idempotent RPC server built with amqpidem.Wrap inside a
// delivery loop the program keeps itself: ch.Consume, then w.Handle for
// each delivery.
//
// A client sends a request with ReplyTo (its exclusive reply queue) and a
// CorrelationId, then sends the same request again, as a client that timed
// out and retried would: same MessageId, new CorrelationId. The handler
// runs once; the second request is a duplicate, answered with the result
// stored by the first, so both replies carry the same quote. The program
// exits non-zero otherwise.
//
// Run it with `go run ./examples/rpc` once Redis and RabbitMQ are up
// (`make services`). REDIS_ADDR and AMQP_URL override the defaults
// 127.0.0.1:6379 and amqp://guest:guest@127.0.0.1:5672/.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
	"github.com/amqpidem/amqpidem/lock"
)

const (
	requestID = "quote-request-8f3a" // the idempotency key: the client's request id
	timeLimit = 60 * time.Second
)

func main() { demo.Main("rpc", timeLimit, run) }

type quoteRequest struct {
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

type quote struct {
	QuoteID    string `json:"quote_id"`
	SKU        string `json:"sku"`
	Quantity   int    `json:"quantity"`
	TotalCents int    `json:"total_cents"`
}

func run(ctx context.Context) (err error) {
	log := demo.Logger()
	env, err := demo.Connect(ctx, "rpc")
	if err != nil {
		return err
	}
	defer func() {
		if cerr := env.Close(); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()

	store, err := lock.NewRedisStore(env.Redis, lock.Config{Prefix: env.Name, Logger: log})
	if err != nil {
		return err
	}
	if err := store.Check(ctx); err != nil {
		return err
	}

	// ---- server ----
	var runs atomic.Int32
	handler := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		runs.Add(1)
		var req quoteRequest
		if err := json.Unmarshal(d.Body, &req); err != nil {
			return nil, amqpidem.Permanent(fmt.Errorf("bad request: %w", err))
		}
		select { // pricing takes a while
		case <-time.After(200 * time.Millisecond):
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
		// A fresh quote id on every execution: a reply that carries the
		// first one was not computed again.
		q := quote{QuoteID: "q-" + rand.Text()[:8], SKU: req.SKU, Quantity: req.Quantity, TotalCents: 4999 * req.Quantity}
		log.Info("quote computed", "key", d.MessageId, "quote_id", q.QuoteID, "correlation_id", d.CorrelationId)
		return json.Marshal(q) // stored, and sent to ReplyTo
	})

	tally := demo.NewTally()
	w, err := amqpidem.Wrap(env.Conn, store, amqpidem.Config{
		Queue:     env.Name,
		LeaseTTL:  time.Second,
		Retention: time.Hour,
		Logger:    log,
		Observer:  tally,
	}, handler)
	if err != nil {
		return err
	}
	srv, err := env.Conn.Channel()
	if err != nil {
		return err
	}
	defer srv.Close()
	if _, err := srv.QueueDeclare(env.Name, true, false, false, false, nil); err != nil {
		return err
	}
	if err := srv.Qos(8, 0, false); err != nil {
		return err
	}
	deliveries, err := srv.Consume(env.Name, "rpc-server", false, false, false, false, nil)
	if err != nil {
		return err
	}
	// The delivery loop: one goroutine per delivery, at most 8 at a time
	// (the prefetch). Handle settles each delivery: ack, delayed requeue or
	// dead letter, and sends the reply.
	var loop sync.WaitGroup
	loop.Go(func() {
		var handlers sync.WaitGroup
		defer handlers.Wait()
		for d := range deliveries {
			handlers.Go(func() { w.Handle(ctx, d) })
		}
	})
	defer func() {
		_ = srv.Cancel("rpc-server", false) // closes deliveries: the loop ends
		loop.Wait()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if serr := w.Shutdown(sctx); serr != nil {
			err = errors.Join(err, fmt.Errorf("shutdown: %w", serr))
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
	pub     *demo.Publisher
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
	if c.pub, err = demo.NewPublisher(conn); err != nil {
		conn.Close()
		return nil, err
	}
	return c, nil
}

// call sends one request and waits up to 10 s for the reply with its
// correlation id.
func (c *client) call(ctx context.Context, log *slog.Logger, requestID, corrID string, body []byte) ([]byte, error) {
	log.Info("client: sending request", "message_id", requestID, "correlation_id", corrID, "reply_to", c.replyTo)
	err := c.pub.Publish(ctx, c.queue, amqp.Publishing{
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

func (c *client) close() { c.conn.Close() }
