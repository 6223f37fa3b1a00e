// This file is not part of the template: copy main.go alone.
//
// It turns `go run ./examples/payments` into a self-checking run of
// main.go's booker on PostgreSQL: two consumers share one queue of
// payments, many published two or three times, and each payment must end
// with exactly one ledger row, although the ledger's INSERT is not
// idempotent and some executions die between the INSERT and the commit:
//
//   - pay-007: the first execution's ledger write fails after its INSERT
//     (an error): the transaction rolls back, the retry books it;
//   - pay-011: the first execution's database connection is killed
//     (pg_terminate_backend) after its INSERT: nothing commits, the
//     message comes back, the next execution books it;
//   - pay-013: the first execution loses its lease after its INSERT
//     (another consumer takes the key over): its completion is refused,
//     its INSERT rolls back, the record decides what happens next;
//   - pay-017: a zero amount, refused for good: dead-lettered, no row.
//
// It counts executions outside the transactions, then checks the ledger:
// one row per payment (none for pay-017), rolled-back executions leaving
// nothing. It uses a queue and a PostgreSQL schema of its own and deletes
// them at the end.

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// init runs the self-check in place of main, and exits.
func init() {
	if !testing.Testing() {
		demo.Main("payments", timeLimit, selfCheck)
	}
}

const (
	payments  = 30
	consumers = 2
	timeLimit = 60 * time.Second
)

// The payments with a story; every other one is booked at the first try.
const (
	failsOnce   = 7
	connKilled  = 11
	leaseStolen = 13
	refused     = 17
)

func paymentID(i int) string { return fmt.Sprintf("pay-%03d", i) }

func selfCheck(ctx context.Context) (err error) {
	log := demo.Logger()
	env, err := demo.ConnectBroker("payments")
	if err != nil {
		return err
	}
	schema := strings.NewReplacer("-", "_", ".", "_").Replace(strings.ToLower(env.Name))
	pcfg, err := pgxpool.ParseConfig(envOr("PG_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return errors.Join(err, env.Close())
	}
	pcfg.MaxConns = consumers*concurrency + 4
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
	if err := store.Check(ctx); err != nil {
		return err
	}
	if err := env.DeclareQueue(env.Name); err != nil {
		return err
	}

	table := qualified(schema, "ledger_entries")
	s := &stories{log: log, pool: pool, store: store, schema: schema, runs: map[string]int{}}
	tally := demo.NewTally()
	stop, stopConsumers := context.WithCancel(context.Background())
	var serving sync.WaitGroup
	runErrs := make(chan error, consumers)
	defer func() {
		stopConsumers()
		serving.Wait()
		close(runErrs)
		for rerr := range runErrs {
			err = errors.Join(err, rerr)
		}
	}()
	for i := range consumers {
		name := fmt.Sprintf("payments-%d", i+1)
		c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
			URL:         env.AMQPURL,
			Concurrency: 4, // no more than Prefetch: the broker never sends more at once
			Prefetch:    4,
			Config: amqpidem.Config{
				Queue:        env.Name,
				ConsumerName: name,
				LeaseTTL:     2 * time.Second,
				Backoff:      amqpidem.Exponential(100*time.Millisecond, time.Second),
				// Short waits, for a demo: a store error, a lost lease.
				UnavailableDelay: 300 * time.Millisecond,
				InProgressDelay:  500 * time.Millisecond,
				Logger:           log,
				Observer:         tally,
			},
		}, store.TxHandler(s.wrap(booker(table))))
		if err != nil {
			return err
		}
		serving.Go(func() {
			done := make(chan error, 1)
			go func() { done <- c.Run(context.Background()) }()
			<-stop.Done()
			sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			serr := c.Shutdown(sctx)
			if rerr := <-done; !errors.Is(rerr, amqpidem.ErrConsumerClosed) {
				serr = errors.Join(serr, rerr)
			}
			if serr != nil {
				runErrs <- fmt.Errorf("%s: %w", name, serr)
			}
		})
	}

	pub := amqpidem.NewPublisher(env.Conn)
	defer pub.Close()
	published := 0
	send := func(i int) error {
		published++
		amount := int64(100 + i*37)
		if i == refused {
			amount = 0
		}
		body, _ := json.Marshal(payment{ID: paymentID(i), Amount: amount})
		return pub.Publish(ctx, "", env.Name, amqp.Publishing{MessageId: paymentID(i), ContentType: "application/json", Body: body})
	}
	log.Info("publishing payments, many of them two or three times", "payments", payments, "consumers", consumers)
	for i := 1; i <= payments; i++ {
		copies := 1 + i%3
		for range copies {
			if err := send(i); err != nil {
				return err
			}
		}
	}
	if err := tally.Wait(ctx, func(c demo.Counts) bool { return c.Settled() >= published }); err != nil {
		return fmt.Errorf("waiting for %d messages to settle: %w", published, err)
	}
	return s.check(ctx, table, tally, published)
}

