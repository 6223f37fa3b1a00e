// Command batch books payments in PostgreSQL in batches: many deliveries,
// one transaction, one COMMIT, each payment still booked exactly once. It
// consumes the queue "ledger-batch", whose messages are JSON payments with
// the payment id as their message-id, and writes one row per payment into
// ledger_entries with a plain INSERT (no unique key on the payment id, and
// none needed). amqpidem.NewBatchConsumer gathers up to 100 new deliveries
// (or what came within 10 ms), takes their leases in one statement, and
// pgstore.BatchTxHandler runs book on them in one transaction that also
// completes every payment's record: the rows and the records commit
// together or not at all. Copies of payments already booked are acked
// without running; a payment refused for good is answered on its own
// (amqpidem.Permanent in its BatchResult: dead-lettered, its neighbours
// booked); a batch error (the database refusing the INSERTs) splits the
// batch in halves, run again, down to single payments.
//
// This file is a template: a whole program that imports only public
// packages. Copy it into your own module and replace the INSERT with your
// own writes. PG_DSN (default postgres://postgres@127.0.0.1:5432/test) and
// AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/) say where
// PostgreSQL and RabbitMQ are. SIGINT or SIGTERM stops it gracefully.
//
// In this repository `go run ./examples/batch` also compiles
// selfcheck.go, which runs a self-checking demo of this handler instead;
// `go run ./examples/batch/main.go` runs this file alone.
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
	queue = "ledger-batch"
	// batchSize is the most payments in one transaction; batchWait how
	// long a batch waits for more once its first payment is ready. They
	// bound the latency batching adds, too.
	batchSize = 100
	batchWait = 10 * time.Millisecond
)

func main() {
	// A hostile message can put terminal escapes into the keys and errors
	// logged, and tint writes values as they are: amqpidem.EscapeControl
	// escapes them.
	log := slog.New(tint.NewTextHandler(os.Stderr, &tint.Options{Level: slog.LevelInfo, TimeFormat: time.TimeOnly,
		ReplaceAttr: amqpidem.EscapeControl}))
	if err := run(log); err != nil {
		log.Error("batch stopped", "error", err)
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
	// A running batch holds one connection for its transaction; by
	// default two batches run at once (Concurrency is twice BatchSize), and
	// the heartbeat and the lease statements need a few more.
	pcfg.MaxConns = 6
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

	consumer, err := newConsumer(store, envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), queue,
		qualified(cfg.Schema, "ledger_entries"), amqpidem.Config{Logger: log})
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

// newConsumer is the batch consumer of q, booking into table; base holds
// the rest of its configuration (a logger, an observer).
func newConsumer(store *pgstore.Store, url, q, table string, base amqpidem.Config) (*amqpidem.Consumer, error) {
	base.Queue = q
	return amqpidem.NewBatchConsumer(store, amqpidem.ConsumerConfig{
		URL:       url,
		BatchSize: batchSize,
		BatchWait: batchWait,
		Config:    base,
	}, store.BatchTxHandler(book(table)))
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
		payment_id   text        NOT NULL, -- no unique key: the records make the INSERT run once
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

// book returns the work of one batch: one row in table per valid
// payment, all sent in one round trip (pgx.Batch). BatchTxHandler runs it in the
// transaction that also completes the records of the payments it
// answers with a nil Err, and commits them together.
func book(table string) pgstore.BatchTxFunc {
	return func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		results := make([]amqpidem.BatchResult, len(ds))
		var ids []string
		var amounts []int64
		var booked []int // indexes into ds of the payments inserted
		for i, d := range ds {
			var p payment
			if err := json.Unmarshal(d.Body, &p); err != nil {
				results[i].Err = amqpidem.Permanent(fmt.Errorf("bad payment: %w", err))
				continue
			}
			if p.Amount <= 0 {
				results[i].Err = amqpidem.Permanent(fmt.Errorf("payment %s: amount %d is not positive", p.ID, p.Amount))
				continue
			}
			ids, amounts, booked = append(ids, p.ID), append(amounts, p.Amount), append(booked, i)
		}
		if len(booked) == 0 {
			return results, nil
		}
		// One round trip for every INSERT of the batch (pgx.Batch).
		b := &pgx.Batch{}
		for j := range booked {
			b.Queue("INSERT INTO "+table+" (payment_id, amount_cents) VALUES ($1, $2) RETURNING id", ids[j], amounts[j])
		}
		br := tx.SendBatch(ctx, b)
		entries := make([]int64, len(booked))
		for j := range booked {
			if err := br.QueryRow().Scan(&entries[j]); err != nil {
				_ = br.Close()
				return nil, err // the batch's error: rolled back, split and run again
			}
		}
		if err := br.Close(); err != nil {
			return nil, err
		}
		for j, i := range booked {
			results[i].Result = fmt.Appendf(nil, "ledger entry %d", entries[j])
		}
		return results, nil
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
