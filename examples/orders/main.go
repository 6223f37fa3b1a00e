// Command orders charges payments exactly once. It consumes the queue
// "payments", whose messages are JSON payments with the payment id as their
// message-id, and charges each payment id once, however often RabbitMQ
// delivers it and however many copies of the program run: a copy of a
// payment already charged is acked without running, and a copy that comes
// while another consumer charges it waits until that one is done. A
// payment that can never succeed (a declined card) is dead-lettered to
// "payments.dlq" at once; any other failure is retried with backoff, then
// dead-lettered.
//
// This file is a template: a whole program that imports only public
// packages. Copy it into your own module and replace logBank with your
// payment provider's client. REDIS_ADDR (default 127.0.0.1:6379) and
// AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/) say where Redis and
// RabbitMQ are. SIGINT or SIGTERM stops it gracefully: the payments being
// charged get up to 30 s to finish; any still running then are cancelled
// and go back to the queue.
//
// It serves Prometheus metrics at /metrics (package promamqpidem's, the Go
// runtime's and the process's) and a readiness check at /readyz (200 while
// it consumes the queue and Redis answers, else 503 and why) on
// METRICS_ADDR, default 127.0.0.1:9464: set it to ":9464" for a scraper or
// probe on another host (a Kubernetes pod's), or to "off" (or empty) to
// serve neither. Both are served until the consumer has shut down, so
// /readyz answers 503 during the shutdown.
//
// In this repository `go run ./examples/orders` (`make demo`) also compiles
// selfcheck.go, which runs a self-checking demo of this handler and wiring
// instead; `go run ./examples/orders/main.go` runs this file alone.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/lmittmann/tint"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

const (
	queue = "payments"
	// shutdownGrace is how long the payments being charged get to finish
	// on SIGINT or SIGTERM.
	shutdownGrace = 30 * time.Second
	// defaultMetricsAddr is where /metrics and /readyz are served when
	// METRICS_ADDR is not set: this host only.
	defaultMetricsAddr = "127.0.0.1:9464"
)

func main() {
	// A hostile message can put terminal escapes into the keys and errors
	// logged, and tint writes values as they are: amqpidem.EscapeControl
	// escapes them.
	log := slog.New(tint.NewTextHandler(os.Stderr, &tint.Options{Level: slog.LevelDebug, TimeFormat: time.TimeOnly,
		ReplaceAttr: amqpidem.EscapeControl}))
	if err := run(log); err != nil {
		log.Error("orders stopped", "error", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	// The store keeps one record per payment id in Redis: the lease while
	// the payment is charged, then its outcome for Config.Retention.
	rdb := redis.NewClient(&redis.Options{Addr: envOr("REDIS_ADDR", "127.0.0.1:6379")})
	defer rdb.Close()
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: "orders", Logger: log})
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

	// The metrics: every outcome, handler and store call of the consumer
	// (promamqpidem), on a registry of this program's own with the Go
	// runtime's and the process's.
	metrics := promamqpidem.New(promamqpidem.Options{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics, collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cfg := config(queue, log)
	cfg.Observer = metrics

	// Listening before the consumer exists: an address in use stops the
	// program before it takes any message.
	ln, err := listenMetrics(log)
	if err != nil {
		return err
	}
	consumer, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL:    envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
		Config: cfg,
	}, chargeHandler(&logBank{log: log, fence: map[string]int64{}}))
	if err != nil {
		if ln != nil {
			ln.Close()
		}
		return err
	}

	stop, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	return serve(stop, consumer, ln, opsHandler(reg, consumer.Ready, log), shutdownGrace, log)
}

// config is how the payments queue is processed. Every field left out has
// a documented default.
func config(queue string, log *slog.Logger) amqpidem.Config {
	return amqpidem.Config{
		Queue: queue,
		// The lease a consumer holds while it charges a payment; the
		// heartbeat renews it every LeaseTTL/3, so a charge may take much
		// longer. A crashed consumer's payment is taken over once its lease
		// runs out.
		LeaseTTL: 30 * time.Second,
		// The idempotency window: a copy arriving within it is recognised.
		Retention: 24 * time.Hour,
		// A charge that takes longer is cancelled and retried.
		HandlerTimeout: time.Minute,
		// A copy of a declined payment is acked and dropped: the first copy
		// is in payments.dlq already.
		FailedDuplicate: amqpidem.AckFailedDuplicate,
		// Signs the dead letters' headers, so that `amqpidem dlq replay
		// --forget`, given the same key in AMQPIDEM_SIGNING_KEY, can tell
		// them from messages a publisher put into payments.dlq itself.
		// Unset: nothing signed, and the CLI forgets records only with
		// --trust-headers.
		SigningKey: []byte(os.Getenv("AMQPIDEM_SIGNING_KEY")),
		Logger:     log,
	}
}

