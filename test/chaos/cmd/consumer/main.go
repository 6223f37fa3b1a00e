// Command consumer is the chaos suite's consumer process: one
// amqpidem.Consumer whose handler writes to the run's PostgreSQL ledger and
// follows the plan in each message (work, fail, crash in a chosen window).
// With -store-pg it keeps its records in PostgreSQL (pgstore) instead of
// Redis and inserts its effect in pgstore's transaction; with
// -store-dynamo likewise in DynamoDB (dynamostore). With -stage-to it
// is stage A of a two-stage pipeline: its handler stages one message per
// operation for stage B (amqpidem.Stage) instead of writing the ledger.
// With -history it records its store's history (every call and return,
// wall-clock times) in a file, for a linearizability check.
// The tests build it once per run and start, kill, pause and restart it.
//
//	consumer -name c1 -queue Q -prefix P -schema S \
//	    -amqp amqp://guest:guest@127.0.0.1:5672/ -redis 127.0.0.1:6379 \
//	    -pg 'postgres://postgres@127.0.0.1:5432/test?sslmode=disable'
//
// SIGTERM or SIGINT shut it down gracefully (in-flight handlers get
// -shutdown-timeout, 20 s by default, then are cancelled).
// It exits 2 when the configuration is refused, 1 when consuming fails.
package main

import (
	"bytes"
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

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
)

