// Command bench measures what amqpidem costs per message, side by side on
// one RabbitMQ and one Redis, in one run (issue 4, `make bench`):
//
//	bare       a plain amqp091-go consumer: manual acks, a pool of workers
//	unique     amqpidem.Consumer on a RedisStore, no-op handler, every key new
//	duplicate  the same, every message a duplicate of completed work
//	outbox     unique whose handler stages one message per message
//	           (amqpidem.Stage, issue 23): stored with the outcome,
//	           published confirmed to a queue of the run's own, the record
//	           amended to say so, then the ack (outbox.go says where the
//	           staged messages go; -outbox-sink whether they are consumed)
//	publish    unique whose handler publishes that same message itself,
//	           confirmed, through amqpidem.Publisher (issue 40): what a
//	           user does without the outbox, at-least-once; to the same
//	           kind of queue (publish.go)
//	naive      SET key NX, no-op handler, SET key done, ack (two round trips)
//	memstore   unique on a lock.MemoryStore: amqpidem's own cost without
//	           Redis, so what the store's round trips and Redis's CPU take
//	           can be read off (not an idempotent setup: one process only)
//	batch      unique as a batch consumer (issue 39): NewBatchConsumer, a
//	           no-op BatchHandler, batches of 100, prefetch and
//	           concurrency the batch consumer's defaults (200)
//	unique-wait  unique with lock.Config.Replicas 1 (issue 13): every write
//	           waits for a replica of Redis that the bench starts
//	           (redis-server on PATH; skipped, saying why, without)
//
// and, on the classic queue, with PostgreSQL (issue 11; see pg.go), each
// handler's effect one INSERT of a row into an effects table:
//
//	pg-unique     amqpidem.Consumer on a pgstore.Store with its TxHandler
//	              (the effect and the completed record in one transaction),
//	              every key new
//	pg-duplicate  the same, every message a duplicate of completed work
//	pg-naive      a plain consumer: autocommit INSERT INTO idem(key) ... ON
//	              CONFLICT DO NOTHING, then if inserted the effect in a
//	              transaction of its own, then ack
//	pg-batch      amqpidem.NewBatchConsumer with pgstore's BatchTxHandler
//	              (issue 39): batches of 100, each batch's effects and
//	              records in one transaction; prefetch and concurrency the
//	              batch consumer's defaults (200), not the ones below
//
// and, on the classic queue, with DynamoDB (issue 25; see dynamo.go), each
// handler's effect one Put of an item:
//
//	dynamo-unique     amqpidem.Consumer on a dynamostore.Store with its
//	                  TxHandler (the effect and the completed record in one
//	                  TransactWriteItems), every key new
//	dynamo-duplicate  the same, every message a duplicate of completed work
//
// All use the same prefetch (128) and concurrency (32), on a classic and
// a quorum queue (the pg variants: classic only). Each run drains a queue
// pre-filled by a confirming publisher; throughput is measured from the
// first ack to the N-th. N is sized by a calibration so that a bare run
// lasts -duration (for the pg variants, so that a pg-naive run does; for
// outbox and publish, so that an outbox run does). Runs are repeated in
// rounds, the order of the variants changing from round to round, and
// medians are reported. Then: the latency each message gains at
// half the bare maximum rate (bare, then unique) and at fixed offered
// rates (-latency-rates, default 1,000 and 5,000 msg/s; bare and unique at
// the same time, one publisher sending each message to both queues, so
// that a stall of the machine or the broker falls on both: pg-batch
// likewise beside a bare consumer of its own), Redis round trips per
// message (go-redis hook: Process plus ProcessPipeline calls), and the
// goroutines and heap of many long handlers in flight. For the PostgreSQL
// variants: statements and committed transactions per message, counted
// client side by a pgx tracer on each variant's pool, beside the server's
// pg_stat_database.xact_commit delta.
//
// It ends with lines a script can read:
//
//	ratio unique/bare classic 0.83
//
// (pg-unique, pg-duplicate and pg-naive have such lines too, on classic;
// outbox's and publish's are in the table only.) Then, per queue type
// measuring both, issue 23's figure, outbox's median rate over unique's,
// and issue 40's, outbox's over publish's (exactly-once publishing against
// at-least-once):
//
//	ratio outbox/unique classic 0.80
//	ratio outbox/publish classic 0.95
//
// Then, per queue type, issue 14's figures: Redis CPU per unique, per
// duplicate and per outbox message in µs; issue 40's: the machine's CPU
// per message of every variant measured, in µs, the median of the rounds
// (this process, plus
// redis-server, plus the RabbitMQ node read from /proc/<pid>/stat, plus
// PostgreSQL's processes for a pg variant; left out when the node is not
// on this machine), and unique's over bare's; and the p99 that unique
// adds over bare, in ms, at each fixed rate (" saturated" when either
// could not keep up with it). (consumer_x, the consumer's CPU over bare's,
// is retired: it rewarded moving work onto the broker; the table keeps
// the client's CPU.)
//
//	redis_us unique classic 24.2
//	redis_us duplicate classic 10.6
//	redis_us outbox classic 30.1
//	machine_us bare classic 68.0
//	machine_us unique classic 94.0
//	...
//	machine_x unique classic 1.38
//	latency_p99_ms 1000 classic 1.4
//	latency_p99_ms 5000 classic 3.9
//
// Then issue 26's figures: the heap allocations of one message on
// lock.RedisStore's own path, client side (go-redis included), measured
// in this process with testing.AllocsPerRun against the same Redis: a new
// key acquired and completed, and a duplicate's Acquire:
//
//	allocs unique 32
//	allocs duplicate 24
//
// After them, the DynamoDB variants' ratios over bare on classic (no
// target: an emulator's speed says little of DynamoDB's):
//
//	ratio dynamo-unique/bare classic 0.02
//	ratio dynamo-duplicate/bare classic 0.26
//
// Then, with PostgreSQL, issue 24's figures for the producer outbox's
// relay (pgstore.Relay; relay.go says how each is measured): its rate
// publishing a full table to a classic queue, and the p99 latency from a
// row's commit to its message's receipt by a consumer at 1,000 rows/s:
//
//	relay_msgs_per_s classic 4196
//	relay_p99_ms classic 42.0
//
// and issue 34's: the time for an ordered relay to drain a backlog of
// 1,000 messages of one order key, in ms ("timeout" instead when it did
// not within -relay-ordered-timeout; 200 messages with -short):
//
//	relay_ordered_drain_ms 1000 2400
//
// Last, with PostgreSQL, issue 26's figures: pg-unique's median rate over
// pg-naive's, and the CPU of every PostgreSQL process per message of
// each, in µs (left out where the server's processes are not readable):
//
//	ratio pg-unique/pg-naive classic 0.64
//	pg_cpu_us pg-unique classic 751.7
//	pg_cpu_us pg-naive classic 357.8
//
// then issue 39's: pg-batch's median rate over pg-naive's, and the
// transactions pg-batch committed per message (client side):
//
//	ratio pg-batch/pg-naive classic 2.75
//	commits_per_msg pg-batch 0.023
//
// Every figure printed is measured in that run. amqpidem is driven through
// its public API only (NewConsumer, NewBatchConsumer, Observer, lock.NewRedisStore,
// lock.NewMemoryStore, pgstore.Migrate, pgstore.New, Store.TxHandler).
//
// REDIS_ADDR, AMQP_URL, PG_DSN and DYNAMODB_ENDPOINT name the services
// (default 127.0.0.1:6379, amqp://guest:guest@127.0.0.1:5672/,
// postgres://postgres@127.0.0.1:5432/test and http://127.0.0.1:8000).
// Every queue and Redis key it makes carries a random run id and is
// deleted before it exits, and so are its PostgreSQL schema
// amqpidem_bench_<run id> and its DynamoDB tables. When PostgreSQL or
// DynamoDB does not answer, the bench says so and runs without their
// variants.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

