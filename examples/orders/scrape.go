// This file is not part of the template: copy main.go alone. It reads
// what a consumer serves (/readyz, /metrics) for the self-check.

package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// waitReady waits until base's /readyz answers 200.
func waitReady(ctx context.Context, base string) error {
	for {
		status, body, err := get(ctx, base+"/readyz")
		if err == nil && status == http.StatusOK {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("/readyz: %d %s %v: %w", status, strings.TrimSpace(body), err, context.Cause(ctx))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// get returns the status and body of a GET of url.
func get(ctx context.Context, url string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// scraped is what /metrics and /readyz said at the end of the run.
type scraped struct {
	readyz   int                // /readyz's status
	messages map[[2]string]int  // amqpidem_messages_total by outcome and reason
	outcomes map[string]int     // the same by outcome
	series   map[string]float64 // a few other series, by name
}

// scrape reads base's /readyz and the metrics of queue at base's /metrics,
// as Prometheus would.
func scrape(ctx context.Context, base, queue string) (scraped, error) {
	s := scraped{messages: map[[2]string]int{}, outcomes: map[string]int{}, series: map[string]float64{}}
	status, _, err := get(ctx, base+"/readyz")
	if err != nil {
		return s, fmt.Errorf("/readyz: %w", err)
	}
	s.readyz = status
	status, body, err := get(ctx, base+"/metrics")
	if err == nil && status != http.StatusOK {
		err = fmt.Errorf("status %d: %s", status, body)
	}
	if err != nil {
		return s, fmt.Errorf("/metrics: %w", err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		return s, fmt.Errorf("/metrics: %w", err)
	}
	label := func(m *dto.Metric, name string) string {
		for _, l := range m.GetLabel() {
			if l.GetName() == name {
				return l.GetValue()
			}
		}
		return ""
	}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			if label(m, "queue") != queue {
				continue
			}
			switch name {
			case "amqpidem_messages_total":
				n := int(m.GetCounter().GetValue())
				s.messages[[2]string{label(m, "outcome"), label(m, "reason")}] += n
				s.outcomes[label(m, "outcome")] += n
			case "amqpidem_requeues_total", "amqpidem_lease_extensions_total":
				s.series[name+"{"+label(m, "outcome")+label(m, "result")+"}"] += m.GetCounter().GetValue()
			case "amqpidem_handlers_in_flight":
				s.series[name] += m.GetGauge().GetValue()
			case "amqpidem_store_call_duration_seconds":
				s.series[name+"{"+label(m, "op")+"}"] += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return s, nil
}

// demoBank is main.go's bank as the self-check needs it: an in-memory
// ledger of charges that records every execution and who ran it, refuses a
// fencing token not above the last one it saw for the payment, and plays
// the stories of the slow, failing and declined payments.
