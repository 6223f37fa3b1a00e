package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/templatecheck"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// The self-check runs end to end and passes.
func TestSelfCheck(t *testing.T) {
	t.Setenv("REDIS_ADDR", testenv.RedisAddr(t))
	t.Setenv("AMQP_URL", testenv.AMQPURL(t))
	ctx, cancel := context.WithTimeout(context.Background(), timeLimit+10*time.Second)
	defer cancel()
	if err := selfCheck(ctx); err != nil {
		t.Fatal(err)
	}
}

// main.go can be copied whole into another module.
func TestMainIsTemplate(t *testing.T) {
	templatecheck.Check(t, "main.go")
}

// /readyz says whether the consumer is ready, and why not; /metrics serves
// the registry.
func TestOpsHandler(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := promamqpidem.New(promamqpidem.Options{})
	reg.MustRegister(m)
	m.Observe(context.Background(), amqpidem.Event{Queue: "payments", Outcome: amqpidem.Completed})
	var notReady error
	srv := httptest.NewServer(opsHandler(reg, func(context.Context) error { return notReady }, slog.New(slog.DiscardHandler)))
	defer srv.Close()
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, string(body)
	}

	if status, body := get("/readyz"); status != http.StatusOK {
		t.Errorf("/readyz when ready: %d %s, want 200", status, body)
	}
	notReady = fmt.Errorf("%w: consumer of %q stopping", amqpidem.ErrNotReady, "payments")
	if status, body := get("/readyz"); status != http.StatusServiceUnavailable || !strings.Contains(body, "stopping") {
		t.Errorf("/readyz when not ready: %d %q, want 503 and the reason", status, body)
	}
	status, body := get("/metrics")
	if want := `amqpidem_messages_total{outcome="completed",queue="payments",reason=""} 1`; status != http.StatusOK || !strings.Contains(body, want) {
		t.Errorf("/metrics: %d, want 200 and %s in:\n%s", status, want, body)
	}
}

// METRICS_ADDR says where to listen; "off" or empty, nowhere.
func TestListenMetrics(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	for _, off := range []string{"off", ""} {
		t.Setenv("METRICS_ADDR", off)
		if ln, err := listenMetrics(log); ln != nil || err != nil {
			t.Errorf("METRICS_ADDR=%q: got %v, %v; want no listener", off, ln, err)
		}
	}
	t.Setenv("METRICS_ADDR", "127.0.0.1:0")
	ln, err := listenMetrics(log)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	t.Setenv("METRICS_ADDR", ln.Addr().String())
	if _, err := listenMetrics(log); err == nil || !strings.Contains(err.Error(), "METRICS_ADDR") {
		t.Errorf("address in use: got %v, want an error naming METRICS_ADDR", err)
	}
}
