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
# HELP amqpidem_relay_collect_up 1 if this scrape read the outbox's pending and dead rows from the database, 0 if that failed.
# TYPE amqpidem_relay_collect_up gauge
amqpidem_relay_collect_up{service="orders"} 1
# HELP amqpidem_relay_oldest_pending_seconds Age of the oldest outbox row waiting to be published (the last value read when relay_collect_up is 0).
# TYPE amqpidem_relay_oldest_pending_seconds gauge
amqpidem_relay_oldest_pending_seconds{service="orders"} 1.5
# HELP amqpidem_relay_pending_rows Outbox rows waiting to be published (the last value read when relay_collect_up is 0).
# TYPE amqpidem_relay_pending_rows gauge
amqpidem_relay_pending_rows{service="orders"} 42
# HELP amqpidem_relay_published_total Messages of the producer outbox the relay published, confirmed by the broker.
# TYPE amqpidem_relay_published_total counter
amqpidem_relay_published_total{service="orders"} 7
# HELP amqpidem_relay_refused_total Publishes of the relay the broker refused (no queue bound, an exchange missing, a property refused).
# TYPE amqpidem_relay_refused_total counter
amqpidem_relay_refused_total{service="orders"} 3
`
	names := []string{"amqpidem_relay_collect_up", "amqpidem_relay_dead_total", "amqpidem_relay_oldest_pending_seconds",
		"amqpidem_relay_pending_rows", "amqpidem_relay_published_total", "amqpidem_relay_refused_total"}
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), names...); err != nil {
		t.Fatal(err)
	}
	// A source without Dead has no dead_rows gauge.
	if m := series(t, c, "amqpidem_relay_dead_rows", "service", "orders"); m != nil {
		t.Errorf("relay_dead_rows from a source without Dead: %v", m)
	}
	// A database that has never answered: collect_up 0, no value for the
	// gauges, and the scrape (the counters) intact.
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(promamqpidem.NewRelayCollector(fakeRelay{backlogErr: errors.New("down")}, promamqpidem.Options{}))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, mf := range mfs {
		got = append(got, mf.GetName())
	}
	if want := "amqpidem_relay_collect_up amqpidem_relay_dead_total amqpidem_relay_published_total amqpidem_relay_refused_total"; strings.Join(got, " ") != want {
		t.Fatalf("metric families with the database never answering: got %s, want %s", strings.Join(got, " "), want)
	}
}
