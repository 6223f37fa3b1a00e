package main

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// rates are the throughputs of the measured runs (round > 0) of qt and v.
func rates(runs []runResult, qt string, v variant) []float64 {
	var out []float64
	for _, r := range runs {
		if r.Round > 0 && r.QueueType == qt && r.Variant == v && r.Rate > 0 {
			out = append(out, r.Rate)
		}
	}
	return out
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// ratioVariants are the variants with a final ratio line, in order:
// issue 4's three, issue 13's, then issue 11's and 39's; memstore's ratio is in the
// table only.
var ratioVariants = []variant{unique, duplicate, naive, batchV, uniqueWait, pgUnique, pgDuplicate, pgNaive, pgBatch}

// ratios are each variant's median throughput over bare's, per queue type,
// in the order of the final lines, for the variants measured on it.
func ratios(runs []runResult, queueTypes []string, measured map[string][]variant) []ratio {
	var out []ratio
	for _, qt := range queueTypes {
		b := median(rates(runs, qt, bare))
		for _, v := range ratioVariants {
			if !slices.Contains(measured[qt], v) {
				continue
			}
			r := ratio{Variant: v, QueueType: qt}
			if b > 0 {
				r.Value = median(rates(runs, qt, v)) / b
			}
			out = append(out, r)
		}
	}
	return out
}

// outboxTarget is issue 23's target: outbox at least this share of
// unique's rate, on both queue types.
const outboxTarget = 0.75

// outboxPublishTarget is issue 40's target: outbox at least this share
// of publish's rate (exactly-once publishing at the cost of at-least-once),
// on both queue types.
const outboxPublishTarget = 0.9

// outboxRatios are outbox's median throughput over base's (unique's:
// issue 23; publish's: issue 40), per queue type measuring both.
func outboxRatios(runs []runResult, queueTypes []string, measured map[string][]variant, base variant) []ratio {
	var out []ratio
	for _, qt := range queueTypes {
		if !slices.Contains(measured[qt], outbox) || !slices.Contains(measured[qt], base) {
			continue
		}
		r := ratio{Variant: outbox, QueueType: qt}
		if u := median(rates(runs, qt, base)); u > 0 {
			r.Value = median(rates(runs, qt, outbox)) / u
		}
		out = append(out, r)
	}
	return out
}

// usOrUnknown prints ns as µs, or "?" when not measured (0).
func usOrUnknown(ns float64) string {
	if ns <= 0 {
		return "?"
	}
	return fmt.Sprintf("%.1fµs", ns/1e3)
}

// printBatchSizes prints, for each batch variant measured, the mean
// size of its handler batches over the measured runs (deliveries gathered
// over batches run): with BatchSize 100, how full its batches were.
func printBatchSizes(out io.Writer, rep *report) {
	for _, qt := range []string{"classic", "quorum"} {
		for _, v := range []variant{batchV, pgBatch} {
			var batches, msgs int64
			for _, r := range rep.Runs {
				if r.Round > 0 && r.QueueType == qt && r.Variant == v {
					batches += r.Batches
					msgs += r.BatchMsgs
				}
			}
			if batches > 0 {
				fmt.Fprintf(out, "batch_size %s %s %.1f\n", v, qt, float64(msgs)/float64(batches))
			}
		}
	}
}

// perMessage sums a per-run figure over the measured runs of qt and v and
// divides by their messages.
func perMessage(runs []runResult, qt string, v variant, f func(runResult) float64) float64 {
	var sum, n float64
	for _, r := range runs {
		if r.Round > 0 && r.QueueType == qt && r.Variant == v {
			sum += f(r)
			n += float64(r.N)
		}
	}
	if n == 0 {
		return 0
	}
	return sum / n
}

// perMeasured is perMessage's sum over the measured runs of qt and v where f is above
// 0 (measured: the broker's CPU, not read in a run where the node
// restarted), divided by their messages; 0 when there are none.
func perMeasured(runs []runResult, qt string, v variant, f func(runResult) float64) float64 {
	var sum, n float64
	for _, r := range runs {
		if x := f(r); r.Round > 0 && r.QueueType == qt && r.Variant == v && x > 0 {
			sum += x
			n += float64(r.N)
		}
	}
	if n == 0 {
		return 0
	}
	return sum / n
}

// machinePerMessage is a variant's machine_us (ns): the median, over the
// rounds of qt and v where it was measured (as perMeasured's), of the
// machine's CPU per message (ProcCPU: this process, Redis, RabbitMQ,
// PostgreSQL where used); 0 when there are none. Issue 40's targets are
// medians: one round that a stall of the broker or the disk slowed moves
// the mean of three rounds (perMeasured), not their median.
func machinePerMessage(runs []runResult, qt string, v variant) float64 {
	var xs []float64
	for _, r := range runs {
		if r.Round > 0 && r.QueueType == qt && r.Variant == v && r.ProcCPU > 0 && r.N > 0 {
			xs = append(xs, float64(r.ProcCPU)/float64(r.N))
		}
	}
	return median(xs)
}

func printReport(out io.Writer, e *env, rep *report) {
	o := e.opts
	fmt.Fprintf(out, "\n== throughput: median of %d run(s), msg/s; prefetch %d, concurrency %d ==\n", o.Repeats, o.Prefetch, o.Concurrency)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "queue\tvariant\tN\tmedian\truns\tvs bare\tredis rt/msg\tclient reads/msg\tclient writes/msg\tclient cpu/msg\tclient allocs/msg\tclient bytes/msg\tredis cpu/msg\tbroker cpu/msg\tmachine cpu/msg\tall cpu/msg\t")
	for _, qt := range o.QueueTypes {
		b := median(rates(rep.Runs, qt, bare))
		for _, v := range rep.Variants[qt] {
			rs := rates(rep.Runs, qt, v)
			var each []string
			for _, r := range rs {
				each = append(each, thousands(r))
			}
			m := median(rs)
			vs := "-"
			if b > 0 {
				vs = fmt.Sprintf("%.2f", m/b)
			}
			rt := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.RoundTrips) })
			ccpu := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.ClientCPU) })
			calloc := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.ClientAllocs) })
			cbytes := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.ClientBytes) })
			rcpu := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.RedisCPU) })
			bcpu := perMeasured(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.BrokerCPU) })
			pcpu := machinePerMessage(rep.Runs, qt, v)
			mcpu := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.MachineCPU) })
			reads := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.Reads) })
			writes := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.Writes) })
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%.2f\t%.2f\t%.2f\t%.1fµs\t%.1f\t%.0f\t%.1fµs\t%s\t%s\t%.1fµs\t\n", qt, v, rep.n(qt, v), thousands(m),
				strings.Join(each, " "), vs, rt, reads, writes, ccpu/1e3, calloc, cbytes, rcpu/1e3, usOrUnknown(bcpu), usOrUnknown(pcpu), mcpu/1e3)
		}
	}
	tw.Flush()
	fmt.Fprintln(out, "(redis rt/msg: go-redis Process + ProcessPipeline calls per message; client reads/msg,\n"+
		" writes/msg: this process's read and write system calls (/proc/self/io; a write is a flush of a\n"+
		" connection's buffer, to RabbitMQ or Redis) per message; client allocs/msg,\n"+
		" bytes/msg: the heap objects this process allocated while consuming, and their bytes, per message\n"+
		" (exact: the garbage collector's work follows them); cpu/msg: CPU time while consuming, per message,\n"+
		" of this process, of redis-server (INFO cpu), of the RabbitMQ node (/proc/<pid>/stat; \"?\": not\n"+
		" on this machine), of the machine (the sum of those, and of PostgreSQL's processes for a pg\n"+
		" variant: the machine_us lines, the median of the rounds; every other cpu/msg is their total over\n"+
		" their messages) and of all (/proc/stat: other work on the machine counts too))")
	if len(rep.OutboxRatios) > 0 {
		fmt.Fprintf(out, "(outbox: one staged message of %d bytes per message, to a queue of the run's own, %s)\n",
			stagedBodySize, sinkText(o.OutboxSink))
		fmt.Fprintf(out, "target of issue 23 (medians of this run): outbox at least %.2f of unique's rate\n", outboxTarget)
		for _, r := range rep.OutboxRatios {
			fmt.Fprintf(out, "  %-7s outbox/unique = %.2f  %s\n", r.QueueType, r.Value, metOrNot(r.Value >= outboxTarget))
		}
	}
	if len(rep.PublishRatios) > 0 {
		fmt.Fprintf(out, "(publish: unique whose handler publishes that message itself, confirmed, with amqpidem.Publisher, to such a queue)\n")
		fmt.Fprintf(out, "target of issue 40 (medians of this run): outbox at least %.2f of publish's rate\n", outboxPublishTarget)
		for _, r := range rep.PublishRatios {
			fmt.Fprintf(out, "  %-7s outbox/publish = %.2f  %s\n", r.QueueType, r.Value, metOrNot(r.Value >= outboxPublishTarget))
		}
	}
	if rep.WaitSkipped != "" {
		fmt.Fprintf(out, "\n== unique-wait skipped: %s ==\n", rep.WaitSkipped)
	} else if e.replica != nil {
		fmt.Fprintf(out, "(unique-wait: unique with lock.Config.Replicas 1, every write waiting for the replica this run started at %s)\n", e.replica.addr)
	}
	printPG(out, e, rep)

	if len(rep.Latency) > 0 {
		fmt.Fprintf(out, "\n== latency at half the bare median rate (bare, then unique) and at fixed rates (bare and unique at once, one publisher\n"+
			"   sending each message to both queues): publish -> settled after ack, first %v left out ==\n", o.LatencyWarmup)
		tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "queue\trate msg/s\tbare p50\tbare p99\tunique p50\tunique p99\tadded p50\tadded p99\tsamples\tkept up\t")
		for _, pair := range latencyPairs(rep.Latency, unique) {
			b, u := pair[0], pair[1]
			qt := b.QueueType
			kept := func(l *latencyResult) string {
				if l.saturated() {
					return "no"
				}
				return "yes"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d/%d\t%s/%s\t\n", qt, thousands(b.Rate),
				us(b.P50), us(b.P99), us(u.P50), us(u.P99), signedUs(u.P50-b.P50), signedUs(u.P99-b.P99),
				b.Samples, u.Samples, kept(b), kept(u))
		}
		tw.Flush()
		fmt.Fprintln(out, "(kept up bare/unique: \"no\" when the last message was settled more than a tenth of the run after the\n"+
			" last publish: the consumer could not sustain the rate and its percentiles are mostly queueing delay)")
	}

	if m := rep.Memory; m != nil {
		fmt.Fprintf(out, "\n== %d long handlers in flight (%s queue, Prefetch = Concurrency = %d, handlers sleep %v, LeaseTTL %v) ==\n",
			m.Handlers, m.QueueType, m.Handlers, m.Sleep, m.LeaseTTL)
		tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
		fmt.Fprintf(tw, "handlers in flight when sampled\t%d (%v after the first started)\n", m.InFlight, m.SampleAt.Round(time.Millisecond))
		fmt.Fprintf(tw, "goroutines before / in flight / after shutdown\t%d / %d / %d\n", m.GoroutinesBefore, m.GoroutinesAt, m.GoroutinesAfter)
		fmt.Fprintf(tw, "goroutines per in-flight handler\t%.3f (in flight - before - handlers = %d)\n", m.PerHandler(), m.GoroutinesAt-m.GoroutinesBefore-m.InFlight)
		fmt.Fprintf(tw, "heap in use after GC, before / in flight\t%.1f / %.1f MB\n", mb(m.HeapBefore), mb(m.HeapAt))
		if m.InFlight > 0 {
			fmt.Fprintf(tw, "heap per in-flight handler\t%.1f KB\n", float64(m.HeapAt-min(m.HeapAt, m.HeapBefore))/float64(m.InFlight)/1024)
		}
		fmt.Fprintf(tw, "completed / other outcomes (a lost lease shows here)\t%d / %d\n", m.Settled, m.Unexpected)
		fmt.Fprintf(tw, "redis round trips per handler, heartbeat included\t%.2f\n", float64(m.RoundTrips)/float64(max(1, m.Handlers)))
		tw.Flush()
	}
	printRelay(out, o, rep)
	if rep.Profile != "" {
		fmt.Fprintf(out, "\n%s\n  (go tool pprof -top %s; its allocations: go tool pprof -sample_index=alloc_space -top -base %s.allocs-base %s.allocs)\n",
			rep.Profile, o.CPUProfile, o.CPUProfile, o.CPUProfile)
	}
	if rep.Steps != nil {
		rep.Steps.print(out)
	}
}

