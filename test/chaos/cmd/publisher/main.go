// Command publisher drives a chaos run by hand, next to cmd/consumer: it
// creates a ledger schema, publishes a duplicate-storm workload (each
// operation 1 to -max-copies times, shuffled) and records the operations
// in the ledger, or classifies a finished run.
//
//	publisher -schema chaos_manual -create -queue Q -ops 1000   # then start consumers
//	publisher -schema chaos_manual -classify manual             # once they are done
//	publisher -schema chaos_manual -drop
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"time"

	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

func main() {
	amqpURL := flag.String("amqp", envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "AMQP URL")
	dsn := flag.String("pg", envOr("CHAOS_PG_DSN", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL DSN of the ledger")
	schema := flag.String("schema", "", "ledger schema (required)")
	create := flag.Bool("create", false, "create the ledger schema first")
	drop := flag.Bool("drop", false, "drop the ledger schema and exit")
	classify := flag.String("classify", "", "print the scenario line of the run under this name and exit")
	queue := flag.String("queue", "", "queue to publish to (declared durable if missing)")
	ops := flag.Int("ops", 1000, "unique operations")
	maxCopies := flag.Int("max-copies", 4, "each operation is published 1 to this many times")
	maxWork := flag.Int("max-work-ms", 5, "each handler works 0 to this many ms")
	seed := flag.Uint64("seed", uint64(time.Now().UnixNano()), "random seed")
	flag.Parse()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if err := run(ctx, *amqpURL, *dsn, *schema, *create, *drop, *classify, *queue, *ops, *maxCopies, *maxWork, *seed); err != nil {
		fmt.Fprintln(os.Stderr, "publisher:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, amqpURL, dsn, schema string, create, drop bool, classify, queue string,
	ops, maxCopies, maxWork int, seed uint64) error {
	if schema == "" {
		return fmt.Errorf("-schema is required")
	}
	if drop {
		return ledger.Drop(ctx, dsn, schema)
	}
	if create {
		if err := ledger.Create(ctx, dsn, schema); err != nil {
			return err
		}
	}
	led, err := ledger.Open(ctx, dsn, schema, 2)
	if err != nil {
		return err
	}
	defer led.Close()
	if classify != "" {
		r, err := led.Classify(ctx, classify, nil)
		if err != nil {
			return err
		}
		fmt.Println(r.Line())
		fmt.Println(r.Detail())
		return nil
	}
	if queue == "" {
		return fmt.Errorf("-queue is required")
	}
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	work := workload.Storm(queue+"-op", ops, maxCopies, maxWork, rng)
	recs := make([]ledger.Op, len(work))
	for i, o := range work {
		recs[i] = ledger.Op{ID: o.ID, Expect: ledger.ExpectApply}
	}
	if err := led.AddOps(ctx, recs); err != nil {
		return err
	}
	pub, err := workload.Dial(amqpURL, "chaos-publisher-"+queue)
	if err != nil {
		return err
	}
	defer pub.Close()
	if _, err := pub.Channel().QueueDeclare(queue, true, false, false, false, nil); err != nil {
		return err
	}
	msgs := workload.Messages(work, rng)
	if err := pub.Publish(ctx, queue, msgs); err != nil {
		return err
	}
	fmt.Printf("published %d messages of %d operations to %s (seed %d)\n", len(msgs), ops, queue, seed)
	return nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
