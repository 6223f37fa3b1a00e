// Command relay runs a pgstore.Relay on the producer outbox of one schema
// until SIGTERM, for the chaos suite's relay scenarios (scenario 16), which
// kill it with SIGKILL, pause it with SIGSTOP and restart it.
//
// Everything comes in by flags: the outbox's database and schema, the AMQP
// URL (or a cluster's nodes, separated by commas: each dial tries them in
// order), the relay's name (its claims' claimed_by and its AMQP
// connection_name, so that a test can tell its connections apart) and the
// RelayConfig fields a scenario tunes. It logs to stderr and prints
// "relay NAME ready" and, after a graceful Shutdown, its counts.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/pgstore"
)

func main() {
	var (
		dsn, schema, urls string
		cfg               pgstore.RelayConfig
		grace, heartbeat  time.Duration
		conns             int
	)
	flag.StringVar(&dsn, "pg", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL DSN of the outbox")
	flag.StringVar(&schema, "schema", "", "the outbox's schema (pgstore Config.Schema; required)")
	flag.StringVar(&urls, "amqp", "amqp://guest:guest@127.0.0.1:5672/", "AMQP URL, or a cluster's nodes separated by commas (tried in order)")
	flag.StringVar(&cfg.Name, "name", "", "relay name: its claims' claimed_by and its AMQP connection_name (required)")
	flag.BoolVar(&cfg.Ordered, "ordered", false, "RelayConfig.Ordered")
	flag.IntVar(&cfg.Batch, "batch", 0, "RelayConfig.Batch (0: default)")
	flag.IntVar(&cfg.Concurrency, "concurrency", 0, "RelayConfig.Concurrency (0: default)")
	flag.DurationVar(&cfg.ClaimTTL, "claim-ttl", 0, "RelayConfig.ClaimTTL (0: default)")
	flag.DurationVar(&cfg.PublishTimeout, "publish-timeout", 0, "RelayConfig.PublishTimeout (0: default)")
	flag.DurationVar(&cfg.PollInterval, "poll", 0, "RelayConfig.PollInterval (0: default)")
	flag.DurationVar(&cfg.RetryBackoff, "retry-backoff", 0, "RelayConfig.RetryBackoff (0: default)")
	flag.DurationVar(&cfg.MaxBackoff, "max-backoff", 0, "RelayConfig.MaxBackoff (0: default)")
	flag.IntVar(&cfg.MaxAttempts, "max-attempts", 0, "RelayConfig.MaxAttempts (0: default)")
	flag.DurationVar(&cfg.Retention, "retention", 0, "RelayConfig.Retention (0: default; negative deletes sent rows)")
	flag.DurationVar(&heartbeat, "heartbeat", 2*time.Second, "AMQP heartbeat")
	flag.IntVar(&conns, "pool", 8, "PostgreSQL pool size")
	flag.DurationVar(&grace, "shutdown-timeout", 20*time.Second, "how long Shutdown may wait for the round in flight after SIGTERM")
	flag.Parse()
	if schema == "" || cfg.Name == "" {
		fmt.Fprintln(os.Stderr, "relay: -schema and -name are required")
		os.Exit(2)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("relay", cfg.Name)
	cfg.Logger = log
	name := cfg.Name
	cfg.Dial = func() (*amqp.Connection, error) {
		var errs []error
		for _, url := range strings.Split(urls, ",") {
			conn, err := amqp.DialConfig(url, amqp.Config{
				Heartbeat:  heartbeat,
				Properties: amqp.Table{"connection_name": name},
				Dial:       amqp.DefaultDial(3 * time.Second),
			})
			if err == nil {
				return conn, nil
			}
			errs = append(errs, err)
		}
		return nil, errors.Join(errs...)
	}

	// Signals first: a SIGTERM during the set-up shuts the relay down once
	// it runs.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, os.Interrupt)

	pcfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		fmt.Fprintf(os.Stderr, "relay %s: -pg: %v\n", name, err)
		os.Exit(2)
	}
	pcfg.MaxConns = int32(conns)
	pcfg.ConnConfig.RuntimeParams["application_name"] = name
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "relay %s: %v\n", name, err)
		os.Exit(2)
	}
	defer pool.Close()
	ob, err := pgstore.NewOutbox(pool, pgstore.Config{Schema: schema, CleanupInterval: -1})
	if err != nil {
		fmt.Fprintf(os.Stderr, "relay %s: %v\n", name, err)
		os.Exit(2)
	}
	r, err := pgstore.NewRelay(ob, cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "relay %s: %v\n", name, err)
		os.Exit(2)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	fmt.Printf("relay %s ready pid=%d\n", name, os.Getpid())
	select {
	case err := <-done:
		fmt.Fprintf(os.Stderr, "relay %s: Run returned %v\n", name, err)
		os.Exit(1)
	case sig := <-sigs:
		fmt.Printf("relay %s: %v, shutting down\n", name, sig)
	}
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	serr := r.Shutdown(ctx)
	if err := <-done; err != nil {
		fmt.Fprintf(os.Stderr, "relay %s: Run returned %v\n", name, err)
		os.Exit(1)
	}
	pub, refused, dead := r.Counts()
	fmt.Printf("relay %s stopped published=%d refused=%d dead=%d\n", name, pub, refused, dead)
	if serr != nil {
		fmt.Fprintf(os.Stderr, "relay %s: shutdown: %v\n", name, serr)
		os.Exit(1)
	}
}