func signedUs(d time.Duration) string {
	if d < 0 {
		return "-" + us(-d)
	}
	return "+" + us(d)
}

// printPG prints the PostgreSQL variants' table and the targets of issue
// 11, or why they did not run.
func printPG(out io.Writer, e *env, rep *report) {
	const qt = "classic"
	if rep.PGSkipped != "" {
		fmt.Fprintf(out, "\n== PostgreSQL variants skipped: %s ==\n", rep.PGSkipped)
		return
	}
	if e.pg == nil || !slices.Contains(rep.Variants[qt], pgUnique) {
		return
	}
	o := e.opts
	fmt.Fprintf(out, "\n== PostgreSQL variants (%s queue, effect: one INSERT into %s): median of %d run(s); pools of at most %d conns: %s ==\n",
		qt, e.pg.effects, o.Repeats, e.pg.conns, openedWhen(o.PGPoolPerRun))
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "variant\tmedian\tvs bare\tvs pg-naive\tstatements/msg\tround trips/msg\tcommits/msg\txact_commit Δ/msg\tprepares/run\tpool waits/msg\tpool wait/msg\tpg cpu/msg\tclient cpu/msg\tmachine cpu/msg\teffect rows/msg\t")
	b := median(rates(rep.Runs, qt, bare))
	naiveRate := median(rates(rep.Runs, qt, pgNaive))
	for _, v := range []variant{pgUnique, pgDuplicate, pgNaive, pgBatch} {
		m := median(rates(rep.Runs, qt, v))
		vs := func(base float64) string {
			if base <= 0 {
				return "-"
			}
			return fmt.Sprintf("%.2f", m/base)
		}
		pg := func(f func(c *pgCounts) float64) float64 {
			return perMessage(rep.Runs, qt, v, func(r runResult) float64 {
				if r.PG == nil {
					return 0
				}
				return f(r.PG)
			})
		}
		xact := "?"
		if runsOf(rep.Runs, qt, v, func(r runResult) bool { return r.PG != nil && r.PG.XactCommit >= 0 }) {
			xact = fmt.Sprintf("%.2f", pg(func(c *pgCounts) float64 { return float64(c.XactCommit) }))
		}
		var prepares, runs float64
		for _, r := range rep.Runs {
			if r.Round > 0 && r.QueueType == qt && r.Variant == v && r.PG != nil {
				prepares += float64(r.PG.Prepares)
				runs++
			}
		}
		pgcpu := "?"
		if e.pg.postmaster != 0 {
			pgcpu = fmt.Sprintf("%.1fµs", perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.PGCPU) })/1e3)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.2f\t%.2f\t%.2f\t%s\t%.0f\t%.3f\t%.1fµs\t%s\t%.1fµs\t%s\t%.2f\t\n", v, thousands(m), vs(b), vs(naiveRate),
			pg(func(c *pgCounts) float64 { return float64(c.Statements) }),
			pg(func(c *pgCounts) float64 { return float64(c.RoundTrips()) }),
			pg(func(c *pgCounts) float64 { return float64(c.Committed()) }),
			xact, prepares/max(runs, 1),
			pg(func(c *pgCounts) float64 { return float64(c.Waits) }),
			pg(func(c *pgCounts) float64 { return float64(c.Wait) })/1e3,
			pgcpu,
			perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.ClientCPU) })/1e3,
			usOrUnknown(machinePerMessage(rep.Runs, qt, v)),
			perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.EffectRows) }))
	}
	tw.Flush()
	fmt.Fprintf(out, "(statements/msg: what the variant's pool sent, counted client side by a pgx tracer (Exec, Query,\n"+
		" QueryRow, batched queries; BEGIN and COMMIT count as statements). round trips/msg: one per statement\n"+
		" sent alone, one per batch of statements (prepares not counted). commits/msg: transactions committed,\n"+
		" counted client side: COMMITs answered COMMIT, plus statements that succeeded outside a transaction\n"+
		" block (autocommit). Both over the life of the run's own pool, its consumer's start and stop included\n"+
		" (on a shared pool: from the run's start to its end), per message. xact_commit Δ/msg: the server's\n"+
		" pg_stat_database.xact_commit delta over the same span, for comparison only (\"?\": not measured, with\n"+
		" -pg-pool-per-run=false): it is per database, so it also counts the start-up of the pool's %d\n"+
		" connections, this bench's own queries and every other session on the database. prepares/run:\n"+
		" statements prepared (a round trip each, once per connection and SQL text). pool waits/msg, pool\n"+
		" wait/msg: pool acquires that found no idle connection while measuring (0: no handler ever waited for\n"+
		" the pool), and the time they waited. pg cpu/msg: CPU of every PostgreSQL process, other sessions'\n"+
		" included, while consuming. machine cpu/msg: as in the table above, the median of the rounds.\n"+
		" effect rows/msg: rows in %s for the run's queue)\n",
		e.pg.conns, pgEffectsTable)

	u, d, n := median(rates(rep.Runs, qt, pgUnique)), median(rates(rep.Runs, qt, pgDuplicate)), naiveRate
	if n > 0 {
		fmt.Fprintf(out, "targets of issues 11 and 26 (medians of this run, %s):\n", qt)
		fmt.Fprintf(out, "  pg-unique at least pg-naive's rate:          pg-unique/pg-naive = %.2f  %s\n", u/n, metOrNot(u/n >= 1))
		fmt.Fprintf(out, "  pg-duplicate at least pg-naive's rate:       pg-duplicate/pg-naive = %.2f  %s\n", d/n, metOrNot(d/n >= 1))
	}
}

