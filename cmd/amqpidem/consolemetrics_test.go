package main_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// TestConsoleMetricsURL: with --metrics-url the overview charts the rates
// of a /metrics endpoint, naming it without its password, and the console
// still exits 0 on an interrupt (startConsole checks); a URL that is not
// http is refused.
func TestConsoleMetricsURL(t *testing.T) {
	r := newRig(t, 1)
	if _, errOut, code := r.cli("console", "--metrics-url", "ftp://x/metrics"); code != 2 || !strings.Contains(errOut, "--metrics-url") {
		t.Fatalf("console --metrics-url ftp://...: exit %d, stderr %q; want 2", code, errOut)
	}
	m := promamqpidem.New(promamqpidem.Options{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	metrics := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer metrics.Close()
	// Deliveries keep coming while the console samples.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				m.Observe(ctx, amqpidem.Event{Queue: r.queue, Outcome: amqpidem.Completed})
			}
		}
	}()
	defer func() { cancel(); <-done }()
	u := strings.Replace(metrics.URL, "http://", "http://scraper:hunter2secret@", 1) + "/metrics"
	base := r.startConsole(nil, "--listen", "127.0.0.1:0", "--queue", r.queue, "--metrics-url", u, "--metrics-interval", "200ms")
	var page string
	for deadline := time.Now().Add(20 * time.Second); !strings.Contains(page, `<svg class="spark"`); {
		if time.Now().After(deadline) {
			t.Fatalf("no rate chart in 20 s:\n%s", page)
		}
		time.Sleep(100 * time.Millisecond)
		resp, err := http.Get(base)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		page = string(b)
	}
	if strings.Contains(page, "hunter2secret") {
		t.Fatalf("the metrics URL's password on the page:\n%s", page)
	}
	if !strings.Contains(page, "Rates from http://scraper:") || !strings.Contains(page, `<span class="rate" data-kind="completed">`) {
		t.Fatalf("overview without the rates of the metrics URL:\n%s", page)
	}
	if strings.Contains(page, `data-kind="completed">0/s<`) {
		t.Fatalf("no completed rate while deliveries complete:\n%s", page)
	}
}
