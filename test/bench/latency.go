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
	// Group numbers the runs compared with each other: bare's run and
	// the run of the variant it is compared with have the same one. At
	// the fixed rates they ran at the same time, fed by one publisher; at
	// half the bare rate one after the other (two consumers at once would
	// saturate the machine).
	Group int
}

// saturated says whether the consumer fell behind the publisher: it
// settled the last message more than a tenth of the run after the last
// publish.
func (l latencyResult) saturated() bool {
	return l.Lag > l.Length/10
}

// latencyRun is one consumer of a latency group: its queue, the send and
// settle times of its messages, and what it measured.
type latencyRun struct {
	res   latencyResult
	queue string
	sent  []atomic.Int64 // unix ns, by message index
	took  []atomic.Int64 // ns from send to settlement, by message index
	t     *tally
	c     consumer
}

// latencyGroup measures the latency of each of vs at rate, every one on a
// queue of its own and all at the same time: one paced publisher sends
// message i to every queue back to back (the first queue rotating with
// i), so that a stall of the machine, the broker or the publisher (runs
// here show pauses of 100-200 ms in bare's runs and amqpidem's alike, a
// few seconds apart) falls on all of them alike, rather than on whichever
// ran when it came, and the p99 one adds over another is not the stall's.
// The runs it returns share a new Group.
func (e *env) latencyGroup(ctx context.Context, qt string, rate float64, vs ...variant) (res []latencyResult, err error) {
	e.latencyGroups++
	group := e.latencyGroups
	runs := make([]*latencyRun, len(vs))
	for i, v := range vs {
		runs[i] = &latencyRun{res: latencyResult{QueueType: qt, Variant: v, Rate: rate, Group: group}}
	}
	defer func() {
		for _, r := range runs {
			res = append(res, r.res)
		}
	}()
	if rate <= 0 {
		return nil, errors.New("no bare rate to take half of")
	}
	ctx, cancel := context.WithTimeout(ctx, e.opts.RunTimeout)
	defer cancel()
	n := max(2, int(rate*e.opts.LatencyDuration.Seconds()))
	if e.opts.LatencyMaxN > 0 {
		n = min(n, e.opts.LatencyMaxN)
	}
	warm := min(n-1, int(rate*e.opts.LatencyWarmup.Seconds()))

	const ids = "l-"
	for _, r := range runs {
		r.res.N = n
		r.sent = make([]atomic.Int64, n)
		r.took = make([]atomic.Int64, n)
		// The rate and group in the name too: a PostgreSQL variant's
		// records outlive the run (deleteKeys reaches Redis only), and
		// the next rate's probe would be a duplicate of this one's.
		prefix := fmt.Sprintf("%s-%s-lat%d-%s-%.0f", e.base, qt, group, r.res.Variant, rate)
		r.queue = prefix
		if err := e.brk.declare(r.queue, qt); err != nil {
			return nil, err
		}
		defer func() { err = errors.Join(err, e.brk.remove(r.queue)) }()

		// One probe message first: amqpidem says nothing when it starts
		// consuming, so the paced publishing waits until the probe is
		// settled.
		r.t = newTally(n+1, func(id string, at time.Time) {
			s, ok := strings.CutPrefix(id, ids)
			if !ok {
				return
			}
			if i, err := strconv.Atoi(s); err == nil && i >= 0 && i < n {
				r.took[i].Store(at.UnixNano() - r.sent[i].Load())
			}
		})
		// A PostgreSQL variant's pool and store, as in a throughput run.
		var pr *pgRun
		if r.res.Variant.isPG() {
			if pr, err = e.pg.open(ctx, r.res.Variant, r.queue, prefix); err != nil {
				return nil, err
			}
			defer func() {
				cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
				defer ccancel()
				_, cerr := pr.close(cctx)
				err = errors.Join(err, cerr)
			}()
		}
		if r.c, err = e.start(ctx, qt, r.res.Variant, r.queue, prefix, pr, r.t, nil); err != nil {
			return nil, err
		}
		defer func() {
			sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
			defer scancel()
			err = errors.Join(err, r.c.stop(sctx))
			r.res.Settled = int(r.t.ok.Load())
			if r.t.bad.Load() > 0 {
				err = errors.Join(err, fmt.Errorf("%s: %d unexpected outcomes (first: %s)", r.res.Variant, r.t.bad.Load(), r.t.firstReason()))
			}
			_, _ = deleteKeys(context.WithoutCancel(ctx), e.admin, prefix+"*")
		}()
		if err := e.brk.prefill(ctx, r.queue, "probe-", 1, e.body); err != nil {
			return nil, err
		}
		if err := r.t.waitFor(ctx, 1, 30*time.Second); err != nil {
			return nil, fmt.Errorf("%s probe: %w", r.res.Variant, err)
		}
	}

	queues := make([]string, len(runs))
	for i, r := range runs {
		queues[i] = r.queue
	}
	pubStart := time.Now()
	achieved, published, err := e.brk.paced(ctx, queues, ids, n, rate, e.body, func(q, i int, at time.Time) {
		runs[q].sent[i].Store(at.UnixNano())
	})
	if err != nil {
		return nil, err
	}
	for _, r := range runs {
		r.res.Achieved = achieved
		r.res.Length = published.Sub(pubStart)
		if err := r.t.wait(ctx, e.opts.RunTimeout, r.c); err != nil {
			return nil, fmt.Errorf("%s: %w", r.res.Variant, err)
		}
		r.res.Lag = time.Unix(0, r.t.last.Load()).Sub(published)

		samples := make([]time.Duration, 0, n-warm)
		for i := warm; i < n; i++ {
			samples = append(samples, time.Duration(r.took[i].Load()))
		}
		slices.Sort(samples)
		r.res.Samples = len(samples)
		r.res.P50, r.res.P99, r.res.Max = percentile(samples, 0.50), percentile(samples, 0.99), samples[len(samples)-1]
		beside := ""
		if len(runs) > 1 {
			beside = " beside " + besideText(runs, r)
		}
		fmt.Fprintf(e.out, "latency %-7s %-6s at %s msg/s (achieved %s)%s: p50 %v  p99 %v  max %v  (%d samples), last settled %v after the last publish\n",
			qt, r.res.Variant, thousands(rate), thousands(achieved), beside, us(r.res.P50), us(r.res.P99), us(r.res.Max), r.res.Samples, us(r.res.Lag))
	}
	return nil, nil
}

// besideText names the variants of runs other than r.
func besideText(runs []*latencyRun, r *latencyRun) string {
	var names []string
	for _, o := range runs {
		if o != r {
			names = append(names, string(o.res.Variant))
		}
	}
	return strings.Join(names, ", ")
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