// runsOf says whether qt's measured runs of v exist and all satisfy ok.
func runsOf(runs []runResult, qt string, v variant, ok func(runResult) bool) bool {
	found := false
	for _, r := range runs {
		if r.Round > 0 && r.QueueType == qt && r.Variant == v {
			if !ok(r) {
				return false
			}
			found = true
		}
	}
	return found
}

func metOrNot(met bool) string {
	if met {
		return "met"
	}
	return "NOT met"
}

// latencyPairs pairs the bare and other latency runs of each group (the
// runs compared with each other), in the order they ran; runs without
// samples are left out.
func latencyPairs(runs []latencyResult, other variant) [][2]*latencyResult {
	var out [][2]*latencyResult
	for i := range runs {
		b := &runs[i]
		if b.Variant != bare || b.Samples == 0 {
			continue
		}
		for j := range runs {
			u := &runs[j]
			if u.Variant == other && u.Group == b.Group && u.Samples > 0 {
				out = append(out, [2]*latencyResult{b, u})
				break
			}
		}
	}
	return out
}

// addedP99 is the median, over the pairs of runs of bare and other on qt
// at rate, of the p99 other added over bare (ms), and " saturated" when
// a consumer of any of them could not keep up; ok is false without a
// pair.
func addedP99(runs []latencyResult, other variant, qt string, rate float64) (ms float64, note string, ok bool) {
	var added []float64
	for _, pair := range latencyPairs(runs, other) {
		b, u := pair[0], pair[1]
		if b.QueueType != qt || b.Rate != rate {
			continue
		}
		added = append(added, float64(u.P99-b.P99)/float64(time.Millisecond))
		if b.saturated() || u.saturated() {
			note = " saturated"
		}
	}
	return median(added), note, len(added) > 0
}

