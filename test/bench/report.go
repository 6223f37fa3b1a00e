package main

import (
	"fmt"
	"io"
	"slices"
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

// ratios are each variant's median throughput over bare's, per queue type,
// in the order of the final lines.
func ratios(runs []runResult, queueTypes []string) []ratio {
	var out []ratio
	for _, qt := range queueTypes {
		b := median(rates(runs, qt, bare))
		// The three; memstore's ratio is in the table only.
		for _, v := range []variant{unique, duplicate, naive} {
			r := ratio{Variant: v, QueueType: qt}
			if b > 0 {
				r.Value = median(rates(runs, qt, v)) / b
			}
			out = append(out, r)
		}
	}
	return out
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

func printReport(out io.Writer, e *env, rep *report) {
	o := e.opts
	fmt.Fprintf(out, "\n== throughput: median of %d run(s), msg/s; prefetch %d, concurrency %d ==\n", o.Repeats, o.Prefetch, o.Concurrency)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "queue\tvariant\tN\tmedian\truns\tvs bare\tredis rt/msg\tclient cpu/msg\tredis cpu/msg\tmachine cpu/msg\t")
	for _, qt := range o.QueueTypes {
		b := median(rates(rep.Runs, qt, bare))
		for _, v := range variants {
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
			rcpu := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.RedisCPU) })
			mcpu := perMessage(rep.Runs, qt, v, func(r runResult) float64 { return float64(r.MachineCPU) })
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%.2f\t%.1fµs\t%.1fµs\t%.1fµs\t\n", qt, v, rep.N[qt], thousands(m),
				strings.Join(each, " "), vs, rt, ccpu/1e3, rcpu/1e3, mcpu/1e3)
		}
	}
	tw.Flush()
	fmt.Fprintln(out, "(redis rt/msg: go-redis Process + ProcessPipeline calls per message; cpu/msg: CPU time of this\n"+
		" process, of redis-server and of the whole machine (RabbitMQ included; /proc/stat, so other work\n"+
		" on the machine counts too) while consuming, per message)")

	if len(rep.Latency) > 0 {
		fmt.Fprintf(out, "\n== latency at half the bare median rate: publish -> settled after ack, first %v left out ==\n", o.LatencyWarmup)
		tw = tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "queue\trate msg/s\tbare p50\tbare p99\tunique p50\tunique p99\tadded p50\tadded p99\tsamples\tkept up\t")
		for _, qt := range o.QueueTypes {
			var b, u *latencyResult
			for i := range rep.Latency {
				l := &rep.Latency[i]
				if l.QueueType == qt && l.Samples > 0 {
					switch l.Variant {
					case bare:
						b = l
					case unique:
						u = l
					}
				}
			}
			if b == nil || u == nil {
				continue
			}
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
	if rep.Profile != "" {
		fmt.Fprintf(out, "\n%s\n  (go tool pprof -top %s)\n", rep.Profile, o.CPUProfile)
	}
}

func signedUs(d time.Duration) string {
	if d < 0 {
		return "-" + us(-d)
	}
	return "+" + us(d)
}
