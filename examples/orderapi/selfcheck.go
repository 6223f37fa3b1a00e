// This file is not part of the template: copy main.go alone.
//
// It turns `go run ./examples/orderapi` into a self-checking run of
// main.go's service: it starts the service on a free port (with its relay),
// a second relay on the same table, and an amqpidem consumer of the
// OrderPlaced messages that ships each order, then places orders over
// HTTP:
//
//   - 24 orders of 4 customers; every fifth is POSTed twice (a client's
//     retry: 200, no second message), order o-07 three times at once;
//   - customer c-4's orders are 4,000 each against a 10,000 credit limit:
//     the first two are placed, the next four are refused (422) by the
//     check that runs after the order and its message were written, so
//     both roll back;
//   - the second relay is shut down half way, the other goes on;
//   - one sent message is made pending again, as a relay that crashed
//     between the broker's confirm and its mark leaves it once its claim
//     ran out (RelayConfig.ClaimTTL, 30 s by default): it is published a
//     second time, and the consumer acks it as a duplicate.
//
// Then every placed order must have been shipped exactly once, no refused
// order ever announced, and every outbox row sent. It uses a queue, a
// Redis prefix and a PostgreSQL schema of its own and deletes them at the
// end.

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
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
		demo.Main("orderapi", timeLimit, selfCheck)
	}
}

const (
	orders    = 24
	timeLimit = 60 * time.Second
	// replayed is the order whose OrderPlaced is published twice.
	replayed = "o-03"
)

func orderID(i int) string { return fmt.Sprintf("o-%02d", i) }

// orderOf is the i-th order: customers c-1 to c-4 in turn; c-4's are big.
func orderOf(i int) order {
	c := i%4 + 1
	amount := int64(1000 + i)
	if c == 4 {
		amount = 4000
	}
	return order{ID: orderID(i), Customer: fmt.Sprintf("c-%d", c), Amount: amount}
}

func selfCheck(ctx context.Context) (err error) {
	log := demo.Logger()
	env, store, err := demo.Start(ctx, "orderapi", log)
	if err != nil {
		return err
	}
	schema := strings.NewReplacer("-", "_", ".", "_").Replace(strings.ToLower(env.Name))
	pool, err := pgxpool.New(ctx, envOr("PG_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
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

	// main.go's service, on a free port, in a schema and queue of its own.
	a := &app{log: log, cfg: pgstore.Config{Schema: schema}, queue: env.Name}
	stop, stopApp := context.WithCancel(context.Background())
	addrs := make(chan net.Addr, 1)
	appDone := make(chan error, 1)
	go func() { appDone <- a.run(stop, "127.0.0.1:0", func(ad net.Addr) { addrs <- ad }) }()
	var base string
	select {
	case ad := <-addrs:
		base = "http://" + ad.String()
	case err := <-appDone:
		stopApp()
		return fmt.Errorf("the service did not start: %w", err)
	}
	defer func() {
		stopApp()
		if aerr := <-appDone; aerr != nil {
			err = errors.Join(err, fmt.Errorf("the service: %w", aerr))
		}
	}()

	// A second relay on the same table, stopped half way.
	ob, err := pgstore.NewOutbox(pool, a.cfg)
	if err != nil {
		return err
	}
	second, err := pgstore.NewRelay(ob, pgstore.RelayConfig{URL: env.AMQPURL, Name: "second", Logger: log})
	if err != nil {
		return err
	}
	secondDone := make(chan error, 1)
	go func() { secondDone <- second.Run(context.Background()) }()
	stopSecond := sync.OnceValue(func() error {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return errors.Join(second.Shutdown(sctx), <-secondDone)
	})
	defer func() { err = errors.Join(err, stopSecond()) }()

	// The consumer that ships each order, counting executions.
	var mu sync.Mutex
	shipped := map[string]int{}
	tally := demo.NewTally()
	consumer, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL:    env.AMQPURL,
		Config: amqpidem.Config{Queue: env.Name, ConsumerName: "shipping", Logger: log, Observer: tally},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		var p orderPlaced
		if err := json.Unmarshal(d.Body, &p); err != nil {
			return nil, amqpidem.Permanent(err)
		}
		mu.Lock()
		shipped[p.OrderID]++
		mu.Unlock()
		return []byte("shipped"), nil
	}))
	if err != nil {
		return err
	}
	consumed := make(chan error, 1)
	go func() { consumed <- consumer.Run(context.Background()) }()
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		serr := consumer.Shutdown(sctx)
		if cerr := <-consumed; !errors.Is(cerr, amqpidem.ErrConsumerClosed) {
			serr = errors.Join(serr, cerr)
		}
		err = errors.Join(err, serr)
	}()

	// The orders, over HTTP.
	post := func(o order) (int, error) {
		body, _ := json.Marshal(o)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/orders", bytes.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	placed, refused := map[string]bool{}, map[string]bool{}
	statuses := map[int]int{}
	log.Info("placing orders over HTTP, some of them twice", "orders", orders)
	for i := 1; i <= orders; i++ {
		o := orderOf(i)
		tries := 1
		if i%5 == 0 {
			tries = 2
		}
		if o.ID == "o-07" {
			tries = 3
		}
		codes := make([]int, tries)
		var wg sync.WaitGroup
		var perr error
		var perrMu sync.Mutex
		for t := range tries {
			wg.Go(func() {
				code, err := post(o)
				perrMu.Lock()
				defer perrMu.Unlock()
				codes[t], perr = code, errors.Join(perr, err)
			})
			if o.ID != "o-07" {
				wg.Wait() // retries one after the other; o-07's at once
			}
		}
		wg.Wait()
		if perr != nil {
			return perr
		}
		for _, c := range codes {
			statuses[c]++
		}
		created := 0
		for _, c := range codes {
			if c == http.StatusCreated {
				created++
			}
		}
		switch {
		case created == 1 && codes[0] != http.StatusUnprocessableEntity:
			placed[o.ID] = true // its retries answered 200: placed before
		case created == 0 && codes[0] == http.StatusUnprocessableEntity:
			refused[o.ID] = true
		default:
			return fmt.Errorf("order %s: HTTP statuses %v, want one 201 (then 200s) or 422", o.ID, codes)
		}
		if i == orders/2 {
			log.Info("story: the second relay shuts down; the service's own goes on")
			if err := stopSecond(); err != nil {
				return err
			}
		}
	}
	wantRefused := 0
	for i := 1; i <= orders; i++ {
		if o := orderOf(i); o.Customer == "c-4" && orderCount(i, "c-4") > 2 {
			wantRefused++
			if !refused[o.ID] {
				return fmt.Errorf("order %s was placed, want it refused over the credit limit", o.ID)
			}
		}
	}
	if len(placed) != orders-wantRefused {
		return fmt.Errorf("%d orders placed, want %d (HTTP statuses %v)", len(placed), orders-wantRefused, statuses)
	}

	if err := tally.Wait(ctx, func(c demo.Counts) bool { return c.Total(amqpidem.Completed) >= len(placed) }); err != nil {
		return fmt.Errorf("waiting for %d orders shipped: %w", len(placed), err)
	}
	log.Info("story: a sent OrderPlaced is made pending again, as a relay that crashed after the confirm leaves it "+
		"once its claim ran out", "order", replayed)
	if _, err := pool.Exec(ctx, "UPDATE "+qualified(schema, pgstore.DefaultOutboxTable)+
		" SET state = 'p', sent_at = NULL, due_at = '-infinity' WHERE message_id = $1", "order/"+replayed+"/placed"); err != nil {
		return err
	}
	if err := tally.Wait(ctx, func(c demo.Counts) bool { return c.Total(amqpidem.Duplicate) >= 1 }); err != nil {
		return fmt.Errorf("waiting for the republished %s to arrive: %w", replayed, err)
	}
	// The relay marks a row sent after the confirm, which can come after
	// the consumer got the message.
	for {
		n, _, err := ob.Backlog(ctx)
		if err != nil {
			return err
		}
		if n == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d outbox rows still pending: %w", n, context.Cause(ctx))
		case <-time.After(20 * time.Millisecond):
		}
	}
	if err := checkMetrics(ctx, base, len(placed)); err != nil {
		return err
	}
	return check(ctx, pool, schema, placed, refused, shipped, &mu, tally, statuses)
}

