package console

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Metrics reads the consumers' delivery counters for the overview's rate
// charts. promamqpidem's Metrics (the registry a consumer fills) and
// promamqpidem.Scraper (a consumer's /metrics URL) implement it; the
// console imports neither, so that its users get Prometheus's client only
// if they use one of them.
type Metrics interface {
	// Outcomes returns, by queue and then by outcome, how many deliveries
	// the consumers have processed so far: promamqpidem's
	// amqpidem_messages_total summed over reasons (outcomes in lower
	// case: completed, duplicate, busy, retried, dead_lettered, dropped,
	// abandoned, outbox_given_up). Counts only grow, but for a consumer
	// that restarted. It must return when ctx ends: the console reads
	// once per MetricsInterval, bounded by Timeout, and Close waits for a
	// read in flight. A panic in it is taken as a failed read.
	Outcomes(ctx context.Context) (map[string]map[string]float64, error)
}

// Bounds of the rate charts.
const (
	// defaultMetricsInterval and defaultMetricsWindow are
	// Config.MetricsInterval's and Config.MetricsWindow's defaults.
	defaultMetricsInterval = 10 * time.Second
	defaultMetricsWindow   = 10 * time.Minute
	// maxSamples bounds the ring (Config.MetricsWindow /
	// Config.MetricsInterval + 1).
	maxSamples = 1000
	// maxChartQueues bounds the queues sampled when Config.Queues names
	// none: those first in name order.
	maxChartQueues = 20
)

// rateKinds are the rates charted, each a sum of outcomes.
var rateKinds = []struct {
	Name     string
	Outcomes []string
}{
	{"processed", nil}, // every outcome
	{"completed", []string{"completed"}},
	{"duplicates", []string{"duplicate"}},
	{"requeued", []string{"busy", "retried", "abandoned"}},
	{"dead-lettered", []string{"dead_lettered"}},
}

// sample is the counters of each sampled queue at one time, by rateKinds.
type sample struct {
	at     time.Time
	totals map[string][]float64
}

// sampler reads Config.Metrics every interval into a ring of the last
// keep samples. It is owned by its Console: started by New, stopped by
// Close. It is safe for concurrent use.
type sampler struct {
	src      Metrics
	queues   []string // Config.Queues; none: any, up to maxChartQueues
	interval time.Duration
	timeout  time.Duration
	now      func() time.Time

	mu      sync.Mutex
	ring    []sample // ring[(start+i)%len(ring)], i < n, oldest first
	start   int
	n       int
	err     error // of the last read; nil when it succeeded
	errAt   time.Time
	dropped int // queues left out by maxChartQueues at the last read

	stop chan struct{}
	done chan struct{}
	once sync.Once
}

func newSampler(src Metrics, queues []string, interval, window, timeout time.Duration) *sampler {
	keep := min(int(window/interval)+1, maxSamples)
	return &sampler{src: src, queues: queues, interval: interval, timeout: min(timeout, interval),
		now: time.Now, ring: make([]sample, max(keep, 2)), stop: make(chan struct{}), done: make(chan struct{})}
}

// run samples at once, then every interval, until close.
func (s *sampler) run() {
	defer close(s.done)
	t := time.NewTicker(s.interval)
	defer t.Stop()
	for {
		s.read()
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
	}
}

// close stops run and waits for it; idempotent.
func (s *sampler) close() {
	s.once.Do(func() { close(s.stop) })
	<-s.done
}