// stories plays the stories of the special payments around main.go's
// booker, and counts every execution outside the transactions (a count
// that a rollback does not undo).
type stories struct {
	log    *slog.Logger
	pool   *pgxpool.Pool
	store  *pgstore.Store
	schema string
	mu     sync.Mutex
	runs   map[string]int
}

func (s *stories) wrap(book pgstore.TxFunc) pgstore.TxFunc {
	return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
		s.mu.Lock()
		s.runs[d.MessageId]++
		run := s.runs[d.MessageId]
		s.mu.Unlock()
		result, err := book(ctx, tx, d)
		if err != nil || run > 1 {
			return result, err
		}
		switch d.MessageId {
		case paymentID(failsOnce):
			s.log.Info("story: the ledger write fails after the INSERT; it rolls back", "key", d.MessageId)
			return nil, errors.New("ledger replica timed out")
		case paymentID(connKilled):
			s.log.Info("story: the database connection dies after the INSERT", "key", d.MessageId)
			_, err := s.pool.Exec(context.WithoutCancel(ctx), "SELECT pg_terminate_backend($1)", tx.Conn().PgConn().PID())
			if err != nil {
				return nil, err
			}
			return result, nil
		case paymentID(leaseStolen):
			s.log.Info("story: another consumer takes the key over after the INSERT", "key", d.MessageId)
			if err := s.steal(context.WithoutCancel(ctx), d.MessageId); err != nil {
				return nil, err
			}
			return result, nil
		}
		return result, nil
	}
}

// steal makes the lease on id look expired and takes the key over, as a
// consumer would whose holder seemed dead, then gives it back unfinished.
func (s *stories) steal(ctx context.Context, id string) error {
	info, _ := amqpidem.FromContext(ctx)
	key := amqpidem.StoreKey(info.Queue, id)
	_, err := s.pool.Exec(ctx, "UPDATE "+qualified(s.schema, pgstore.DefaultTable)+
		" SET deadline = clock_timestamp() - interval '1 millisecond' WHERE key = $1", []byte(key))
	if err != nil {
		return err
	}
	res, err := s.store.Acquire(ctx, lock.Request{Key: key})
	if err != nil || res.Status != lock.Acquired {
		return fmt.Errorf("take over %s: %v %v", id, res.Status, err)
	}
	return s.store.Release(ctx, res.Lease)
}

// check compares the ledger with what should be there.
func (s *stories) check(ctx context.Context, table string, tally *demo.Tally, published int) error {
	rows, err := s.pool.Query(ctx, "SELECT payment_id, count(*) FROM "+table+" GROUP BY payment_id")
	if err != nil {
		return err
	}
	booked := map[string]int{}
	var id string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&id, &n}, func() error { booked[id] = n; return nil }); err != nil {
		return err
	}
	var problems []string
	extra := 0
	for i := 1; i <= payments; i++ {
		id := paymentID(i)
		want := 1
		if i == refused {
			want = 0
		}
		if booked[id] != want {
			problems = append(problems, fmt.Sprintf("%s has %d ledger rows, want %d", id, booked[id], want))
		}
		s.mu.Lock()
		extra += s.runs[id] - want
		s.mu.Unlock()
	}
	var counts string
	tally.View(func(c demo.Counts) {
		counts = fmt.Sprintf("completed %d, duplicates %d, dead-lettered %d, retried %d, requeued %d",
			c.Total(amqpidem.Completed), c.Total(amqpidem.Duplicate), c.Total(amqpidem.DeadLettered),
			c.Total(amqpidem.Retried), c.Total(amqpidem.Abandoned))
	})
	s.log.Info("summary", "published", published, "outcomes", counts,
		"ledger_rows", len(booked), "executions_rolled_back", extra)
	if extra < 3 {
		problems = append(problems, fmt.Sprintf("only %d executions rolled back, want at least the 3 stories", extra))
	}
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}
