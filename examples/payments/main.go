// Command payments books payments exactly once in PostgreSQL. It consumes
// the queue "ledger", whose messages are JSON payments with the payment id
// as their message-id, and writes one row per payment into the table
// ledger_entries, with a plain INSERT: the table has no unique key on the
// payment id, and needs none. The row and the payment's idempotency record
// commit in one transaction (pgstore.TxHandler), so a copy of a payment
// already booked is acked without running, and a consumer that crashes,
// loses its database connection or its lease before the commit leaves
// nothing behind: the next delivery books it, once.
//
// This file is a template: a whole program that imports only public
// packages. Copy it into your own module and replace the INSERT with your
// own writes. PG_DSN (default postgres://postgres@127.0.0.1:5432/test) and
// AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/) say where
// PostgreSQL and RabbitMQ are. SIGINT or SIGTERM stops it gracefully.
//
// In this repository `go run ./examples/payments` also compiles
// selfcheck.go, which runs a self-checking demo of this handler instead;
// `go run ./examples/payments/main.go` runs this file alone.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/lmittmann/tint"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/pgstore"
)

const (
	queue = "ledger"
	// concurrency is how many payments are booked at once; each holds one
	// pooled connection while it runs.
	concurrency = 8
)

func main() {
	// A hostile message can put terminal escapes into the keys and errors
	// logged, and tint writes values as they are: amqpidem.EscapeControl
	// escapes them.
	log := slog.New(tint.NewTextHandler(os.Stderr, &tint.Options{Level: slog.LevelDebug, TimeFormat: time.TimeOnly,
		ReplaceAttr: amqpidem.EscapeControl}))
	if err := run(log); err != nil {
		log.Error("payments stopped", "error", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pcfg, err := pgxpool.ParseConfig(envOr("PG_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	// Each running handler holds a connection; the heartbeat and the
	// record calls need a few more.
	pcfg.MaxConns = concurrency + 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()

	cfg := pgstore.Config{}
	if err := setup(ctx, pool, cfg); err != nil {
		return err
	}
	store, err := pgstore.New(pool, cfg)
	if err != nil {
		return err
	}
	defer store.Close()

	consumer, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL:         envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
		Concurrency: concurrency,
		Config:      amqpidem.Config{Queue: queue, Logger: log},
	}, store.TxHandler(booker(qualified(cfg.Schema, "ledger_entries"))))
	if err != nil {
		return err
	}
	stop, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	go func() {
		<-stop.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = consumer.Shutdown(shutdown)
	}()
	if err := consumer.Run(context.Background()); !errors.Is(err, amqpidem.ErrConsumerClosed) {
		return err
	}
	return nil
}

// setup creates the records table (pgstore.Migrate; idempotent) and the
// ledger, in cfg.Schema. In production, apply pgstore.MigrationSQL(cfg)
// with your migration tool instead, if you prefer.
func setup(ctx context.Context, pool *pgxpool.Pool, cfg pgstore.Config) error {
	if err := pgstore.Migrate(ctx, pool, cfg); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+qualified(cfg.Schema, "ledger_entries")+` (
		id           bigserial   PRIMARY KEY,
		payment_id   text        NOT NULL, -- no unique key: the record makes the INSERT run once
		amount_cents bigint      NOT NULL,
		booked_at    timestamptz NOT NULL DEFAULT now()
	)`)
	return err
}

// payment is the message body.
type payment struct {
	ID     string `json:"payment_id"`
	Amount int64  `json:"amount_cents"`
}

// booker returns the work of one message: one row in table per payment.
// TxHandler runs it in the transaction that also completes the payment's
// record, and commits both together.
func booker(table string) pgstore.TxFunc {
	return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		var p payment
		if err := json.Unmarshal(d.Body, &p); err != nil {
			return nil, amqpidem.Permanent(fmt.Errorf("bad payment: %w", err))
		}
		if p.Amount <= 0 {
			return nil, amqpidem.Permanent(fmt.Errorf("payment %s: amount %d is not positive", p.ID, p.Amount))
		}
		var id int64
		err := tx.QueryRow(ctx, "INSERT INTO "+table+" (payment_id, amount_cents) VALUES ($1, $2) RETURNING id",
			p.ID, p.Amount).Scan(&id)
		if err != nil {
			return nil, err // rolled back; retried with backoff
		}
		return fmt.Appendf(nil, "ledger entry %d", id), nil
	}
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
