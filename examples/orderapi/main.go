// Command orderapi takes orders over HTTP and announces each one, exactly
// once, with an OrderPlaced message. POST /orders with a JSON order
// inserts the order and writes its OrderPlaced into pgstore's producer
// outbox in the same PostgreSQL transaction: both commit, or neither does
// (a credit check that fails after both writes rolls both back). A relay
// running in the same process publishes the committed messages to the
// queue "order-placed", confirmed, and marks them sent (its figures are at
// GET /metrics); a crash between
// the publish and the mark publishes a message again, with the same
// message-id, which an amqpidem consumer of "order-placed" acks as a
// duplicate without running it. A client that retries a POST gets the
// same order back, and no second message.
//
// This file is a template: a whole program that imports only public
// packages. Copy it into your own module and replace the order with your
// own writes. HTTP_ADDR (default 127.0.0.1:8080), PG_DSN (default
// postgres://postgres@127.0.0.1:5432/test) and AMQP_URL (default
// amqp://guest:guest@127.0.0.1:5672/) say where it listens and where
// PostgreSQL and RabbitMQ are. SIGINT or SIGTERM stops it gracefully.
//
//	curl -i -X POST localhost:8080/orders -d '{"order_id":"o-1","customer":"c-1","amount_cents":1200}'
//
// In this repository `go run ./examples/orderapi` also compiles
// selfcheck.go, which runs a self-checking demo instead;
// `go run ./examples/orderapi/main.go` runs this file alone.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/lmittmann/tint"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

const (
	// queue receives the OrderPlaced messages (through the default
	// exchange, whose routing key is the queue's name).
	queue = "order-placed"
	// creditLimit is what a customer's orders may add up to.
	creditLimit = 10_000
)

func main() {
	// A hostile message can put terminal escapes into the keys and errors
	// logged, and tint writes values as they are: amqpidem.EscapeControl
	// escapes them.
	log := slog.New(tint.NewTextHandler(os.Stderr, &tint.Options{Level: slog.LevelDebug, TimeFormat: time.TimeOnly,
		ReplaceAttr: amqpidem.EscapeControl}))
	stop, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	app := app{log: log, cfg: pgstore.Config{}, queue: queue}
	if err := app.run(stop, envOr("HTTP_ADDR", "127.0.0.1:8080"), nil); err != nil {
		log.Error("orderapi stopped", "error", err)
		os.Exit(1)
	}
}

// app is the service: its database, outbox and relay.
type app struct {
	log   *slog.Logger
	cfg   pgstore.Config // the outbox table's schema and name
	queue string
	pool  *pgxpool.Pool
	ob    *pgstore.Outbox
}

// run serves addr until stop ends, then shuts the server and the relay
// down gracefully. listening, when set, gets the address it listens on.
func (a *app) run(stop context.Context, addr string, listening func(net.Addr)) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, envOr("PG_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	amqpURL := envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	if err := a.setup(ctx, pool, amqpURL); err != nil {
		return err
	}
	a.pool = pool
	if a.ob, err = pgstore.NewOutbox(pool, a.cfg); err != nil {
		return err
	}
	// The relay: one per process is simple; several processes may run
	// theirs on the same table.
	relay, err := pgstore.NewRelay(a.ob, pgstore.RelayConfig{URL: amqpURL, Logger: a.log})
	if err != nil {
		return err
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(context.Background()) }()

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		_ = relay.Shutdown(ctx)
		return err
	}
	if listening != nil {
		listening(ln.Addr())
	}
	// The relay's figures; alert on amqpidem_relay_oldest_pending_seconds.
	reg := prometheus.NewRegistry()
	reg.MustRegister(promamqpidem.NewRelayCollector(relay, promamqpidem.Options{}))
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", a.postOrder)
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	a.log.Info("orderapi listening", "addr", ln.Addr().String(), "queue", a.queue)

	select {
	case <-stop.Done():
	case err = <-served:
	}
	shutdown, cancelShutdown := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancelShutdown()
	err = errors.Join(err, srv.Shutdown(shutdown), relay.Shutdown(shutdown))
	if rerr := <-relayDone; rerr != nil {
		err = errors.Join(err, rerr)
	}
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// setup creates the outbox table (pgstore.Migrate; idempotent), the
// orders table, and the queue, so that no OrderPlaced is unroutable. In
// production, apply pgstore.MigrationSQL(cfg) with your migration tool,
// and declare the queue with the consumer's topology, if you prefer.
func (a *app) setup(ctx context.Context, pool *pgxpool.Pool, amqpURL string) error {
	if err := pgstore.Migrate(ctx, pool, a.cfg); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+qualified(a.cfg.Schema, "orders")+` (
		id           text        PRIMARY KEY,
		customer     text        NOT NULL,
		amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
		placed_at    timestamptz NOT NULL DEFAULT now()
	)`); err != nil {
		return err
	}
	if _, err := amqp.ParseURI(amqpURL); err != nil {
		// Its error quotes the URL, password and all: say less.
		return errors.New("AMQP_URL does not parse as an AMQP URL (a '%', '#', '/' or '?' in the password must be %-escaped)")
	}
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	_, err = ch.QueueDeclare(a.queue, true, false, false, false, nil)
	return err
}

