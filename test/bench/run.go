package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// variant is one of the consumers compared.
type variant string

const (
	bare      variant = "bare"
	unique    variant = "unique"
	duplicate variant = "duplicate"
	naive     variant = "naive"
	// memstore is unique on lock.MemoryStore: amqpidem's own cost with
	// no Redis at all, the ceiling a faster store could approach.
	memstore variant = "memstore"
	// uniqueWait is unique with lock.Config.Replicas 1: every write waits
	// for a replica the bench starts (issue 13).
	uniqueWait variant = "unique-wait"
	// outbox is unique whose handler stages one message per message
	// (issue 23): amqpidem stores it with the outcome, publishes it
	// confirmed to a queue of the run's own (see outboxSink), amends the
	// record, then acks.
	outbox variant = "outbox"
	// batchV is unique as a batch consumer (issue 39):
	// amqpidem.NewBatchConsumer, a no-op BatchHandler, batches of up to
	// pgBatchSize; prefetch and concurrency the batch consumer's defaults
	// (twice that). Its leases and records are Redis calls of their own,
	// which the RedisStore sends in pipelines.
	batchV variant = "batch"
	// publishV is unique whose handler publishes one message per message
	// itself, confirmed, through amqpidem.Publisher (issue 40): what a
	// user does without the outbox, at-least-once (publish.go).
	publishV variant = "publish"
)

// variants in the order of the tables.
var variants = []variant{bare, unique, duplicate, outbox, publishV, naive, memstore, batchV, uniqueWait, pgUnique, pgDuplicate, pgNaive, pgBatch, dynamoUnique, dynamoDuplicate}

// replays says whether v replays the keys another variant completed in
// the same round, so that it cannot run alone.
func (v variant) replays() bool { return v == duplicate || v == pgDuplicate || v == dynamoDuplicate }

// Lease and retention of the throughput and latency runs. The lease is
// amqpidem's default; retention is short so that keys a killed run leaves
// behind expire on their own.
const (
	leaseTTL  = amqpidem.DefaultLeaseTTL
	retention = time.Hour
)

// env is what every phase shares.
type env struct {
	opts  options
	out   io.Writer
	base  string // "amqpidem-bench-<run id>": prefix of every queue and key
	brk   *broker
	rdb   *redis.Client // the stores' and naive's client, counted by rts
	rts   *roundTrips
	admin *redis.Client // cleanup and INFO, not counted
	body  []byte
	pg    *pgEnv // nil: no PostgreSQL variants
	// pgHint says what to start when PostgreSQL did not answer.
	pgHint string
	// dyn is the DynamoDB side (dynamo.go); nil: no dynamo variants.
	dyn *dynEnv
	// replica is the bench's replica of Redis, for unique-wait; nil when
	// that variant does not run (see report.WaitSkipped).
	replica *replica
	// latencyGroups counts the latency groups run (latencyGroup).
	latencyGroups int
}

// report is everything a run measured; bench_test reads it.
type report struct {
	Base string
	N    map[string]int
	// NPG is the messages of each PostgreSQL run: sized so that a
	// pg-naive run lasts -duration (as N for bare), since at bare's N the
	// pg runs would take minutes each.
	NPG int
	// NOutbox is the messages of each outbox run per queue type, sized
	// so that an outbox run lasts -duration: at bare's N, with staged
	// messages published at a twentieth of bare's rate, one run took
	// over a minute, close to -run-timeout.
	NOutbox map[string]int
	// Variants are the variants measured on each queue type, in table
	// order.
	Variants map[string][]variant
	Runs     []runResult
	Latency  []latencyResult
	Memory   *memoryResult
	Ratios   []ratio
	// OutboxRatios are outbox's median rate over unique's, per queue
	// type measuring both (issue 23's figure).
	OutboxRatios []ratio
	// BrokerPID is the RabbitMQ node's pid when it ran on this machine
	// at the start (its CPU measured: machine_us; each run looks it up
	// again), else 0.
	BrokerPID int
	// PublishRatios are outbox's median rate over publish's, per queue
	// type measuring both (issue 40's figure).
	PublishRatios []ratio
	// Allocs are the allocations per message on lock.RedisStore's path.
	Allocs  *allocsResult
	Profile string
	// Steps are the profiled run's step times, when it has them.
	Steps    *stepTimes
	LeftKeys int // keys of this run still in Redis after cleanup
	// PGSkipped says why the PostgreSQL variants did not run ("" when
	// they did); PGSchema is the run's schema, PGDropped whether it was
	// dropped and checked gone.
	PGSkipped string
	// WaitSkipped says why unique-wait did not run (no replica), if so.
	WaitSkipped string
	PGSchema    string
	PGDropped   bool
	// PGCPU says whether the PostgreSQL server's processes were readable
	// here, so that its CPU per message was measured.
	PGCPU bool
	// NDynamo is the messages of each DynamoDB run (-dynamo-n, or -n);
	// DynamoSkipped says why the
	// DynamoDB variants did not run ("" when they did).
	NDynamo       int
	DynamoSkipped string
	// Relay are the producer outbox relay's rate runs, RelayLatency its
	// latency run; RelaySkipped says why they did not run, if so.
	Relay        []relayRun
	RelayLatency *relayLatency
	// RelayOrdered is the ordered relay's drain of one key's backlog
	// (issue 34); nil with -relay-ordered-n 0.
	RelayOrdered *relayOrderedDrain
	RelaySkipped string
}