// printTargets prints issue 14's machine-readable lines, after the ratio
// lines: Redis CPU per unique, duplicate and outbox message (µs), issue
// 40's machine CPU per message of every variant (µs) and unique's over
// bare's, and the p99 latency unique adds over bare (ms) at each fixed
// offered rate: the median over -latency-repeats pairs, each pair run at
// the same time. (The consumer's CPU over bare's, consumer_x, is retired:
// it rewarded moving work onto the broker; the table keeps the client's
// CPU.) A line is left
// out where the bench has no figure (a variant not measured, a platform
// without CPU times); a rate that bare or unique could not keep up with
// ends its line with "saturated".
func printTargets(out io.Writer, o options, rep *report) {
	for _, qt := range o.QueueTypes {
		for _, v := range []variant{unique, duplicate, outbox} {
			if !slices.Contains(rep.Variants[qt], v) {
				continue
			}
			rcpu := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.RedisCPU) })
			if rcpu <= 0 {
				continue
			}
			fmt.Fprintf(out, "redis_us %s %s %.1f\n", v, qt, rcpu/1e3)
		}
		// Issue 40's: the machine's CPU per message of every variant
		// (this process, Redis, RabbitMQ, PostgreSQL where used), and
		// unique's over bare's.
		proc := func(v variant) float64 { return machinePerMessage(rep.Runs, qt, v) }
		for _, v := range rep.Variants[qt] {
			if m := proc(v); m > 0 {
				fmt.Fprintf(out, "machine_us %s %s %.1f\n", v, qt, m/1e3)
			}
		}
		if b, u := proc(bare), proc(unique); b > 0 && u > 0 {
			fmt.Fprintf(out, "machine_x unique %s %.2f\n", qt, u/b)
		}
		for _, rate := range o.LatencyRates {
			if ms, note, ok := addedP99(rep.Latency, unique, qt, rate); ok {
				fmt.Fprintf(out, "latency_p99_ms %s %s %.1f%s\n", strconv.FormatFloat(rate, 'f', -1, 64), qt, ms, note)
			}
		}
	}
}

// sinkText says who consumes the outbox variant's queue of staged
// messages.
func sinkText(mode string) string {
	if mode == sinkConsumed {
		return "drained while measured by a bare consumer in this process (-outbox-sink consumed)"
	}
	return "which nobody consumes; deleted after the run (-outbox-sink idle)"
}
