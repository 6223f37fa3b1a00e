// Command rpc is an idempotent RPC server: it answers the price-quote
// requests of the queue "quotes" with amqpidem.Wrap, inside a delivery loop
// it keeps itself (ch.Consume, then w.Handle for each delivery).
//
// A request's message-id is its idempotency key. A client that timed out
// and sends its request again, with the same message-id (and a new
// correlation id), gets the quote computed the first time: the handler
// runs once, and the stored result is sent to the request's ReplyTo with
// the request's CorrelationId, as the first reply was.
//
// This file is a template: a whole program that imports only public
// packages. Copy it into your own module and replace price with your own
// work. REDIS_ADDR (default 127.0.0.1:6379) and AMQP_URL (default
// amqp://guest:guest@127.0.0.1:5672/) say where Redis and RabbitMQ are.
// SIGINT or SIGTERM stops it gracefully: the requests being answered get up
// to 30 s to finish; any still running then are cancelled and go back to
// the queue. It does not reconnect: when the connection is lost it exits
// with an error, for its supervisor to restart it (amqpidem.Consumer, as in
// the orders example, reconnects by itself).
//
// In this repository `go run ./examples/rpc` also compiles selfcheck.go,
// which runs a self-checking demo of this server, with a client, instead;
// `go run ./examples/rpc/main.go` runs this file alone.
package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/lmittmann/tint"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

const (
	queue = "quotes"
	// prefetch bounds the requests being answered at once.
	prefetch = 8
	// shutdownGrace is how long the requests being answered get to finish
	// on SIGINT or SIGTERM.
	shutdownGrace = 30 * time.Second
)

func main() {
	// A hostile message can put terminal escapes into the keys and errors
	// logged, and tint writes values as they are: amqpidem.EscapeControl
	// escapes them.
	log := slog.New(tint.NewTextHandler(os.Stderr, &tint.Options{Level: slog.LevelDebug, TimeFormat: time.TimeOnly,
		ReplaceAttr: amqpidem.EscapeControl}))
	if err := run(log); err != nil {
		log.Error("rpc stopped", "error", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	// The store keeps one record per request id in Redis: the lease while
	// the request is answered, then the result for Config.Retention.
	rdb := redis.NewClient(&redis.Options{Addr: envOr("REDIS_ADDR", "127.0.0.1:6379")})
	defer rdb.Close()
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: "rpc", Logger: log})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Check fails if Redis cannot be reached, and warns about an eviction
	// policy that could lose records.
	if err := store.Check(ctx); err != nil {
		return err
	}

	url := envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	if _, err := amqp.ParseURI(url); err != nil {
		// Its error quotes the URL, password and all: say less.
		return errors.New("AMQP_URL does not parse as an AMQP URL (a '%', '#', '/' or '?' in the password must be %-escaped)")
	}
	conn, err := amqp.Dial(url)
	if err != nil {
		return err
	}
	defer conn.Close()
	// The Wrapper publishes on channels of its own on conn: replies,
	// delayed retries, dead letters.
	w, err := amqpidem.Wrap(conn, store, config(queue, log), quoteHandler(log))
	if err != nil {
		return err
	}

	stop, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	return serve(stop, conn, w, queue, shutdownGrace)
}

// config is how the quotes queue is processed. Every field left out has a
// documented default.
func config(queue string, log *slog.Logger) amqpidem.Config {
	return amqpidem.Config{
		Queue: queue,
		// The lease held while a request is answered, renewed every
		// LeaseTTL/3 until the handler returns.
		LeaseTTL: 10 * time.Second,
		// A request sent again while the first is still being answered
		// is requeued, and looked at again after at most this long: its
		// client gets the answer soon after the first one's.
		InProgressDelay: 500 * time.Millisecond,
		// The idempotency window: a request sent again within it gets the
		// stored result. Longer than any client retries.
		Retention: time.Hour,
		// A request that takes longer is cancelled and retried.
		HandlerTimeout: 10 * time.Second,
		Logger:         log,
	}
}

// serve consumes queue on a channel of conn and hands each delivery to w,
// until stop is done or the channel closes. Then it stops consuming and
// shuts w down, giving the handlers in flight up to grace to finish.
func serve(stop context.Context, conn *amqp.Connection, w *amqpidem.Wrapper, queue string, grace time.Duration) error {
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close() // after the handlers: each delivery is acked on it
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		return err
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return err
	}
	const tag = "rpc-server"
	deliveries, err := ch.Consume(queue, tag, false, false, false, false, nil)
	if err != nil {
		return err
	}

	// One goroutine per delivery: at most prefetch at once, as the broker
	// sends no more unacked deliveries than that. Handle settles the
	// delivery (ack, delayed requeue or dead letter) and sends the reply.
	// Its context is not stop: it would cancel the handlers at once, where
	// Shutdown lets them finish first.
	var handlers sync.WaitGroup
	handle := func(d amqp.Delivery) {
		handlers.Go(func() { w.Handle(context.Background(), d) })
	}
	var lost error // why serve ends other than by stop
loop:
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				lost = errors.New("rpc: the channel closed; restart to reconnect")
				break loop
			}
			handle(d)
		case <-stop.Done():
			// Stop consuming; the deliveries already sent still come, then
			// deliveries closes.
			_ = ch.Cancel(tag, false)
			for d := range deliveries {
				handle(d)
			}
			break loop
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	// Shutdown waits for the handlers in flight until ctx ends, then
	// cancels the rest (their requests go back to the queue) and returns
	// ctx.Err().
	if err := w.Shutdown(ctx); err != nil {
		lost = errors.Join(lost, fmt.Errorf("shutdown: %w", err))
	}
	handlers.Wait()
	return lost
}

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

// quoteHandler answers one request; amqpidem runs it once per message-id.
// Its result is stored and sent to the request's ReplyTo.
func quoteHandler(log *slog.Logger) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		var req quoteRequest
		if err := json.Unmarshal(d.Body, &req); err != nil {
			return nil, amqpidem.Permanent(fmt.Errorf("bad request: %w", err)) // dead-lettered, never retried
		}
		q, err := price(ctx, req)
		if err != nil {
			return nil, err // retried with backoff, then dead-lettered
		}
		// The key and the attempt (1 first); ok is false only when the
		// handler is called outside amqpidem.
		if info, ok := amqpidem.FromContext(ctx); ok {
			log.Info("quote computed", "key", info.Key, "attempt", info.Attempt,
				"quote_id", q.QuoteID, "correlation_id", d.CorrelationId)
		}
		return json.Marshal(q)
	})
}

// price computes a quote. It takes a while, and stops when ctx ends (the
// lease lost, HandlerTimeout, shutdown).
func price(ctx context.Context, req quoteRequest) (quote, error) {
	select {
	case <-time.After(200 * time.Millisecond):
	case <-ctx.Done():
		return quote{}, context.Cause(ctx)
	}
	// A fresh quote id each time: a reply that carries the first one was
	// not computed again.
	return quote{QuoteID: "q-" + rand.Text()[:8], SKU: req.SKU, Quantity: req.Quantity, TotalCents: 4999 * req.Quantity}, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