// runResult is one throughput run.
type runResult struct {
	QueueType string
	Variant   variant
	Round     int
	N         int
	// Settled counts messages settled as the variant expects (acked;
	// amqpidem: outcome Completed for unique, Duplicate for duplicate);
	// Unexpected counts everything else.
	Settled, Unexpected int
	FirstUnexpected     string
	Span                time.Duration // first settlement to the N-th
	Rate                float64       // (N-1)/Span, messages per second
	Publish             time.Duration // prefill time
	// Batches is how many handler batches a batch variant's consumer
	// ran (amqpidem.BatchInfo, splits not counted), BatchMsgs the
	// deliveries they gathered (each batch's Size).
	Batches, BatchMsgs int64
	RoundTrips         int64 // Redis round trips while consuming
	// Reads and Writes are the read and write system calls of this
	// process while consuming (/proc/self/io): a write is a flush of a
	// connection's buffer, to RabbitMQ or Redis.
	Reads, Writes int64
	ClientCPU     time.Duration // this process, while consuming
	ClientAllocs  uint64        // heap objects this process allocated while consuming
	ClientBytes   uint64        // and their bytes
	RedisCPU      time.Duration // the Redis server, while consuming
	MachineCPU    time.Duration // every process on the machine, while consuming (/proc/stat)
	BrokerCPU     time.Duration // the RabbitMQ node, while consuming (0: not measured, or under a tick)
	// ProcCPU is the machine CPU of the run's own processes while
	// consuming: this one, redis-server, the RabbitMQ node, and
	// PostgreSQL's for a pg variant (issue 40's machine_us); 0 when the
	// broker's is not measured. Unlike MachineCPU, other work on the
	// machine does not count in it.
	ProcCPU time.Duration

	// The PostgreSQL variants: what the run's pool did over its life,
	// PostgreSQL's CPU (every process of the server) while consuming, and
	// the effect rows the run left against those it should have.
	PG                  *pgCounts
	PGCPU               time.Duration
	EffectRows, Effects int

	// Staged is, for outbox and publish, the messages staged (published)
	// that reached the run's outbox queue (one per message is right).
	Staged int
	// Steps are the profiled run's step times (amqpidem variants on Redis
	// or MemoryStore); nil otherwise.
	Steps *stepTimes
}

type ratio struct {
	Variant   variant
	QueueType string
	Value     float64
}

