// This file is not part of the template: copy main.go alone.
//
// It turns `go run ./examples/batch` into a self-checking run of main.go's
// batch consumer on PostgreSQL: 300 payments published before it starts,
// every tenth one twice, two with a zero amount and one whose body is not
// JSON. Each good payment must end with exactly one ledger row, the
// refused ones with none and dead-lettered once each, the copies acked as
// duplicates, and the rows must have been committed in far fewer
// transactions than payments (rows of one transaction share its
// booked_at, now()). It uses a queue and a PostgreSQL schema of its own
// and deletes them at the end.

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
	"github.com/amqpidem/amqpidem/pgstore"
)

// init runs the self-check in place of main, and exits.
func init() {
	if !testing.Testing() {
		demo.Main("batch", timeLimit, selfCheck)
	}
}

const (
	payments  = 300
	timeLimit = 60 * time.Second
)

// The payments refused for good; every other one is booked.
var refused = map[int]string{41: "zero", 157: "zero", 233: "not json"}

func paymentID(i int) string { return fmt.Sprintf("pay-%03d", i) }

func selfCheck(ctx context.Context) (err error) {
	log := demo.Logger()
	env, err := demo.ConnectBroker("batch")
	if err != nil {
		return err
	}
	schema := strings.NewReplacer("-", "_", ".", "_").Replace(strings.ToLower(env.Name))
	pcfg, err := pgxpool.ParseConfig(envOr("PG_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return errors.Join(err, env.Close())
	}
	pcfg.MaxConns = 6
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		return errors.Join(fmt.Errorf("cannot connect to PostgreSQL at PG_DSN (default 127.0.0.1:5432, database test): %w\n"+
			"  Start it with `make services` (from the repository root), or point PG_DSN=postgres://user@host:port/db at one", err), env.Close())
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, cerr := pool.Exec(cctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
		pool.Close()
		if cerr := env.Close(); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()

	// main.go's setup and store, in a schema of the run's own.
	cfg := pgstore.Config{Schema: schema}
	if err := setup(ctx, pool, cfg); err != nil {
		return err
	}
	store, err := pgstore.New(pool, cfg)
	if err != nil {
		return err
	}
	defer store.Close()
	if err := env.DeclareQueue(env.Name); err != nil {
		return err
	}

	pub := amqpidem.NewPublisher(env.Conn)
	defer pub.Close()
	published := 0
	for i := 1; i <= payments; i++ {
		body, _ := json.Marshal(payment{ID: paymentID(i), Amount: int64(100 + i*37)})
		switch refused[i] {
		case "zero":
			body, _ = json.Marshal(payment{ID: paymentID(i)})
		case "not json":
			body = []byte("{pay")
		}
		copies := 1
		if i%10 == 0 {
			copies = 2
		}
		for range copies {
			published++
			if err := pub.Publish(ctx, "", env.Name, amqp.Publishing{MessageId: paymentID(i), ContentType: "application/json", Body: body}); err != nil {
				return err
			}
		}
	}
	log.Info("published payments, every tenth twice, three to refuse", "payments", payments, "messages", published)

	table := qualified(schema, "ledger_entries")
	tally := demo.NewTally()
	c, err := newConsumer(store, env.AMQPURL, env.Name, table, amqpidem.Config{Logger: log, Observer: tally})
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		serr := c.Shutdown(sctx)
		if rerr := <-done; !errors.Is(rerr, amqpidem.ErrConsumerClosed) {
			serr = errors.Join(serr, rerr)
		}
		err = errors.Join(err, serr)
	}()
	if err := tally.Wait(ctx, func(c demo.Counts) bool { return c.Settled() >= published }); err != nil {
		return fmt.Errorf("waiting for %d messages to settle: %w", published, err)
	}
	return check(ctx, pool, table, tally, published)
}

// check compares the ledger and the outcomes with what should be there.
func check(ctx context.Context, pool *pgxpool.Pool, table string, tally *demo.Tally, published int) error {
	rows, err := pool.Query(ctx, "SELECT payment_id, count(*) FROM "+table+" GROUP BY payment_id")
	if err != nil {
		return err
	}
	booked := map[string]int{}
	var id string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&id, &n}, func() error { booked[id] = n; return nil }); err != nil {
		return err
	}
	var txs int
	if err := pool.QueryRow(ctx, "SELECT count(DISTINCT booked_at) FROM "+table).Scan(&txs); err != nil {
		return err
	}
	var problems []string
	for i := 1; i <= payments; i++ {
		want := 1
		if refused[i] != "" {
			want = 0
		}
		if booked[paymentID(i)] != want {
			problems = append(problems, fmt.Sprintf("%s has %d ledger rows, want %d", paymentID(i), booked[paymentID(i)], want))
		}
	}
	var counts string
	tally.View(func(c demo.Counts) {
		counts = fmt.Sprintf("completed %d, duplicates %d, dead-lettered %d, retried %d, requeued %d",
			c.Total(amqpidem.Completed), c.Total(amqpidem.Duplicate), c.Total(amqpidem.DeadLettered),
			c.Total(amqpidem.Retried), c.Total(amqpidem.Abandoned))
		for i := range refused {
			if got := c.Key(paymentID(i), amqpidem.DeadLettered); got != 1 {
				problems = append(problems, fmt.Sprintf("%s dead-lettered %d times, want 1", paymentID(i), got))
			}
		}
		if got, want := c.Total(amqpidem.Completed), payments-len(refused); got != want {
			problems = append(problems, fmt.Sprintf("%d payments completed, want %d", got, want))
		}
	})
	good := payments - len(refused)
	log := demo.Logger()
	log.Info("summary", "published", published, "outcomes", counts, "ledger_rows", len(booked), "transactions", txs)
	if txs > good/10 {
		problems = append(problems, fmt.Sprintf("%d payments committed in %d transactions: want batches (at most %d)", good, txs, good/10))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}