// order is the request's body.
type order struct {
	ID       string `json:"order_id"`
	Customer string `json:"customer"`
	Amount   int64  `json:"amount_cents"`
}

// orderPlaced is the message's body.
type orderPlaced struct {
	OrderID  string    `json:"order_id"`
	Customer string    `json:"customer"`
	Amount   int64     `json:"amount_cents"`
	PlacedAt time.Time `json:"placed_at"`
}

// errOverLimit refuses an order that would take its customer past the
// credit limit.
var errOverLimit = errors.New("over the customer's credit limit")

// postOrder places an order: 201 when placed now, 200 when it was placed
// before (a client's retry: no second message), 422 when refused.
func (a *app) postOrder(w http.ResponseWriter, r *http.Request) {
	var o order
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&o); err != nil || o.ID == "" || o.Customer == "" || o.Amount <= 0 {
		http.Error(w, "want {order_id, customer, amount_cents > 0}", http.StatusBadRequest)
		return
	}
	created, err := a.placeOrder(r.Context(), o)
	switch {
	case errors.Is(err, errOverLimit):
		http.Error(w, err.Error(), http.StatusUnprocessableEntity)
	case err != nil:
		a.log.Error("place order", "order", o.ID, "error", err)
		http.Error(w, "try again", http.StatusServiceUnavailable)
	case created:
		w.WriteHeader(http.StatusCreated)
	default:
		w.WriteHeader(http.StatusOK)
	}
}

// placeOrder inserts o and writes its OrderPlaced into the outbox in one
// transaction. The message's id is derived from the order, so that every
// publish of it (a relay's retry) is the same message to a consumer.
func (a *app) placeOrder(ctx context.Context, o order) (created bool, err error) {
	err = pgx.BeginFunc(ctx, a.pool, func(tx pgx.Tx) error {
		// One customer's orders one at a time, for the credit check.
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtext($1))", o.Customer); err != nil {
			return err
		}
		var placedAt time.Time
		err := tx.QueryRow(ctx, "INSERT INTO "+qualified(a.cfg.Schema, "orders")+` (id, customer, amount_cents)
			VALUES ($1, $2, $3) ON CONFLICT (id) DO NOTHING RETURNING placed_at`, o.ID, o.Customer, o.Amount).Scan(&placedAt)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // placed before: announced then
		}
		if err != nil {
			return err
		}
		created = true
		body, err := json.Marshal(orderPlaced{OrderID: o.ID, Customer: o.Customer, Amount: o.Amount, PlacedAt: placedAt})
		if err != nil {
			return err
		}
		if _, err := a.ob.Write(ctx, tx, pgstore.Message{
			RoutingKey: a.queue,
			// With RelayConfig.Ordered, a customer's messages go out in
			// order; without it, the key is kept and unused.
			OrderKey: o.Customer,
			Publishing: amqp.Publishing{MessageId: "order/" + o.ID + "/placed", Type: "OrderPlaced",
				ContentType: "application/json", Body: body},
		}); err != nil {
			return err
		}
		// A check after both writes: when it fails, the order and its
		// message roll back together, and nothing is ever published.
		var total int64
		if err := tx.QueryRow(ctx, "SELECT sum(amount_cents) FROM "+qualified(a.cfg.Schema, "orders")+
			" WHERE customer = $1", o.Customer).Scan(&total); err != nil {
			return err
		}
		if total > creditLimit {
			return fmt.Errorf("order %s: %w (%d > %d)", o.ID, errOverLimit, total, creditLimit)
		}
		return nil
	})
	if err != nil {
		return false, err
	}
	return created, nil
}

// qualified is schema.name, quoted, or name alone without a schema.
func qualified(schema, name string) string {
	if schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{schema, name}.Sanitize()
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