// serve runs c until stop is done, then shuts it down, giving the handlers
// in flight up to grace to finish. If ln is not nil, it serves ops on ln
// meanwhile, until c has shut down.
func serve(stop context.Context, c *amqpidem.Consumer, ln net.Listener, ops http.Handler, grace time.Duration, log *slog.Logger) error {
	if ln != nil {
		defer serveHTTP(ln, ops, log)() // stops serving when serve returns
	}
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

// listenMetrics listens on METRICS_ADDR (default defaultMetricsAddr), where
// /metrics and /readyz are served; it returns nil when METRICS_ADDR is
// "off" or set empty.
func listenMetrics(log *slog.Logger) (net.Listener, error) {
	addr, set := os.LookupEnv("METRICS_ADDR")
	switch {
	case !set:
		addr = defaultMetricsAddr
	case addr == "" || addr == "off":
		log.Info("not serving /metrics and /readyz (METRICS_ADDR is off)")
		return nil, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("METRICS_ADDR: %w", err)
	}
	log.Info("serving /metrics and /readyz", "addr", ln.Addr().String())
	return ln, nil
}

// opsHandler serves what reg gathers at /metrics, and at /readyz 200 when
// ready (Consumer.Ready) returns nil within 2 s, else 503 and its error.
func opsHandler(reg prometheus.Gatherer, ready func(context.Context) error, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelError),
	}))
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := ready(ctx); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, "ready\n")
	})
	return mux
}

// serveHTTP serves h on ln until the function it returns is called, which
// waits up to 5 s for the requests in flight, then closes their
// connections, and returns once the server has stopped.
func serveHTTP(ln net.Listener, h http.Handler, log *slog.Logger) (stop func()) {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			// The consumer goes on without its metrics.
			log.Error("/metrics and /readyz no longer served", "error", err)
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			srv.Close()
		}
		<-served
	}
}

// payment is the message body.
type payment struct {
	ID     string `json:"payment_id"`
	Amount int    `json:"amount_cents"`
}

// charged is the handler's result: stored with the outcome, and sent to the
// message's ReplyTo if it has one (to a duplicate's too, from the store).
type charged struct {
	PaymentID string `json:"payment_id"`
	Receipt   string `json:"receipt"`
}

var (
	// errDeclined is a charge that can never succeed.
	errDeclined = errors.New("card declined")
	// errStaleFence is a charge refused because the bank has seen a
	// higher fencing token for the payment.
	errStaleFence = errors.New("stale fencing token")
)

// bank charges payments. Pass it the fencing token: a bank (or a table of
// your own) that keeps the highest token it has seen for each payment and
// refuses a charge with a lower one is never charged by a consumer that
// lost its lease mid-charge.
type bank interface {
	Charge(ctx context.Context, p payment, fence int64) (receipt string, err error)
}

// chargeHandler charges the payment in a message; amqpidem runs it once
// per message-id.
func chargeHandler(b bank) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		var p payment
		if err := json.Unmarshal(d.Body, &p); err != nil {
			return nil, amqpidem.Permanent(fmt.Errorf("bad payment: %w", err))
		}
		// The key, the attempt (1 first) and the lease's fencing token;
		// ok is false only when the handler is called outside amqpidem.
		info, ok := amqpidem.FromContext(ctx)
		if !ok {
			return nil, errors.New("no fencing token: run the handler through amqpidem")
		}
		// ctx ends when the lease is lost, at HandlerTimeout or at
		// shutdown: Charge must stop then.
		receipt, err := b.Charge(ctx, p, info.Fence)
		switch {
		case errors.Is(err, errDeclined):
			return nil, amqpidem.Permanent(err) // dead-lettered, never retried
		case errors.Is(err, errStaleFence):
			// A newer execution got further: this one is discarded, and
			// not counted as an attempt.
			return nil, fmt.Errorf("%w: %w", amqpidem.ErrStale, err)
		case err != nil:
			return nil, err // retried with backoff, then dead-lettered
		}
		return json.Marshal(charged{PaymentID: p.ID, Receipt: receipt})
	})
}

// logBank stands in for a payment provider: it logs each charge and
// refuses a fencing token not above the last one it saw for the payment.
type logBank struct {
	log   *slog.Logger
	mu    sync.Mutex
	fence map[string]int64
}

func (b *logBank) Charge(ctx context.Context, p payment, fence int64) (string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if fence <= b.fence[p.ID] {
		return "", fmt.Errorf("%w: %d, seen %d", errStaleFence, fence, b.fence[p.ID])
	}
	b.fence[p.ID] = fence
	b.log.Info("charged", "payment_id", p.ID, "amount_cents", p.Amount, "fence", fence)
	return fmt.Sprintf("rcpt-%s-%d", p.ID, fence), nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
