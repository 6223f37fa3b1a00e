package promamqpidem

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Outcomes returns the deliveries m counted so far by queue and outcome,
// summed over reasons: messages_total as the console's rate charts read
// it (it implements console.Metrics, for a console served in the
// consumer's own process). It never fails.
func (m *Metrics) Outcomes(context.Context) (map[string]map[string]float64, error) {
	ch := make(chan prometheus.Metric, 64)
	go func() {
		m.messages.Collect(ch)
		close(ch)
	}()
	out := map[string]map[string]float64{}
	for metric := range ch {
		var d dto.Metric
		if err := metric.Write(&d); err != nil {
			continue // a counter's Write does not fail
		}
		addOutcome(out, &d)
	}
	return out, nil
}

// addOutcome adds the counter d, a series of messages_total, to out.
func addOutcome(out map[string]map[string]float64, d *dto.Metric) {
	var queue, outcome string
	for _, l := range d.GetLabel() {
		switch l.GetName() {
		case "queue":
			queue = l.GetValue()
		case "outcome":
			outcome = l.GetValue()
		}
	}
	if outcome == "" || d.GetCounter() == nil {
		return
	}
	if out[queue] == nil {
		out[queue] = map[string]float64{}
	}
	out[queue][outcome] += d.GetCounter().GetValue()
}

// maxScrape bounds what a Scraper reads of a response.
const maxScrape = 32 << 20

// Scraper reads the messages_total counter of a consumer's /metrics
// endpoint (promhttp's handler, or any that serves the Prometheus text
// format): it implements console.Metrics, for a console that runs apart
// from the consumer ("amqpidem console --metrics-url"). Series of several
// consumer processes behind one URL (or with const labels) are summed by
// queue and outcome. A Scraper is safe for concurrent use.
type Scraper struct {
	// URL is the /metrics endpoint, e.g. "http://127.0.0.1:9090/metrics".
	URL string
	// Client makes the requests; nil: http.DefaultClient. Each request is
	// bounded by the context of Outcomes.
	Client *http.Client
	// Namespace is the consumer's Options.Namespace (default "amqpidem").
	Namespace string
}

// Outcomes scrapes s.URL and returns messages_total by queue and outcome,
// summed over reasons and any other label. An endpoint that does not
// answer 200, or answers what is not the text format, is an error; one
// without the metric gives an empty map (a consumer that processed
// nothing yet has none).
func (s *Scraper) Outcomes(ctx context.Context) (map[string]map[string]float64, error) {
	client := s.Client
	if client == nil {
		client = http.DefaultClient
	}
	ns := s.Namespace
	if ns == "" {
		ns = "amqpidem"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL, nil)
	if err != nil {
		return nil, fmt.Errorf("promamqpidem: scrape: %w", err)
	}
	// The text format, which every Prometheus client serves.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("promamqpidem: scrape: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("promamqpidem: scrape: %s", resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(io.LimitReader(resp.Body, maxScrape))
	if err != nil {
		return nil, fmt.Errorf("promamqpidem: scrape: %w", err)
	}
	out := map[string]map[string]float64{}
	f := families[ns+"_messages_total"]
	if f == nil {
		return out, nil
	}
	if f.GetType() != dto.MetricType_COUNTER {
		return nil, errors.New("promamqpidem: scrape: " + ns + "_messages_total is not a counter")
	}
	for _, d := range f.GetMetric() {
		addOutcome(out, d)
	}
	return out, nil
}
