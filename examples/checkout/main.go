// Command checkout consumes two queues, payments and refunds, in one
// amqpidem.Group: one Run, one graceful Shutdown on SIGINT or SIGTERM, one
// readiness check. Both share one handler built from a plain function and
// middleware (amqpidem.Chain: logging outermost, then panic recovery),
// and one retry policy: a payment API answering 429 is retried after the
// wait it asked for (amqpidem.RetryAfter), a timeout backs off slowly,
// anything else by attempt (Config.RetryDelay); a declined card is
// dead-lettered at once (amqpidem.Permanent). charge_test.go tests the
// handler with amqpidem/amqpidemtest, without a broker.
//
// In this repository `go run ./examples/checkout` also compiles
// selfcheck.go, which runs a self-checking demo of this handler and wiring
// instead; `go run ./examples/checkout/main.go` runs this file alone.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/lmittmann/tint"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// shutdownGrace is how long the charges running get to finish on SIGINT or
// SIGTERM.
const shutdownGrace = 30 * time.Second

// errRateLimited is the payment API's 429; errDeclined a card declined,
// never retried.
var (
	errRateLimited = errors.New("payment API: rate limited")
	errDeclined    = errors.New("card declined")
)

func main() {
	// A hostile message can put terminal escapes into the keys and errors
	// logged, and tint writes values as they are: amqpidem.EscapeControl
	// escapes them.
	log := slog.New(tint.NewTextHandler(os.Stderr, &tint.Options{Level: slog.LevelDebug, TimeFormat: time.TimeOnly,
		ReplaceAttr: amqpidem.EscapeControl}))
	if err := run(log); err != nil {
		log.Error("checkout stopped", "error", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	rdb := redis.NewClient(&redis.Options{Addr: envOr("REDIS_ADDR", "127.0.0.1:6379")})
	defer rdb.Close()
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: "checkout", Logger: log})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := store.Check(ctx); err != nil {
		return err
	}
	g, err := newGroup(store, envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "payments", "refunds", nil, log)
	if err != nil {
		return err
	}
	// Readiness for both queues at once: 200 while each consumes.
	http.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		if err := g.Ready(r.Context()); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
		}
	})
	srv := &http.Server{Addr: envOr("HTTP_ADDR", "127.0.0.1:9465"), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.ListenAndServe() }()
	defer srv.Close()

	stop, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	return serve(stop, g, shutdownGrace, log)
}

// newGroup makes one consumer per queue, all with handler() and
// config(queue), in one Group. obs, when not nil, is told of every
// outcome (metrics: promamqpidem's Observer fits).
func newGroup(store lock.Store, url string, payments, refunds string, obs amqpidem.Observer, log *slog.Logger) (*amqpidem.Group, error) {
	var consumers []*amqpidem.Consumer
	for _, q := range []string{payments, refunds} {
		cfg := config(q)
		cfg.Logger, cfg.Observer = log, obs
		c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{URL: url, Prefetch: 8, Concurrency: 8, Config: cfg}, handler(log))
		if err != nil {
			return nil, err
		}
		consumers = append(consumers, c)
	}
	return amqpidem.NewGroup(consumers...), nil
}

// config is how each queue is processed. Every field left out has a
// documented default.
func config(queue string) amqpidem.Config {
	return amqpidem.Config{
		Queue:       queue,
		MaxAttempts: 4,
		// After the n-th failed execution: a timeout waits 10 s per
		// attempt, anything else 1 s per attempt. An error wrapped by
		// amqpidem.RetryAfter waits what it says instead.
		RetryDelay: func(n int, err error, d *amqp.Delivery) time.Duration {
			if errors.Is(err, context.DeadlineExceeded) {
				return time.Duration(n) * 10 * time.Second
			}
			return time.Duration(n) * time.Second
		},
	}
}

// charge charges (or refunds) the payment in d's body. A real one calls
// the payment API with d.MessageId as its idempotency key.
func charge(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	switch string(d.Body) {
	case "429":
		return nil, amqpidem.RetryAfter(errRateLimited, rateLimitWait)
	case "declined":
		return nil, amqpidem.Permanent(errDeclined)
	case "timeout":
		return nil, context.DeadlineExceeded
	case "panic":
		panic("nil map")
	}
	return []byte("receipt " + d.MessageId), nil
}

// rateLimitWait is what the payment API's 429 asks to wait.
var rateLimitWait = 30 * time.Second

// handler is charge with its middleware, logging outermost.
func handler(log *slog.Logger) amqpidem.Handler {
	return amqpidem.Chain(amqpidem.HandlerFunc(charge), logged(log), recovered)
}

// logged is a middleware that logs every execution and how long it took.
func logged(log *slog.Logger) amqpidem.Middleware {
	return func(next amqpidem.Handler) amqpidem.Handler {
		return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			start := time.Now()
			result, err := next.Handle(ctx, d)
			log.InfoContext(ctx, "charge", "id", d.MessageId, "took", time.Since(start), "error", err)
			return result, err
		})
	}
}

// recovered is a middleware that turns a panic into a permanent failure:
// dead-lettered with the panic in its fault headers, not retried.
func recovered(next amqpidem.Handler) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) (result []byte, err error) {
		defer func() {
			if v := recover(); v != nil {
				err = amqpidem.Permanent(fmt.Errorf("panic: %v", v))
			}
		}()
		return next.Handle(ctx, d)
	})
}

// serve runs g until stop is done, then shuts it down, giving the handlers
// in flight up to grace to finish.
func serve(stop context.Context, g *amqpidem.Group, grace time.Duration, log *slog.Logger) error {
	// Run does not get stop: when Run's context ends, the handlers in flight
	// are cancelled at once. Shutdown lets them finish first.
	done := make(chan error, 1)
	go func() { done <- g.Run(context.Background()) }()
	select {
	case err := <-done:
		return err // a consumer was refused for good (wrong password, ...): all stopped
	case <-stop.Done():
	}
	log.Info("shutting down", "grace", grace)
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := g.Shutdown(ctx)
	if rerr := <-done; rerr != nil && !errors.Is(rerr, amqpidem.ErrGroupClosed) {
		err = errors.Join(err, rerr)
	}
	return err
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
