package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// latencyResult is one latency run: messages published at a steady rate
// into a consumer already running, each timed from just before its publish
// to its settlement (after the ack: for bare, when Ack returned; for
// amqpidem, when the Observer is told, which is after the ack).
type latencyResult struct {
	QueueType string
	Variant   variant
	Rate      float64 // asked for
	Achieved  float64 // publishing rate achieved
	N         int     // messages published
	Samples   int     // after the warm-up
	P50, P99  time.Duration
	Max       time.Duration
	// Lag is how long after the last publish the last message was
	// settled: about a latency for a consumer that keeps up, much more
	// for one that cannot sustain the rate (then the percentiles are
	// mostly queueing).
	Lag     time.Duration
	Length  time.Duration // of the paced publishing
	Settled int
}

// saturated says whether the consumer fell behind the publisher: it
// settled the last message more than a tenth of the run after the last
// publish.
func (l latencyResult) saturated() bool {
	return l.Lag > l.Length/10
}

func (e *env) latency(ctx context.Context, qt string, v variant, rate float64) (res latencyResult, err error) {
	res = latencyResult{QueueType: qt, Variant: v, Rate: rate}
	if rate <= 0 {
		return res, errors.New("no bare rate to take half of")
	}
	ctx, cancel := context.WithTimeout(ctx, e.opts.RunTimeout)
	defer cancel()
	n := max(2, int(rate*e.opts.LatencyDuration.Seconds()))
	if e.opts.LatencyMaxN > 0 {
		n = min(n, e.opts.LatencyMaxN)
	}
	warm := min(n-1, int(rate*e.opts.LatencyWarmup.Seconds()))
	res.N = n

	// The rate in the name too: a PostgreSQL variant's records outlive the
	// run (deleteKeys reaches Redis only), and the next rate's probe would
	// be a duplicate of this one's.
	prefix := fmt.Sprintf("%s-%s-lat-%s-%.0f", e.base, qt, v, rate)
	queue := prefix
	if err := e.brk.declare(queue, qt); err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, e.brk.remove(queue)) }()

	const ids = "l-"
	sent := make([]atomic.Int64, n)
	took := make([]atomic.Int64, n)
	// One probe message first: amqpidem says nothing when it starts
	// consuming, so the paced publishing waits until the probe is settled.
	t := newTally(n+1, func(id string, at time.Time) {
		s, ok := strings.CutPrefix(id, ids)
		if !ok {
			return
		}
		if i, err := strconv.Atoi(s); err == nil && i >= 0 && i < n {
			took[i].Store(at.UnixNano() - sent[i].Load())
		}
	})
	// A PostgreSQL variant's pool and store, as in a throughput run.
	var pr *pgRun
	if v.isPG() {
		if pr, err = e.pg.open(ctx, v, queue, prefix); err != nil {
			return res, err
		}
		defer func() {
			cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer ccancel()
			_, cerr := pr.close(cctx)
			err = errors.Join(err, cerr)
		}()
	}
	c, err := e.start(ctx, qt, v, queue, prefix, pr, t, nil)
	if err != nil {
		return res, err
	}
	defer func() {
		sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer scancel()
		err = errors.Join(err, c.stop(sctx))
		res.Settled = int(t.ok.Load())
		if t.bad.Load() > 0 {
			err = errors.Join(err, fmt.Errorf("%d unexpected outcomes (first: %s)", t.bad.Load(), t.firstReason()))
		}
		_, _ = deleteKeys(context.WithoutCancel(ctx), e.admin, prefix+"*")
	}()
	if err := e.brk.prefill(ctx, queue, "probe-", 1, e.body); err != nil {
		return res, err
	}
	if err := t.waitFor(ctx, 1, 30*time.Second); err != nil {
		return res, fmt.Errorf("probe: %w", err)
	}
	pubStart := time.Now()
	var published time.Time
	res.Achieved, published, err = e.brk.paced(ctx, queue, ids, n, rate, e.body, func(i int, at time.Time) {
		sent[i].Store(at.UnixNano())
	})
	if err != nil {
		return res, err
	}
	res.Length = published.Sub(pubStart)
	if err := t.wait(ctx, e.opts.RunTimeout, c); err != nil {
		return res, err
	}
	res.Lag = time.Unix(0, t.last.Load()).Sub(published)

	samples := make([]time.Duration, 0, n-warm)
	for i := warm; i < n; i++ {
		samples = append(samples, time.Duration(took[i].Load()))
	}
	slices.Sort(samples)
	res.Samples = len(samples)
	res.P50, res.P99, res.Max = percentile(samples, 0.50), percentile(samples, 0.99), samples[len(samples)-1]
	fmt.Fprintf(e.out, "latency %-7s %-6s at %s msg/s (achieved %s): p50 %v  p99 %v  max %v  (%d samples), last settled %v after the last publish\n",
		qt, v, thousands(rate), thousands(res.Achieved), us(res.P50), us(res.P99), us(res.Max), res.Samples, us(res.Lag))
	return res, nil
}

// percentile is the nearest-rank q-quantile of sorted.
func percentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// us formats d in microseconds, or milliseconds with two decimals past 10 ms.
func us(d time.Duration) string {
	if d >= 10*time.Millisecond {
		return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%dµs", d.Microseconds())
}