// read takes one sample.
func (s *sampler) read() {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	// A read in flight when the console closes ends with it.
	go func() {
		select {
		case <-s.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	got, err := s.outcomes(ctx)
	at := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		s.err, s.errAt = err, at
		return
	}
	s.err = nil
	s.add(at, got)
}

// outcomes calls the source, its panic an error: a Metrics of the user's
// must not take down the program serving the console.
func (s *sampler) outcomes(ctx context.Context) (got map[string]map[string]float64, err error) {
	defer func() {
		if v := recover(); v != nil {
			got, err = nil, fmt.Errorf("console: Metrics.Outcomes panicked: %v", v)
		}
	}()
	return s.src.Outcomes(ctx)
}

// add puts the counters of got into the ring at time at (s.mu held).
func (s *sampler) add(at time.Time, got map[string]map[string]float64) {
	queues := s.queues
	s.dropped = 0
	if len(queues) == 0 {
		for q := range got {
			queues = append(queues, q)
		}
		slices.Sort(queues)
		if len(queues) > maxChartQueues {
			s.dropped = len(queues) - maxChartQueues
			queues = queues[:maxChartQueues]
		}
	}
	smp := sample{at: at, totals: make(map[string][]float64, len(queues))}
	for _, q := range queues {
		outcomes := got[q]
		t := make([]float64, len(rateKinds))
		for i, k := range rateKinds {
			if k.Outcomes == nil {
				for _, v := range outcomes {
					t[i] += v
				}
				continue
			}
			for _, o := range k.Outcomes {
				t[i] += outcomes[o]
			}
		}
		smp.totals[q] = t
	}
	if s.n < len(s.ring) {
		s.ring[(s.start+s.n)%len(s.ring)] = smp
		s.n++
		return
	}
	s.ring[s.start] = smp
	s.start = (s.start + 1) % len(s.ring)
}

// Chart sizes, in SVG user units.
const chartW, chartH = 160, 36

// chart is one rate of one queue over the window, as the overview draws
// it.
type chart struct {
	Kind string
	// Points is the polyline's points attribute; Now the last rate,
	// Peak the highest in the window, both per second.
	Points    string
	Now, Peak string
}

// queueRates is a queue's charts.
type queueRates struct {
	Queue  string
	Charts []chart
}

// rates is what the overview shows of the sampler.
type rates struct {
	Source string
	// Queues are the charts, once two samples were read.
	Queues []queueRates
	// Samples is how many are held; Interval and Window those of the
	// Config (Window as the ring holds it); Span the time from the
	// oldest sample held to the last, which the charts' x axis spans;
	// Err the last read's failure, ErrAt its time.
	Samples                int
	Interval, Window, Span time.Duration
	Err                    string
	ErrAt                  time.Time
	Dropped                int
}

// rates draws the charts from the ring.
func (s *sampler) rates() rates {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := rates{Samples: s.n, Interval: s.interval, Window: time.Duration(len(s.ring)-1) * s.interval, Dropped: s.dropped}
	if s.err != nil {
		out.Err, out.ErrAt = s.err.Error(), s.errAt
	}
	if s.n < 2 {
		return out
	}
	last := s.ring[(s.start+s.n-1)%len(s.ring)]
	queues := make([]string, 0, len(last.totals))
	for q := range last.totals {
		queues = append(queues, q)
	}
	slices.Sort(queues)
	first := s.ring[s.start]
	out.Span = last.at.Sub(first.at)
	begin := first.at
	for _, q := range queues {
		qr := queueRates{Queue: q}
		for k := range rateKinds {
			type point struct {
				at   time.Time
				rate float64
			}
			var pts []point
			for i := 1; i < s.n; i++ {
				prev, cur := s.ring[(s.start+i-1)%len(s.ring)], s.ring[(s.start+i)%len(s.ring)]
				p, okp := prev.totals[q]
				c, okc := cur.totals[q]
				dt := cur.at.Sub(prev.at).Seconds()
				if !okp || !okc || dt <= 0 {
					continue
				}
				d := c[k] - p[k]
				if d < 0 { // a consumer restarted: its counter began again at 0
					d = c[k]
				}
				pts = append(pts, point{cur.at, d / dt})
			}
			ch := chart{Kind: rateKinds[k].Name, Now: "-", Peak: "-"}
			if len(pts) > 0 {
				peak := 0.0
				for _, p := range pts {
					peak = math.Max(peak, p.rate)
				}
				var b strings.Builder
				for i, p := range pts {
					x := float64(chartW)
					if out.Span > 0 {
						x = float64(chartW) * p.at.Sub(begin).Seconds() / out.Span.Seconds()
					}
					y := float64(chartH - 1)
					if peak > 0 {
						y = float64(chartH-1) - float64(chartH-2)*p.rate/peak
					}
					if i > 0 {
						b.WriteByte(' ')
					}
					b.WriteString(strconv.FormatFloat(max(x, 0), 'f', 1, 64))
					b.WriteByte(',')
					b.WriteString(strconv.FormatFloat(y, 'f', 1, 64))
				}
				ch.Points, ch.Now, ch.Peak = b.String(), perSecond(pts[len(pts)-1].rate), perSecond(peak)
			}
			qr.Charts = append(qr.Charts, ch)
		}
		out.Queues = append(out.Queues, qr)
	}
	return out
}

// perSecond formats a rate: "12/s", "0.35/s".
func perSecond(r float64) string {
	switch {
	case r == 0:
		return "0/s"
	case r >= 100:
		return fmt.Sprintf("%.0f/s", r)
	case r >= 10:
		return fmt.Sprintf("%.1f/s", r)
	}
	return fmt.Sprintf("%.2f/s", r)
}
