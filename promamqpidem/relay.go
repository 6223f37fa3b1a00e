package promamqpidem

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// RelaySource is what a RelayCollector reads: a *pgstore.Relay is one.
// The interface keeps pgx out of the modules that import promamqpidem
// without pgstore.
type RelaySource interface {
	// Counts returns the messages published (confirmed), the publishes
	// the broker refused, and the rows that went dead, since the relay
	// started.
	Counts() (published, refused, dead uint64)
	// Backlog returns the rows waiting to be published and the age of the
	// oldest.
	Backlog(ctx context.Context) (rows int64, oldest time.Duration, err error)
}

// RelayCollector exports a producer outbox relay's figures:
//
//	<ns>_relay_published_total           messages published and confirmed
//	<ns>_relay_refused_total             publishes the broker refused
//	<ns>_relay_dead_total                rows that went dead (refused MaxAttempts times)
//	<ns>_relay_pending_rows              rows waiting to be published
//	<ns>_relay_oldest_pending_seconds    age of the oldest waiting row
//
// The counters are the relay's own, since it started; the two gauges are
// read from the database at each scrape (one indexed query, bounded by
// a 5 s timeout; a failed read leaves them out of that scrape). Alert on
// the oldest pending age: it grows when no relay runs or the broker
// refuses, whatever the write rate.
type RelayCollector struct {
	src                      RelaySource
	published, refused, dead *prometheus.Desc
	pending, oldest          *prometheus.Desc
}

// NewRelayCollector returns a collector of src's figures, named with
// opts.Namespace and labelled with opts.ConstLabels (the other Options do
// not apply). Register it with a prometheus.Registerer.
func NewRelayCollector(src RelaySource, opts Options) *RelayCollector {
	o := opts.withDefaults()
	desc := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(o.Namespace, "relay", name), help, nil, o.ConstLabels)
	}
	return &RelayCollector{src: src,
		published: desc("published_total", "Messages of the producer outbox the relay published, confirmed by the broker."),
		refused:   desc("refused_total", "Publishes of the relay the broker refused (no queue bound, an exchange missing, a property refused)."),
		dead:      desc("dead_total", "Outbox rows the relay moved to dead after MaxAttempts refusals."),
		pending:   desc("pending_rows", "Outbox rows waiting to be published."),
		oldest:    desc("oldest_pending_seconds", "Age of the oldest outbox row waiting to be published."),
	}
}

// Describe implements prometheus.Collector.
func (c *RelayCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.published, c.refused, c.dead, c.pending, c.oldest} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *RelayCollector) Collect(ch chan<- prometheus.Metric) {
	pub, ref, dead := c.src.Counts()
	ch <- prometheus.MustNewConstMetric(c.published, prometheus.CounterValue, float64(pub))
	ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(ref))
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.CounterValue, float64(dead))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rows, oldest, err := c.src.Backlog(ctx)
	if err != nil {
		// Left out of this scrape: an invalid metric would fail the
		// whole scrape, every other metric with it.
		return
	}
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(rows))
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, oldest.Seconds())
}