func main() {
	var cfg worker.Config
	var quorum, quorumDLQ bool
	var deliveryLimit int
	var level slog.Level
	var grace time.Duration
	flag.StringVar(&cfg.Name, "name", "", "consumer and AMQP connection name (required)")
	flag.StringVar(&cfg.AMQPURL, "amqp", envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "AMQP URL, or the URLs of a cluster's nodes separated by commas (tried in order)")
	flag.StringVar(&cfg.RedisAddr, "redis", envOr("REDIS_ADDR", "127.0.0.1:6379"), "Redis host:port")
	flag.StringVar(&cfg.PGDSN, "pg", envOr("CHAOS_PG_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL DSN of the ledger")
	flag.StringVar(&cfg.Schema, "schema", "", "ledger schema (required)")
	flag.StringVar(&cfg.Queue, "queue", "", "queue to consume (required)")
	flag.StringVar(&cfg.Prefix, "prefix", "", "Redis key prefix")
	flag.StringVar(&cfg.EventsPath, "events", "", "append every outcome to this file as JSON lines")
	flag.StringVar(&cfg.HistoryPath, "history", "", "record every call on the store and its return in this new file, for a linearizability check (test/linearizable)")
	flag.DurationVar(&cfg.LeaseTTL, "lease", 0, "amqpidem Config.LeaseTTL (0: default)")
	flag.DurationVar(&cfg.StoreLeaseTTL, "store-lease", 0, "lock Config.LeaseTTL (0: default)")
	flag.DurationVar(&cfg.Retention, "retention", 0, "amqpidem Config.Retention (0: default)")
	flag.DurationVar(&cfg.InProgressDelay, "in-progress-delay", 0, "amqpidem Config.InProgressDelay (0: default)")
	flag.DurationVar(&cfg.UnavailableDelay, "unavailable-delay", 0, "amqpidem Config.UnavailableDelay (0: default)")
	flag.DurationVar(&cfg.Backoff, "backoff", 0, "first retry delay, doubling up to 2s (0: library default)")
	flag.IntVar(&cfg.MaxAttempts, "max-attempts", 0, "amqpidem Config.MaxAttempts (0: default)")
	flag.IntVar(&cfg.Prefetch, "prefetch", 0, "QoS prefetch (0: default)")
	flag.IntVar(&cfg.Concurrency, "concurrency", 0, "handlers at once (0: prefetch)")
	flag.BoolVar(&quorum, "quorum", false, "declare the queue as a quorum queue")
	flag.IntVar(&deliveryLimit, "delivery-limit", 0, "quorum queue x-delivery-limit (0: none)")
	flag.BoolVar(&quorumDLQ, "quorum-dlq", false, "declare the dead-letter queue as a quorum queue")
	flag.BoolVar(&cfg.DelayInProcess, "delay-in-process", false, "amqpidem Config.DelayInProcess: wait out requeue delays in the consumer")
	flag.StringVar(&cfg.KeyHeader, "key-header", "", "read the idempotency key from this header instead of message-id")
	flag.StringVar(&cfg.DeadLetterExchange, "dlx", "", "amqpidem Config.DeadLetterExchange")
	flag.StringVar(&cfg.DeadLetterRoutingKey, "dlrk", "", "amqpidem Config.DeadLetterRoutingKey")
	var signingKeyFile string
	flag.StringVar(&signingKeyFile, "signing-key-file", "", "amqpidem Config.SigningKey: sign every copy with the key in this file (its final newline dropped)")
	flag.BoolVar(&cfg.Fixed, "fixed", false, "the handler is fixed: plans marked broken succeed")
	flag.BoolVar(&cfg.AckFailedDuplicates, "ack-failed-duplicates", false, "ack duplicates of failed work instead of dead-lettering them")
	flag.DurationVar(&cfg.Heartbeat, "heartbeat", 0, "AMQP heartbeat (0: 10s)")
	flag.DurationVar(&cfg.RedisTimeout, "redis-timeout", 0, "Redis dial/read/write timeout (0: 1s)")
	var sentinels string
	flag.StringVar(&sentinels, "sentinels", "", "reach Redis through these Sentinels (host:port,...) instead of -redis")
	flag.StringVar(&cfg.MasterName, "master", "", "the Sentinels' master name")
	flag.IntVar(&cfg.Replicas, "replicas", 0, "lock Config.Replicas: wait for this many replicas on every write")
	flag.StringVar(&cfg.StoreDSN, "store-pg", "", "keep the records in PostgreSQL (pgstore) at this DSN instead of Redis; the handler then inserts its effect in pgstore's transaction")
	flag.StringVar(&cfg.StoreAppName, "store-app", "", "application_name of the pgstore connections (default <name>-store)")
	flag.BoolVar(&cfg.RowLeases, "row-leases", false, "with -store-pg: pgstore Config.RowLeases (every lease a record row, none held by the handler's transaction)")
	flag.StringVar(&cfg.DynamoEndpoint, "store-dynamo", "", "keep the records in DynamoDB (dynamostore) on the server at this endpoint instead of Redis; the handler then puts its effect in dynamostore's transaction")
	flag.StringVar(&cfg.DynamoTable, "dynamo-table", "", "with -store-dynamo: the records table")
	flag.StringVar(&cfg.DynamoEffects, "dynamo-effects", "", "with -store-dynamo: the table of the handler's effect items")
	flag.StringVar(&cfg.StageTo, "stage-to", "", "stage A of a pipeline: stage one message per operation with this routing key (amqpidem.Stage) instead of writing the ledger")
	flag.StringVar(&cfg.StageExchange, "stage-exchange", "", "the exchange -stage-to's messages are published to (default: the default exchange, -stage-to naming a queue)")
	flag.TextVar(&level, "log-level", slog.LevelWarn, "log level of the library's logs on stderr")
	flag.DurationVar(&grace, "shutdown-timeout", 20*time.Second, "how long in-flight handlers may run on after SIGTERM")
	flag.Parse()

	if cfg.Name == "" || cfg.Schema == "" || cfg.Queue == "" {
		fmt.Fprintln(os.Stderr, "consumer: -name, -schema and -queue are required")
		os.Exit(2)
	}
	if signingKeyFile != "" {
		b, err := os.ReadFile(signingKeyFile)
		if err != nil {
			fmt.Fprintf(os.Stderr, "consumer: -signing-key-file: %v\n", err)
			os.Exit(2)
		}
		cfg.SigningKey = bytes.TrimRight(b, "\r\n")
	}
	if sentinels != "" {
		cfg.SentinelAddrs = strings.Split(sentinels, ",")
	}
	if quorumDLQ {
		cfg.DeadLetterQueueArgs = amqp.Table{"x-queue-type": "quorum"}
	}
	if quorum {
		cfg.QueueArgs = amqp.Table{"x-queue-type": "quorum"}
		if deliveryLimit > 0 {
			cfg.QueueArgs["x-delivery-limit"] = int64(deliveryLimit)
		}
	}
	cfg.AllowCrash = true
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("consumer", cfg.Name)

	// Signals first: a SIGTERM that comes while the worker is being set up
	// waits in sigs and shuts it down once it runs, instead of killing the
	// process outright.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, os.Interrupt)

	w, err := worker.New(context.Background(), cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "consumer %s: %v\n", cfg.Name, err)
		os.Exit(2)
	}
	fmt.Printf("consumer %s ready pid=%d\n", cfg.Name, os.Getpid())

	done := make(chan error, 1)
	go func() {
		sig := <-sigs
		fmt.Printf("consumer %s: %v, shutting down\n", cfg.Name, sig)
		ctx, cancel := context.WithTimeout(context.Background(), grace)
		defer cancel()
		done <- w.Shutdown(ctx)
	}()
	err = w.Run(context.Background())
	if !errors.Is(err, amqpidem.ErrConsumerClosed) {
		fmt.Fprintf(os.Stderr, "consumer %s: %v\n", cfg.Name, err)
		os.Exit(1)
	}
	switch err := <-done; {
	case errors.Is(err, context.DeadlineExceeded):
		fmt.Printf("consumer %s: handlers still running after -shutdown-timeout were cancelled\n", cfg.Name)
	case err != nil:
		fmt.Fprintf(os.Stderr, "consumer %s: shutdown: %v\n", cfg.Name, err)
		os.Exit(1)
	}
	fmt.Printf("consumer %s stopped\n", cfg.Name)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