// checkMetrics reads the service's /metrics: its relay published at least
// one message (the second relay published some of the others), refused
// none, and none waits.
func checkMetrics(ctx context.Context, base string, placed int) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var b strings.Builder
	if _, err := io.Copy(&b, resp.Body); err != nil {
		return err
	}
	var published, refused, pending float64
	for _, line := range strings.Split(b.String(), "\n") {
		var v float64
		switch {
		case scan(line, "amqpidem_relay_published_total ", &v):
			published = v
		case scan(line, "amqpidem_relay_refused_total ", &v):
			refused = v
		case scan(line, "amqpidem_relay_pending_rows ", &v):
			pending = v
		}
	}
	if published < 1 || published > float64(placed+1) || refused != 0 || pending != 0 {
		return fmt.Errorf("/metrics: relay published %v (want 1 to %d), refused %v, pending %v (want 0)", published, placed+1, refused, pending)
	}
	return nil
}

// scan reads the value of a metric line that starts with prefix.
func scan(line, prefix string, v *float64) bool {
	if !strings.HasPrefix(line, prefix) {
		return false
	}
	_, err := fmt.Sscan(strings.TrimPrefix(line, prefix), v)
	return err == nil
}

// orderCount is how many of the orders 1..i are the customer's.
func orderCount(i int, customer string) int {
	n := 0
	for j := 1; j <= i; j++ {
		if orderOf(j).Customer == customer {
			n++
		}
	}
	return n
}

// check compares what was shipped and stored with what was placed.
func check(ctx context.Context, pool *pgxpool.Pool, schema string, placed, refused map[string]bool,
	shipped map[string]int, mu *sync.Mutex, tally *demo.Tally, statuses map[int]int) error {
	var problems []string
	mu.Lock()
	for id := range placed {
		if shipped[id] != 1 {
			problems = append(problems, fmt.Sprintf("order %s shipped %d times, want once", id, shipped[id]))
		}
	}
	for id := range refused {
		if shipped[id] != 0 {
			problems = append(problems, fmt.Sprintf("refused order %s was announced and shipped", id))
		}
	}
	mu.Unlock()
	var rows, pending int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+qualified(schema, "orders")).Scan(&rows); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+qualified(schema, pgstore.DefaultOutboxTable)+
		" WHERE state <> 's'").Scan(&pending); err != nil {
		return err
	}
	if rows != len(placed) {
		problems = append(problems, fmt.Sprintf("%d order rows, want %d", rows, len(placed)))
	}
	if pending != 0 {
		problems = append(problems, fmt.Sprintf("%d outbox rows not sent", pending))
	}
	var counts string
	tally.View(func(c demo.Counts) {
		counts = fmt.Sprintf("shipped %d, duplicates acked %d", c.Total(amqpidem.Completed), c.Total(amqpidem.Duplicate))
	})
	demo.Logger().Info("summary", "placed", len(placed), "refused", len(refused), "http", fmt.Sprint(statuses), "consumer", counts)
	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}