func main() {
	opts, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if err == flag.ErrHelp {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, opts.Timeout)
	defer cancel()
	if _, err := run(ctx, opts, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// options are the harness's settings; defaultOptions and shortOptions give
// the two presets.
type options struct {
	AMQPURL   string
	RedisAddr string

	// PG runs the PostgreSQL variants (when PostgreSQL answers).
	PG    bool
	PGDSN string
	// PGConns is MaxConns of each PostgreSQL variant's pool.
	PGConns int
	// PGPoolPerRun gives each pg run a pool of its own, every connection
	// opened before measuring, closed after it (which the server's
	// xact_commit figure needs); otherwise the pg runs share one pool
	// that makes its connections as needed.
	PGPoolPerRun bool
	// PGSyncCommit sets synchronous_commit in the variants' sessions;
	// empty: the server's setting.
	PGSyncCommit string

	// Dynamo runs the DynamoDB variants (when the server answers) on the
	// server at DynamoEndpoint (dynamo.go).
	Dynamo         bool
	DynamoEndpoint string
	// DynamoN is the messages of each dynamo run unless N is set.
	DynamoN int

	Prefetch    int
	Concurrency int
	QueueTypes  []string
	// Variants are those measured (bare always); empty: all. The latency
	// phase runs only with unique among them.
	Variants []variant
	BodySize int
	// OutboxSink says whether the outbox variant's staged messages are
	// consumed while it runs: sinkIdle or sinkConsumed (outbox.go).
	OutboxSink string

	// Duration is how long a bare run should last; N is sized from it.
	Duration time.Duration
	// N fixes the messages per run and skips the calibration when > 0.
	N          int
	CalibrateN int
	MinN, MaxN int
	Repeats    int

	LatencyDuration time.Duration
	LatencyWarmup   time.Duration
	// LatencyMaxN caps the messages of a latency run (0: no cap); the rate
	// stays, the run gets shorter.
	LatencyMaxN int
	// LatencyRates are fixed offered rates (msg/s) measured besides half
	// the bare rate, each for bare and unique (issue 14's 1,000 and 5,000).
	LatencyRates []float64
	// LatencyRepeats is how many times each fixed rate's pair of runs is
	// measured; the latency_p99_ms lines give the median of what each
	// pair's p99 added (-short: 1).
	LatencyRepeats int

	// Relay runs the producer outbox relay's phase (relay.go; with
	// PostgreSQL and a classic queue): RelayN rows per rate run (N when
	// -n is set), and a latency run at RelayRate rows/s for
	// LatencyDuration.
	Relay     bool
	RelayN    int
	RelayRate float64
	// RelayOrderedN is the backlog of one order key an ordered relay
	// drains (0: no such run), within RelayOrderedTimeout.
	RelayOrderedN       int
	RelayOrderedTimeout time.Duration

	MemHandlers int
	MemSleep    time.Duration
	MemLeaseTTL time.Duration

	// RunTimeout bounds one run (publishing and consuming); Timeout the
	// whole program.
	RunTimeout time.Duration
	Timeout    time.Duration

	CPUProfile     string
	ProfileVariant string
}

func defaultOptions() options {
	return options{
		AMQPURL:         envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
		RedisAddr:       envOr("REDIS_ADDR", "127.0.0.1:6379"),
		PG:              true,
		PGPoolPerRun:    true,
		PGDSN:           envOr("PG_DSN", defaultPGDSN),
		Dynamo:          true,
		DynamoN:         1000,
		Prefetch:        128,
		Concurrency:     32,
		QueueTypes:      []string{"classic", "quorum"},
		BodySize:        128,
		OutboxSink:      sinkIdle,
		Duration:        4 * time.Second,
		CalibrateN:      20000,
		MinN:            2000,
		MaxN:            1000000,
		Repeats:         3,
		LatencyDuration: 5 * time.Second,
		LatencyWarmup:   500 * time.Millisecond,
		LatencyRates:    []float64{1000, 5000},
		LatencyRepeats:  3,
		Relay:           true,
		RelayN:          20000,
		RelayRate:       1000,
		MemHandlers:     5000,
		MemSleep:        3 * time.Second,
		MemLeaseTTL:     time.Second,
		RunTimeout:      2 * time.Minute,
		Timeout:         20 * time.Minute,

		// Issue 34's figure: relay_ordered_drain_ms 1000.
		RelayOrderedN:       1000,
		RelayOrderedTimeout: time.Minute,
	}
}

// applyShort turns o into the smoke-run preset: tiny fixed N, one round,
// short latency and memory phases. Flags given explicitly keep their value.
func applyShort(o *options, set map[string]bool) {
	short := options{
		N:               300,
		Repeats:         1,
		LatencyDuration: time.Second,
		LatencyWarmup:   100 * time.Millisecond,
		LatencyMaxN:     1000,
		LatencyRepeats:  1,
		MemHandlers:     100,
		MemSleep:        1500 * time.Millisecond,
		MemLeaseTTL:     500 * time.Millisecond,
		RunTimeout:      time.Minute,
		Timeout:         5 * time.Minute,
		// A few ms per row is what the drain should take.
		RelayOrderedN:       200,
		RelayOrderedTimeout: 15 * time.Second,
	}
	if !set["n"] {
		o.N = short.N
	}
	if !set["repeats"] {
		o.Repeats = short.Repeats
	}
	if !set["latency-duration"] {
		o.LatencyDuration = short.LatencyDuration
	}
	if !set["latency-warmup"] {
		o.LatencyWarmup = short.LatencyWarmup
	}
	if !set["latency-max-n"] {
		o.LatencyMaxN = short.LatencyMaxN
	}
	if !set["latency-repeats"] {
		o.LatencyRepeats = short.LatencyRepeats
	}
	if !set["mem-handlers"] {
		o.MemHandlers = short.MemHandlers
	}
	if !set["mem-sleep"] {
		o.MemSleep = short.MemSleep
	}
	if !set["mem-lease-ttl"] {
		o.MemLeaseTTL = short.MemLeaseTTL
	}
	if !set["run-timeout"] {
		o.RunTimeout = short.RunTimeout
	}
	if !set["timeout"] {
		o.Timeout = short.Timeout
	}
	if !set["relay-ordered-n"] {
		o.RelayOrderedN = short.RelayOrderedN
	}
	if !set["relay-ordered-timeout"] {
		o.RelayOrderedTimeout = short.RelayOrderedTimeout
	}
	// Making a pool's connections for each pg run took most of their
	// time in a smoke run.
	if !set["pg-pool-per-run"] {
		o.PGPoolPerRun = false
	}
}

func parseFlags(args []string, out io.Writer) (options, error) {
	o := defaultOptions()
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(out)
	short := fs.Bool("short", false, "smoke run: tiny N, one round, short latency and memory phases (a few seconds)")
	fs.IntVar(&o.Prefetch, "prefetch", o.Prefetch, "QoS prefetch of every consumer")
	fs.IntVar(&o.Concurrency, "concurrency", o.Concurrency, "handlers at once in every consumer")
	queues := fs.String("queues", "classic,quorum", "queue types, comma separated")
	only := fs.String("variants", "", "measure only these variants, comma separated (bare always; duplicate needs unique, pg-duplicate pg-unique; the latency phase and the outbox/unique ratio need unique); empty: all")
	fs.IntVar(&o.BodySize, "body", o.BodySize, "message body size in bytes")
	fs.StringVar(&o.OutboxSink, "outbox-sink", o.OutboxSink, "the outbox variant's queue of staged messages: idle (nobody consumes it; deleted after each run) or consumed (a bare consumer drains it while the run is measured, its CPU in the client's)")
	fs.DurationVar(&o.Duration, "duration", o.Duration, "how long a bare throughput run should last; sizes N")
	fs.IntVar(&o.N, "n", o.N, "messages per throughput run; 0 = calibrate from -duration")
	fs.IntVar(&o.CalibrateN, "calibrate-n", o.CalibrateN, "messages of the calibration run")
	fs.IntVar(&o.MaxN, "max-n", o.MaxN, "upper bound of the calibrated N")
	fs.IntVar(&o.Repeats, "repeats", o.Repeats, "rounds of throughput runs; medians are reported")
	fs.DurationVar(&o.LatencyDuration, "latency-duration", o.LatencyDuration, "length of each latency run")
	fs.DurationVar(&o.LatencyWarmup, "latency-warmup", o.LatencyWarmup, "start of each latency run left out of the percentiles")
	fs.IntVar(&o.LatencyMaxN, "latency-max-n", o.LatencyMaxN, "cap on the messages of a latency run (0: none)")
	fs.IntVar(&o.LatencyRepeats, "latency-repeats", o.LatencyRepeats, "pairs of runs at each fixed rate; latency_p99_ms is the median of what each pair's p99 added")
	rates := fs.String("latency-rates", "1000,5000", "fixed offered rates (msg/s) of latency runs besides half the bare rate, comma separated (empty: none)")
	fs.BoolVar(&o.Relay, "relay", o.Relay, "measure the producer outbox relay (pgstore.Relay) on a classic queue, with PostgreSQL")
	fs.IntVar(&o.RelayN, "relay-n", o.RelayN, "rows of each relay rate run (-n, when set, instead)")
	fs.Float64Var(&o.RelayRate, "relay-rate", o.RelayRate, "rows/s the writers commit in the relay's latency run")
	fs.IntVar(&o.RelayOrderedN, "relay-ordered-n", o.RelayOrderedN, "rows of one order key an ordered relay drains in the relay phase (relay_ordered_drain_ms; -short: 200; 0 skips that run)")
	fs.DurationVar(&o.RelayOrderedTimeout, "relay-ordered-timeout", o.RelayOrderedTimeout, "how long the ordered drain may take before its line says timeout (-short: 15s)")
	fs.IntVar(&o.MemHandlers, "mem-handlers", o.MemHandlers, "long handlers in flight in the memory phase (0 skips it)")
	fs.DurationVar(&o.MemSleep, "mem-sleep", o.MemSleep, "how long each memory-phase handler sleeps")
	fs.DurationVar(&o.MemLeaseTTL, "mem-lease-ttl", o.MemLeaseTTL, "lease TTL in the memory phase (the heartbeat renews it)")
	fs.DurationVar(&o.RunTimeout, "run-timeout", o.RunTimeout, "hard limit of one run")
	fs.DurationVar(&o.Timeout, "timeout", o.Timeout, "hard limit of the whole program")
	fs.BoolVar(&o.PG, "pg", o.PG, "run the PostgreSQL variants (pg-unique, pg-duplicate, pg-naive, pg-batch) on the classic queue")
	fs.StringVar(&o.PGDSN, "pg-dsn", o.PGDSN, "PostgreSQL of the pg variants (env PG_DSN)")
	fs.IntVar(&o.PGConns, "pg-conns", 0, "MaxConns of each pg variant's pool; 0 = -concurrency + 8")
	fs.BoolVar(&o.PGPoolPerRun, "pg-pool-per-run", o.PGPoolPerRun, "a pool of its own for each pg run, all connections opened before measuring (false: one pool for all, connections made as needed, no server figures; -short: false)")
	fs.StringVar(&o.PGSyncCommit, "pg-synchronous-commit", "", "synchronous_commit of the pg variants' sessions (empty: the server's)")
	addDynamoFlags(fs, &o)
	fs.StringVar(&o.CPUProfile, "cpuprofile", "", "write a CPU profile of an extra run (not in the medians) to this file, and its allocations to this file + .allocs (with -base this file + .allocs-base)")
	fs.StringVar(&o.ProfileVariant, "profile-variant", string(unique), "the variant -cpuprofile profiles: "+variantNames())
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	// duplicate replays a round's unique keys: it cannot run alone.
	if v := variant(o.ProfileVariant); !slices.Contains(variants, v) || v.replays() {
		return o, fmt.Errorf("-profile-variant %q: want one of %s", o.ProfileVariant, variantNames())
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *short {
		applyShort(&o, set)
	}
	o.QueueTypes = splitList(*queues)
	o.LatencyRates = nil
	for _, r := range splitList(*rates) {
		f, err := strconv.ParseFloat(r, 64)
		if err != nil || f <= 0 {
			return o, fmt.Errorf("-latency-rates: %q is not a positive rate", r)
		}
		o.LatencyRates = append(o.LatencyRates, f)
	}
	for _, name := range splitList(*only) {
		o.Variants = append(o.Variants, variant(name))
	}
	if o.PGConns == 0 {
		// A TxHandler holds a connection for as long as its handler runs;
		// Acquire, the outcome calls and the heartbeat need some beside
		// those (pgstore.New). The report's "pool waits" column shows
		// whether any acquire had to wait.
		o.PGConns = o.Concurrency + 8
	}
	return o, o.validate()
}

func (o options) validate() error {
	switch {
	case o.Prefetch < 1:
		return fmt.Errorf("-prefetch %d must be at least 1", o.Prefetch)
	case o.Concurrency < 1:
		return fmt.Errorf("-concurrency %d must be at least 1", o.Concurrency)
	case len(o.QueueTypes) == 0:
		return fmt.Errorf("-queues names no queue type")
	case o.BodySize < 0:
		return fmt.Errorf("-body %d must not be negative", o.BodySize)
	case o.N < 0:
		return fmt.Errorf("-n %d must not be negative", o.N)
	case o.N == 0 && (o.Duration <= 0 || o.CalibrateN < 1 || o.MaxN < o.MinN):
		return fmt.Errorf("-duration, -calibrate-n and -max-n must be positive to calibrate N")
	case o.Repeats < 1:
		return fmt.Errorf("-repeats %d must be at least 1", o.Repeats)
	case o.LatencyDuration <= 0 || o.LatencyWarmup < 0 || o.LatencyWarmup >= o.LatencyDuration:
		return fmt.Errorf("-latency-duration must be positive and longer than -latency-warmup")
	case o.LatencyMaxN < 0:
		return fmt.Errorf("-latency-max-n %d must not be negative", o.LatencyMaxN)
	case o.LatencyRepeats < 1:
		return fmt.Errorf("-latency-repeats %d must be at least 1", o.LatencyRepeats)
	case o.Relay && (o.RelayN < 1 || o.RelayRate <= 0):
		return fmt.Errorf("-relay-n and -relay-rate must be positive")
	case o.RelayOrderedN < 0 || o.RelayOrderedN > 0 && o.RelayOrderedTimeout <= 0:
		return fmt.Errorf("-relay-ordered-n must not be negative, and -relay-ordered-timeout must be positive")
	case o.MemHandlers < 0:
		return fmt.Errorf("-mem-handlers %d must not be negative", o.MemHandlers)
	case o.MemHandlers > 0 && o.MemSleep <= o.MemLeaseTTL:
		return fmt.Errorf("-mem-sleep %v must be longer than -mem-lease-ttl %v so that the heartbeat runs", o.MemSleep, o.MemLeaseTTL)
	case o.OutboxSink != sinkIdle && o.OutboxSink != sinkConsumed:
		return fmt.Errorf("-outbox-sink %q: want %s or %s", o.OutboxSink, sinkIdle, sinkConsumed)
	case o.PGConns < 1 || o.PGConns > 1000:
		return fmt.Errorf("-pg-conns %d must be between 1 and 1000", o.PGConns)
	case variant(o.ProfileVariant).isPG() && o.CPUProfile != "" && !o.PG:
		return fmt.Errorf("-profile-variant %s needs the PostgreSQL variants (-pg)", o.ProfileVariant)
	case o.RunTimeout <= 0 || o.Timeout <= 0:
		return fmt.Errorf("-run-timeout and -timeout must be positive")
	}
	for _, qt := range o.QueueTypes {
		if qt != "classic" && qt != "quorum" {
			return fmt.Errorf("-queues: %q is not classic or quorum", qt)
		}
	}
	for _, v := range o.Variants {
		if !slices.Contains(variants, v) {
			return fmt.Errorf("-variants: %q is not one of %v", v, variants)
		}
	}
	for _, pair := range [][2]variant{{duplicate, unique}, {pgDuplicate, pgUnique}, {dynamoDuplicate, dynamoUnique}} {
		if o.measures(pair[0]) && !o.measures(pair[1]) {
			return fmt.Errorf("-variants: %s replays what %s completed: add %s", pair[0], pair[1], pair[1])
		}
	}
	return nil
}

// measures says whether variant v is to be measured.
func (o options) measures(v variant) bool {
	return len(o.Variants) == 0 || v == bare || slices.Contains(o.Variants, v)
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// variantNames lists the variants -profile-variant takes.
func variantNames() string {
	var names []string
	for _, v := range variants {
		if !v.replays() {
			names = append(names, string(v))
		}
	}
	return strings.Join(names, ", ")
}
