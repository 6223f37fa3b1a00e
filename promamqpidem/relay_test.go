package promamqpidem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/amqpidem/amqpidem/promamqpidem"
)

// fakeRelay is a RelaySource with set figures.
type fakeRelay struct {
	backlogErr error
}

func (fakeRelay) Counts() (uint64, uint64, uint64) { return 7, 3, 1 }

func (f fakeRelay) Backlog(context.Context) (int64, time.Duration, error) {
	return 42, 1500 * time.Millisecond, f.backlogErr
}

func TestRelayCollector(t *testing.T) {
	c := promamqpidem.NewRelayCollector(fakeRelay{}, promamqpidem.Options{ConstLabels: prometheus.Labels{"service": "orders"}})
	want := `
# HELP amqpidem_relay_dead_total Outbox rows the relay moved to dead after MaxAttempts refusals.
# TYPE amqpidem_relay_dead_total counter
amqpidem_relay_dead_total{service="orders"} 1
# HELP amqpidem_relay_oldest_pending_seconds Age of the oldest outbox row waiting to be published.
# TYPE amqpidem_relay_oldest_pending_seconds gauge
amqpidem_relay_oldest_pending_seconds{service="orders"} 1.5
# HELP amqpidem_relay_pending_rows Outbox rows waiting to be published.
# TYPE amqpidem_relay_pending_rows gauge
amqpidem_relay_pending_rows{service="orders"} 42
# HELP amqpidem_relay_published_total Messages of the producer outbox the relay published, confirmed by the broker.
# TYPE amqpidem_relay_published_total counter
amqpidem_relay_published_total{service="orders"} 7
# HELP amqpidem_relay_refused_total Publishes of the relay the broker refused (no queue bound, an exchange missing, a property refused).
# TYPE amqpidem_relay_refused_total counter
amqpidem_relay_refused_total{service="orders"} 3
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	// A database that does not answer leaves the gauges out, and the
	// scrape (the counters) intact.
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(promamqpidem.NewRelayCollector(fakeRelay{backlogErr: errors.New("down")}, promamqpidem.Options{}))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	if len(mfs) != 3 {
		t.Fatalf("%d metric families with the database down, want the 3 counters", len(mfs))
	}
}