func run(ctx context.Context, opts options, out io.Writer) (rep *report, err error) {
	started := time.Now()
	e := &env{opts: opts, out: out, base: "amqpidem-bench-" + randomHex(4), rts: &roundTrips{}}
	rep = &report{Base: e.base, N: map[string]int{}, NOutbox: map[string]int{}, Variants: map[string][]variant{}}
	e.body = make([]byte, opts.BodySize)
	for i := range e.body {
		e.body[i] = 'a' + byte(i%26)
	}

	e.rdb = redis.NewClient(&redis.Options{Addr: opts.RedisAddr})
	e.rdb.AddHook(e.rts)
	defer e.rdb.Close()
	e.admin = redis.NewClient(&redis.Options{Addr: opts.RedisAddr})
	defer e.admin.Close()
	if err := pingRedis(ctx, e.admin); err != nil {
		return rep, err
	}
	if e.brk, err = dialBroker(opts.AMQPURL); err != nil {
		return rep, err
	}
	rep.BrokerPID = brokerPID(opts.AMQPURL)
	defer func() {
		// Whatever happened: delete this run's queues and keys.
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cerr := e.brk.close()
		if _, kerr := deleteKeys(cctx, e.admin, e.base+"*"); kerr != nil {
			cerr = errors.Join(cerr, fmt.Errorf("deleting keys %s*: %w", e.base, kerr))
		}
		left, kerr := countKeys(cctx, e.admin, e.base+"*")
		rep.LeftKeys = left
		if kerr == nil && left > 0 {
			kerr = fmt.Errorf("%d keys %s* left in Redis", left, e.base)
		}
		err = errors.Join(err, cerr, kerr)
	}()
	if e.opts.measures(uniqueWait) {
		if e.replica, err = startReplica(ctx, opts.RedisAddr); err != nil {
			rep.WaitSkipped = err.Error()
		} else {
			defer e.replica.stop()
		}
	}
	if err := e.openPG(ctx, rep); err != nil {
		return rep, err
	}
	if e.pg != nil {
		defer func() {
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err = errors.Join(err, e.pg.close(cctx))
			rep.PGDropped = e.pg.dropped
		}()
	}
	if err := e.openDynamoEnv(ctx, rep); err != nil {
		return rep, err
	}
	if e.dyn != nil {
		defer func() {
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err = errors.Join(err, e.dyn.close(cctx))
		}()
	}
	// Load the scripts once, outside every measurement.
	check, err := lock.NewRedisStore(e.rdb, lock.Config{Prefix: e.base + "-check"})
	if err != nil {
		return rep, err
	}
	if err := check.Check(ctx); err != nil {
		return rep, err
	}

	fmt.Fprintf(out, "amqpidem bench %s  %s %s/%s, %d CPUs (GOMAXPROCS %d)\n",
		time.Now().Format(time.DateTime), runtime.Version(), runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0))
	fmt.Fprintf(out, "RabbitMQ %s at %s, Redis %s at %s (go-redis default pool, %d conns)\n",
		e.brk.version(), redactURL(opts.AMQPURL), redisVersion(ctx, e.admin), opts.RedisAddr, e.rdb.Options().PoolSize)
	if e.pg != nil {
		fmt.Fprintf(out, "PostgreSQL %s at %s (pg variants: schema %s, pools of at most %d conns: %s; synchronous_commit %s)\n",
			e.pg.version, redactDSN(opts.PGDSN), e.pg.schema, e.pg.conns, openedWhen(opts.PGPoolPerRun), e.pg.syncCommit)
	} else {
		fmt.Fprintf(out, "PostgreSQL variants skipped: %s\n%s", rep.PGSkipped, e.pgHint)
	}
	if e.dyn != nil {
		fmt.Fprintf(out, "DynamoDB at %s (dynamo variants: a records table per round, %s-*-records)\n", opts.DynamoEndpoint, e.base)
	} else {
		fmt.Fprintf(out, "DynamoDB variants skipped: %s\n", rep.DynamoSkipped)
	}
	fmt.Fprintf(out, "prefetch %d, concurrency %d, %d-byte persistent messages, %d round(s), run id %s\n",
		opts.Prefetch, opts.Concurrency, opts.BodySize, opts.Repeats, e.base)
	fmt.Fprintf(out, "load average at start: %s (other work on this machine skews single runs; compare ratios)\n\n", loadAvg())

	// 1. N per queue type.
	for _, qt := range opts.QueueTypes {
		n := opts.N
		if n == 0 {
			if n, err = e.calibrate(ctx, qt, bare, opts.CalibrateN); err != nil {
				return rep, fmt.Errorf("calibration on %s: %w", qt, err)
			}
		}
		rep.N[qt] = n
		// outbox and publish run the same N, sized by outbox's rate
		// (publish's when outbox is not measured).
		cal := variant("")
		switch {
		case opts.measures(outbox):
			cal = outbox
		case opts.measures(publishV):
			cal = publishV
		}
		if cal != "" {
			if n = opts.N; n == 0 {
				if n, err = e.calibrate(ctx, qt, cal, max(opts.CalibrateN/4, opts.MinN)); err != nil {
					return rep, fmt.Errorf("calibration of %s on %s: %w", cal, qt, err)
				}
			}
			rep.NOutbox[qt] = n
		}
	}
	if e.pg != nil {
		rep.NPG = opts.N
		if rep.NPG == 0 {
			if rep.NPG, err = e.calibrate(ctx, "classic", pgNaive, max(opts.CalibrateN/4, opts.MinN)); err != nil {
				return rep, fmt.Errorf("calibration of pg-naive: %w", err)
			}
		}
	}

	if e.dyn != nil {
		rep.NDynamo = cmp.Or(opts.N, opts.DynamoN) // not calibrated: see dynamo.go
	}

	// 2. Throughput, in rounds; the order of the variants changes from
	// round to round (roundOrder) so that drift, and the aftermath of a
	// run (its queue's deletion, the collection of its garbage), hit all
	// alike rather than the same successor. duplicate follows unique in
	// each round: it replays unique's keys, completed by then.
	// pg-duplicate likewise follows pg-unique.
	for _, qt := range opts.QueueTypes {
		for _, u := range e.units(qt) {
			rep.Variants[qt] = append(rep.Variants[qt], u...)
		}
	}
	fmt.Fprintf(out, "throughput runs (queue drained from full; rate = (N-1) / time from first to N-th settlement):\n")
	for round := 1; round <= opts.Repeats; round++ {
		for _, qt := range opts.QueueTypes {
			units := e.units(qt)
			for _, k := range roundOrder(len(units), round) {
				for _, v := range units[k] {
					r, err := e.throughput(ctx, qt, v, round, rep.n(qt, v), nil)
					rep.Runs = append(rep.Runs, r)
					if err != nil {
						return rep, fmt.Errorf("round %d, %s %s: %w", round, qt, v, err)
					}
					fmt.Fprintf(out, "  round %d %-7s %-12s %9s msg/s  N %d in %v (prefill %v)%s%s%s\n", round, qt, v,
						thousands(r.Rate), r.N, r.Span.Round(time.Millisecond), r.Publish.Round(time.Millisecond), pgNote(r), stagedNote(r), unexpectedNote(r))
				}
			}
			// The round's records are no longer needed.
			if err := e.deleteRound(ctx, e.roundPrefix(qt, round)); err != nil {
				return rep, err
			}
			if e.pg != nil && qt == "classic" {
				if err := e.pg.truncate(ctx); err != nil {
					return rep, err
				}
			}
		}
	}
	fmt.Fprintln(out)
	rep.Ratios = ratios(rep.Runs, opts.QueueTypes, rep.Variants)
	rep.OutboxRatios = outboxRatios(rep.Runs, opts.QueueTypes, rep.Variants, unique)
	rep.PublishRatios = outboxRatios(rep.Runs, opts.QueueTypes, rep.Variants, publishV)

	// 3. Latency at half the bare median rate, bare and unique one after
	// the other (two consumers at that rate at once would saturate the
	// machine), and at the fixed rates, side by side (latencyGroup).
	for _, qt := range opts.QueueTypes {
		if !opts.measures(unique) {
			break
		}
		half := 0.5 * median(rates(rep.Runs, qt, bare))
		for _, v := range []variant{bare, unique} {
			ls, err := e.latencyGroup(ctx, qt, half, v)
			rep.Latency = append(rep.Latency, ls...)
			if err != nil {
				return rep, fmt.Errorf("latency %s %s at %s msg/s: %w", qt, v, thousands(half), err)
			}
		}
		// One group, not two: compared with each other.
		rep.Latency[len(rep.Latency)-1].Group = rep.Latency[len(rep.Latency)-2].Group
		for range opts.LatencyRepeats {
			for _, rate := range opts.LatencyRates {
				ls, err := e.latencyGroup(ctx, qt, rate, bare, unique)
				rep.Latency = append(rep.Latency, ls...)
				if err != nil {
					return rep, fmt.Errorf("latency %s at %s msg/s: %w", qt, thousands(rate), err)
				}
			}
		}
	}

	// 3a. pg-batch's latency at the fixed rates (issue 39), beside a
	// bare consumer of its own.
	if e.pg != nil && opts.measures(pgBatch) && slices.Contains(opts.QueueTypes, "classic") {
		for range opts.LatencyRepeats {
			for _, rate := range opts.LatencyRates {
				ls, err := e.latencyGroup(ctx, "classic", rate, bare, pgBatch)
				rep.Latency = append(rep.Latency, ls...)
				if err != nil {
					return rep, fmt.Errorf("latency classic pg-batch at %s msg/s: %w", thousands(rate), err)
				}
			}
		}
	}

	// 3b. The producer outbox's relay.
	switch {
	case !opts.Relay:
		rep.RelaySkipped = "-relay=false"
	case e.pg == nil:
		rep.RelaySkipped = "it needs PostgreSQL (" + rep.PGSkipped + ")"
	case !slices.Contains(opts.QueueTypes, "classic"):
		rep.RelaySkipped = "it runs on a classic queue, and -queues has none"
	default:
		fmt.Fprintf(out, "producer outbox relay runs (rows written up front, then one relay; rate = rows / time until all sent and consumed):\n")
		if err := e.relayPhase(ctx, rep); err != nil {
			return rep, err
		}
		fmt.Fprintln(out)
	}

	// 4. Many long handlers in flight.
	if opts.MemHandlers > 0 {
		m, err := e.memory(ctx, opts.QueueTypes[0])
		rep.Memory = &m
		if err != nil {
			return rep, fmt.Errorf("memory phase: %w", err)
		}
	}

	// 5. Allocations per message on the store's path (issue 26).
	if rep.Allocs, err = measureAllocs(ctx, opts.RedisAddr, e.base+"-allocs"); err != nil {
		return rep, err
	}

	// 6. A CPU profile of one more run, not in the medians.
	if opts.CPUProfile != "" {
		qt, v := opts.QueueTypes[0], variant(opts.ProfileVariant)
		if v.isPG() {
			if e.pg == nil {
				return rep, fmt.Errorf("-profile-variant %s: %s", v, rep.PGSkipped)
			}
			qt = "classic"
		}
		n := rep.n(qt, v)
		if n == 0 {
			return rep, fmt.Errorf("-profile-variant %s runs on a classic queue: add classic to -queues", v)
		}
		r, err := e.throughput(ctx, qt, v, 0, n, &opts.CPUProfile)
		if err != nil {
			return rep, fmt.Errorf("profiled run: %w", err)
		}
		rep.Steps = r.Steps
		rep.Profile = fmt.Sprintf("CPU profile of an extra %s run on %s (%s msg/s, N %d, not in the medians): %s",
			v, qt, thousands(r.Rate), r.N, opts.CPUProfile)
	}

	printReport(out, e, rep)
	fmt.Fprintf(out, "\nload average at end: %s\n", loadAvg())
	fmt.Fprintf(out, "bench took %v\n\n", time.Since(started).Round(time.Second))
	for _, r := range rep.Ratios {
		fmt.Fprintf(out, "ratio %s/bare %s %.2f\n", r.Variant, r.QueueType, r.Value)
	}
	for _, r := range rep.OutboxRatios {
		fmt.Fprintf(out, "ratio outbox/unique %s %.2f\n", r.QueueType, r.Value)
	}
	for _, r := range rep.PublishRatios {
		fmt.Fprintf(out, "ratio outbox/publish %s %.2f\n", r.QueueType, r.Value)
	}
	printTargets(out, opts, rep)
	printAllocs(out, rep)
	printDynamoRatios(out, rep)
	printRelayLines(out, rep)
	printPGLines(out, rep)
	printBatchSizes(out, rep)
	var bad []string
	for _, r := range rep.Runs {
		if r.Unexpected > 0 {
			bad = append(bad, fmt.Sprintf("round %d %s %s: %d unexpected (first: %s)", r.Round, r.QueueType, r.Variant, r.Unexpected, r.FirstUnexpected))
		}
		if r.EffectRows != r.Effects {
			bad = append(bad, fmt.Sprintf("round %d %s %s: %d effect rows, want %d", r.Round, r.QueueType, r.Variant, r.EffectRows, r.Effects))
		}
		if (r.Variant == outbox || r.Variant == publishV) && r.Staged != r.N {
			bad = append(bad, fmt.Sprintf("round %d %s %s: %d staged messages reached the outbox queue, want %d", r.Round, r.QueueType, r.Variant, r.Staged, r.N))
		}
	}
	if len(bad) > 0 {
		return rep, fmt.Errorf("runs with unexpected outcomes, figures not valid: %v", bad)
	}
	return rep, nil
}
