package promamqpidem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/console"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// Both read the counters the console charts.
var (
	_ console.Metrics = (*promamqpidem.Metrics)(nil)
	_ console.Metrics = (*promamqpidem.Scraper)(nil)
)

// TestOutcomes: a Metrics' own Outcomes and a Scraper of a registry it is
// registered on (with another registry's series of another namespace and
// const labels) give messages_total by queue and outcome, summed over
// reasons.
func TestOutcomes(t *testing.T) {
	ctx := context.Background()
	m := promamqpidem.New(promamqpidem.Options{Namespace: "shop", ConstLabels: prometheus.Labels{"pod": "a"}})
	other := promamqpidem.New(promamqpidem.Options{}) // amqpidem_: not shop_'s
	for _, e := range []amqpidem.Event{
		{Queue: "orders", Outcome: amqpidem.Completed},
		{Queue: "orders", Outcome: amqpidem.Completed},
		{Queue: "orders", Outcome: amqpidem.Retried, Reason: "handler error"},
		{Queue: "orders", Outcome: amqpidem.Retried, Reason: "store unavailable"},
		{Queue: "payments", Outcome: amqpidem.DeadLettered, Reason: "permanent failure"},
	} {
		m.Observe(ctx, e)
		other.Observe(ctx, amqpidem.Event{Queue: e.Queue, Outcome: amqpidem.Duplicate})
	}
	want := "orders: completed=2 retried=2; payments: dead_lettered=1"
	got, err := m.Outcomes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := show(got); got != want {
		t.Fatalf("Metrics.Outcomes: got %s, want %s", got, want)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m, other)
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	got, err = (&promamqpidem.Scraper{URL: srv.URL, Namespace: "shop"}).Outcomes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got := show(got); got != want {
		t.Fatalf("Scraper.Outcomes: got %s, want %s", got, want)
	}
	got, err = (&promamqpidem.Scraper{URL: srv.URL}).Outcomes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := show(got), "orders: duplicate=4; payments: duplicate=1"; got != want {
		t.Fatalf("Scraper.Outcomes, default namespace: got %s, want %s", got, want)
	}
}

// TestScraperErrors: an endpoint that fails, serves something else than
// the text format or is down is an error; one without the counter gives
// no counts.
func TestScraperErrors(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/fail", func(w http.ResponseWriter, r *http.Request) { http.Error(w, "no", http.StatusInternalServerError) })
	mux.HandleFunc("/html", func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "<html>not metrics</html>") })
	mux.HandleFunc("/gauge", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "# TYPE amqpidem_messages_total gauge\namqpidem_messages_total{queue=\"q\",outcome=\"completed\"} 3\n")
	})
	mux.HandleFunc("/empty", func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "# TYPE up gauge\nup 1\n") })
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for path, want := range map[string]string{"/fail": "500", "/html": "promamqpidem: scrape:", "/gauge": "not a counter"} {
		_, err := (&promamqpidem.Scraper{URL: srv.URL + path}).Outcomes(context.Background())
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want an error with %q", path, err, want)
		}
	}
	got, err := (&promamqpidem.Scraper{URL: srv.URL + "/empty"}).Outcomes(context.Background())
	if err != nil || len(got) != 0 {
		t.Errorf("/empty: got %v, %v; want no counts", got, err)
	}
	down := srv.URL
	srv.Close()
	if _, err := (&promamqpidem.Scraper{URL: down}).Outcomes(context.Background()); err == nil {
		t.Error("a server down: no error")
	}
}

// show is counts as "queue: outcome=n ...; ..." in name order.
func show(counts map[string]map[string]float64) string {
	var qs []string
	for q, os := range counts {
		var parts []string
		for o, n := range os {
			parts = append(parts, fmt.Sprintf("%s=%v", o, n))
		}
		slices.Sort(parts)
		qs = append(qs, q+": "+strings.Join(parts, " "))
	}
	slices.Sort(qs)
	return strings.Join(qs, "; ")
}
