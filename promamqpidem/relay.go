package promamqpidem

import (
	"context"
	"sync"
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

// RelayDeadSource is a RelaySource that also reads how many rows are dead
// now, whoever moved them there: a *pgstore.Relay is one. A RelayCollector
// exports relay_dead_rows only from a RelayDeadSource.
type RelayDeadSource interface {
	RelaySource
	// Dead returns how many rows are dead, waiting for an operator.
	Dead(ctx context.Context) (int64, error)
}

// RelayCollector exports a producer outbox relay's figures:
//
//	<ns>_relay_published_total           messages published and confirmed
//	<ns>_relay_refused_total             publishes the broker refused
//	<ns>_relay_dead_total                rows that went dead (refused MaxAttempts times)
//	<ns>_relay_pending_rows              rows waiting to be published
//	<ns>_relay_oldest_pending_seconds    age of the oldest waiting row
//	<ns>_relay_dead_rows                 rows dead now (a RelayDeadSource only)
//	<ns>_relay_collect_up                1 if this scrape read the three gauges above, else 0
//	<ns>_relay_collect_success_timestamp_seconds  when they were last read (Unix time)
//
// The counters are the relay's own, since it started; the pending, oldest
// and dead gauges are read from the database at each scrape (indexed
// queries, bounded together by a 5 s timeout). When a read fails (the
// database is down, say), collect_up reads 0 and the three gauges keep
// the values last read, so that an alert on them does not go silent
// exactly then: alert on collect_up too (or on the success timestamp's
// age). Before the first successful read they are left out. Alert on the
// oldest pending age: it grows when no relay runs or the broker refuses,
// whatever the write rate; and on dead rows above zero.
//
// A RelayCollector is safe for concurrent use.
type RelayCollector struct {
	src                      RelaySource
	published, refused, dead *prometheus.Desc
	pending, oldest          *prometheus.Desc
	deadRows, up, lastOK     *prometheus.Desc

	mu   sync.Mutex // guards last
	last relayReading
}

// relayReading is what a RelayCollector last read from the database.
type relayReading struct {
	at       time.Time // zero before the first successful read
	rows     int64
	oldest   time.Duration
	deadRows int64
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
		pending:   desc("pending_rows", "Outbox rows waiting to be published (the last value read when relay_collect_up is 0)."),
		oldest:    desc("oldest_pending_seconds", "Age of the oldest outbox row waiting to be published (the last value read when relay_collect_up is 0)."),
		deadRows:  desc("dead_rows", "Outbox rows dead now, waiting for an operator to re-drive them (the last value read when relay_collect_up is 0)."),
		up:        desc("collect_up", "1 if this scrape read the outbox's pending and dead rows from the database, 0 if that failed."),
		lastOK:    desc("collect_success_timestamp_seconds", "When the outbox's pending and dead rows were last read from the database, in seconds since the Unix epoch."),
	}
}

// Describe implements prometheus.Collector.
func (c *RelayCollector) Describe(ch chan<- *prometheus.Desc) {
	ds := []*prometheus.Desc{c.published, c.refused, c.dead, c.pending, c.oldest, c.up, c.lastOK}
	if _, ok := c.src.(RelayDeadSource); ok {
		ds = append(ds, c.deadRows)
	}
	for _, d := range ds {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *RelayCollector) Collect(ch chan<- prometheus.Metric) {
	pub, ref, dead := c.src.Counts()
	ch <- prometheus.MustNewConstMetric(c.published, prometheus.CounterValue, float64(pub))
	ch <- prometheus.MustNewConstMetric(c.refused, prometheus.CounterValue, float64(ref))
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.CounterValue, float64(dead))
	r, err := c.read()
	c.mu.Lock()
	if err == nil {
		c.last = r
	}
	r = c.last
	c.mu.Unlock()
	up := 1.0
	if err != nil {
		up = 0
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, up)
	if r.at.IsZero() {
		return // never read: no value to give
	}
	ch <- prometheus.MustNewConstMetric(c.lastOK, prometheus.GaugeValue, float64(r.at.UnixNano())/1e9)
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(r.rows))
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, r.oldest.Seconds())
	if _, ok := c.src.(RelayDeadSource); ok {
		ch <- prometheus.MustNewConstMetric(c.deadRows, prometheus.GaugeValue, float64(r.deadRows))
	}
}

// read reads the backlog, and the dead rows of a RelayDeadSource, from
// the database, within 5 s.
func (c *RelayCollector) read() (relayReading, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var r relayReading
	var err error
	if r.rows, r.oldest, err = c.src.Backlog(ctx); err != nil {
		return r, err
	}
	if d, ok := c.src.(RelayDeadSource); ok {
		if r.deadRows, err = d.Dead(ctx); err != nil {
			return r, err
		}
	}
	r.at = time.Now()
	return r, nil
}
