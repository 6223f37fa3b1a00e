// Command longjob runs jobs that take far longer than their lease. Each
// message of the queue "reports" asks for a report that takes minutes to
// write, and the report is written once per message-id.
//
// The lease is short, so that the job of a consumer that crashed is taken
// over soon after; the heartbeat renews it every LeaseTTL/3 while the job
// runs. A copy of the message that arrives meanwhile finds the job in
// progress: it is requeued as busy until the job is done, then acked as a
// duplicate without running.
//
// This file is a template: a whole program that imports only public
// packages. Copy it into your own module and replace writeReport with your
// own job. REDIS_ADDR (default 127.0.0.1:6379) and AMQP_URL (default
// amqp://guest:guest@127.0.0.1:5672/) say where Redis and RabbitMQ are.
// SIGINT or SIGTERM stops it gracefully: the jobs running get up to 30 s to
// finish; any still running then are cancelled and go back to the queue,
// to start over on the next consumer.
//
// In this repository `go run ./examples/longjob` also compiles
// selfcheck.go, which runs a self-checking demo of this handler and wiring
// instead; `go run ./examples/longjob/main.go` runs this file alone.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/lmittmann/tint"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/lock"
)

const (
	queue = "reports"
	// reportTakes is how long writeReport takes.
	reportTakes = 3 * time.Minute
	// shutdownGrace is how long the jobs running get to finish on SIGINT
	// or SIGTERM.
	shutdownGrace = 30 * time.Second
)

func main() {
	// A hostile message can put terminal escapes into the keys and errors
	// logged, and tint writes values as they are: amqpidem.EscapeControl
	// escapes them.
	log := slog.New(tint.NewTextHandler(os.Stderr, &tint.Options{Level: slog.LevelDebug, TimeFormat: time.TimeOnly,
		ReplaceAttr: amqpidem.EscapeControl}))
	if err := run(log); err != nil {
		log.Error("longjob stopped", "error", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	// The store keeps one record per job in Redis: the lease while the job
	// runs, then its outcome for Config.Retention.
	rdb := redis.NewClient(&redis.Options{Addr: envOr("REDIS_ADDR", "127.0.0.1:6379")})
	defer rdb.Close()
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: "longjob", Logger: log})
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
	consumer, err := amqpidem.NewConsumer(store, consumerConfig(url, queue, log), reportHandler(log, reportTakes))
	if err != nil {
		return err
	}

	stop, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	return serve(stop, consumer, shutdownGrace, log)
}

// consumerConfig is how the reports queue is consumed. Every field left
// out has a documented default.
func consumerConfig(url, queue string, log *slog.Logger) amqpidem.ConsumerConfig {
	return amqpidem.ConsumerConfig{
		URL: url,
		// Few jobs at a time, and few taken from the queue ahead of them:
		// the rest are left to the other consumers.
		Prefetch:    2,
		Concurrency: 2,
		Config: amqpidem.Config{
			Queue: queue,
			// A crashed consumer's job is taken over once its lease runs
			// out: within 15 s, although a job takes minutes.
			LeaseTTL: 15 * time.Second,
			// The idempotency window: a copy arriving within it is
			// recognised.
			Retention: 24 * time.Hour,
			// A job that takes longer is cancelled and retried.
			HandlerTimeout: 30 * time.Minute,
			Logger:         log,
		},
	}
}

// serve runs c until stop is done, then shuts it down, giving the handlers
// in flight up to grace to finish.
func serve(stop context.Context, c *amqpidem.Consumer, grace time.Duration, log *slog.Logger) error {
	// Run does not get stop: when Run's context ends, the handlers in flight
	// are cancelled at once. Shutdown lets them finish first.
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	select {
	case err := <-done:
		return err // ConsumerConfig.Reconnect gave up; the default never does
	case <-stop.Done():
	}
	log.Info("shutting down", "grace", grace)
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	// Shutdown stops consuming, sends back the deliveries not started yet,
	// waits for the handlers in flight until ctx ends, then cancels the
	// rest: their messages go back to the queue, and it returns ctx.Err().
	err := c.Shutdown(ctx)
	if err != nil {
		err = fmt.Errorf("shutdown: %w", err)
	}
	if rerr := <-done; !errors.Is(rerr, amqpidem.ErrConsumerClosed) {
		err = errors.Join(err, rerr)
	}
	return err
}

// reportHandler writes the report a message asks for; amqpidem runs it
// once per message-id.
func reportHandler(log *slog.Logger, takes time.Duration) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		// The key, the attempt (1 first) and the lease's fencing token;
		// ok is false only when the handler is called outside amqpidem.
		info, ok := amqpidem.FromContext(ctx)
		if !ok {
			return nil, errors.New("no idempotency key: run the handler through amqpidem")
		}
		log.Info("job started", "key", info.Key, "attempt", info.Attempt, "fence", info.Fence, "takes", takes)
		begin := time.Now()
		if err := writeReport(ctx, log, info.Key, takes); err != nil {
			return nil, err // retried with backoff, then dead-lettered
		}
		log.Info("job done", "key", info.Key, "took", time.Since(begin))
		return []byte("report written"), nil
	})
}

// writeReport stands in for a long job: ten steps, each a tenth of takes.
// It stops as soon as ctx ends: the lease was lost (another consumer may
// take the job over), HandlerTimeout passed, or shutdown.
func writeReport(ctx context.Context, log *slog.Logger, key string, takes time.Duration) error {
	const steps = 10
	begin := time.Now()
	for step := 1; step <= steps; step++ {
		t := time.NewTimer(takes / steps)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return context.Cause(ctx)
		}
		// The heartbeat renews the lease all along: its deadline stays
		// ahead although the job outlived the lease TTL long ago.
		lease, _ := heartbeat.LeaseFromContext(ctx)
		log.Info("job working", "key", key, "step", fmt.Sprintf("%d/%d", step, steps),
			"elapsed", time.Since(begin).Round(10*time.Millisecond),
			"lease_expires_in", time.Until(lease.Deadline).Round(time.Millisecond))
	}
	return nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
