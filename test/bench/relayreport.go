package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/amqpidem/amqpidem/pgstore"
)

// relayPhase runs the relay's rate runs (-repeats) and its latency run.
func (e *env) relayPhase(ctx context.Context, rep *report) error {
	n := e.opts.RelayN
	if e.opts.N > 0 {
		n = e.opts.N
	}
	for round := 1; round <= e.opts.Repeats; round++ {
		r, err := e.relayRate(ctx, round, n)
		if err != nil {
			return fmt.Errorf("relay rate, round %d: %w", round, err)
		}
		rep.Relay = append(rep.Relay, r)
		fmt.Fprintf(e.out, "  round %d classic relay        %9s rows/s  N %d: all sent in %v, all consumed in %v (written up front in %v)\n",
			round, thousands(r.Rate), r.N, r.Sent.Round(time.Millisecond), r.Consumed.Round(time.Millisecond), r.Write.Round(time.Millisecond))
	}
	l, err := e.relayLatencyRun(ctx, e.opts.RelayRate, e.opts.LatencyDuration, e.opts.LatencyWarmup)
	if err != nil {
		return fmt.Errorf("relay latency at %s rows/s: %w", thousands(e.opts.RelayRate), err)
	}
	rep.RelayLatency = &l
	if e.opts.RelayOrderedN > 0 {
		o, err := e.relayOrderedRun(ctx, e.opts.RelayOrderedN, e.opts.RelayOrderedTimeout)
		if err != nil {
			return fmt.Errorf("relay ordered drain of %d rows: %w", e.opts.RelayOrderedN, err)
		}
		rep.RelayOrdered = &o
		if o.TimedOut {
			fmt.Fprintf(e.out, "  ordered relay, one key: %d rows NOT drained within %v: %d sent, %d received (written up front in %v)\n",
				o.N, o.Timeout, o.SentRows, o.Received, o.Write.Round(time.Millisecond))
		} else {
			fmt.Fprintf(e.out, "  ordered relay, one key: %d rows drained in %v: all sent in %v, all consumed in %v (written up front in %v)\n",
				o.N, o.Span.Round(time.Millisecond), o.Sent.Round(time.Millisecond), o.Consumed.Round(time.Millisecond), o.Write.Round(time.Millisecond))
		}
	}
	return nil
}

// relayMedian is the median rate of the relay's rate runs.
func relayMedian(runs []relayRun) float64 {
	var rs []float64
	for _, r := range runs {
		rs = append(rs, r.Rate)
	}
	return median(rs)
}

// printRelay prints the relay phase's section of the report.
func printRelay(out io.Writer, o options, rep *report) {
	if rep.RelaySkipped != "" {
		fmt.Fprintf(out, "\n== relay skipped: %s ==\n", rep.RelaySkipped)
		return
	}
	if len(rep.Relay) == 0 {
		return
	}
	fmt.Fprintf(out, "\n== producer outbox relay (pgstore.Relay, defaults: batch %d, %d confirms in flight; classic queue, bare consumer) ==\n",
		pgstore.DefaultRelayBatch, pgstore.DefaultRelayConcurrency)
	fmt.Fprintf(out, "rate from a full table: median %s rows/s of %d run(s) of %d rows (rows / time from the relay's start until every row\n"+
		" is marked sent after its confirm and received by the consumer)\n", thousands(relayMedian(rep.Relay)), len(rep.Relay), rep.Relay[0].N)
	if l := rep.RelayLatency; l != nil {
		kept := "yes"
		if l.saturated() {
			kept = "no"
		}
		fmt.Fprintf(out, "latency at %s rows/s for %v (%d writers, one row per transaction; %d rows, %d after the first %v):\n"+
			"  commit returned -> consumer received: p50 %s, p99 %s, max %s; writers kept up: %s (last commit %v late)\n",
			thousands(l.Rate), l.Duration, relayLatencyWriters, l.N, l.Samples, o.LatencyWarmup,
			us(l.P50), us(l.P99), us(l.Max), kept, l.Late.Round(time.Millisecond))
	}
	if d := rep.RelayOrdered; d != nil {
		fmt.Fprintf(out, "ordered drain (RelayConfig.Ordered, poll interval %v): %d rows of one order key written up front, one per transaction;\n",
			pgstore.DefaultRelayPollInterval, d.N)
		if d.TimedOut {
			fmt.Fprintf(out, "  NOT drained within %v: %d rows sent, %d received by then (%.1f rows/s); out of order %d\n",
				d.Timeout, d.SentRows, d.Received, float64(d.SentRows)/d.Timeout.Seconds(), d.OutOfOrder)
		} else {
			fmt.Fprintf(out, "  drained in %v (all sent in %v, all received in %v: %.1f ms per row); out of order %d\n",
				d.Span.Round(time.Millisecond), d.Sent.Round(time.Millisecond), d.Consumed.Round(time.Millisecond),
				float64(d.Span)/float64(time.Millisecond)/float64(d.N), d.OutOfOrder)
		}
	}
}

// printRelayLines prints the relay's machine-readable lines, last.
func printRelayLines(out io.Writer, rep *report) {
	if len(rep.Relay) > 0 {
		fmt.Fprintf(out, "relay_msgs_per_s classic %.0f\n", relayMedian(rep.Relay))
	}
	if l := rep.RelayLatency; l != nil && l.Samples > 0 {
		note := ""
		if l.saturated() {
			note = " saturated"
		}
		fmt.Fprintf(out, "relay_p99_ms classic %.1f%s\n", float64(l.P99)/float64(time.Millisecond), note)
	}
	if d := rep.RelayOrdered; d != nil {
		if d.TimedOut {
			fmt.Fprintf(out, "relay_ordered_drain_ms %d timeout\n", d.N)
		} else {
			fmt.Fprintf(out, "relay_ordered_drain_ms %d %d\n", d.N, d.Span.Milliseconds())
		}
	}
}
