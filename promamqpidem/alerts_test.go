package promamqpidem_test

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// deadRelay is a RelayDeadSource with set figures.
type deadRelay struct{ fakeRelay }

func (deadRelay) Dead(context.Context) (int64, error) { return 2, nil }

// TestAlertRuleNames: every amqpidem metric the example alerting rules of
// docs/alerts and docs/operating.md name is one that
// Metrics or a RelayCollector exports (promtool tests the rules on
// series of their own, and would not see a name drift).
func TestAlertRuleNames(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	ctx := context.Background()
	info := amqpidem.Info{Queue: q}
	m.HandlerStarted(ctx, info)
	m.HandlerEnded(ctx, info)
	m.ObserveStore(ctx, amqpidem.StoreCall{Queue: q, Op: "extend", Leases: 1, Duration: time.Millisecond})
	m.ObserveBatch(ctx, amqpidem.BatchInfo{Queue: q, Size: 1, Runs: 1, Duration: time.Millisecond})
	m.Observe(ctx, amqpidem.Event{Queue: q, Outcome: amqpidem.Retried, Delay: time.Second, Handler: time.Millisecond,
		Published: time.Now(), Outbox: amqpidem.OutboxCounts{Staged: 1}})
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m, promamqpidem.NewRelayCollector(deadRelay{}, promamqpidem.Options{}))
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	exported := map[string]bool{}
	for _, f := range families {
		exported[f.GetName()] = true
	}
	name := regexp.MustCompile(`\bamqpidem_[a-z_]+`)
	for _, file := range []string{"../docs/alerts/amqpidem.rules.yml", "../docs/operating.md"} {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		seen := 0
		for _, n := range name.FindAllString(string(b), -1) {
			if strings.HasPrefix(n, "amqpidem_outbox") && !strings.HasSuffix(n, "_total") {
				continue // pgstore's table, amqpidem_outbox, not a metric
			}
			base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_count"), "_sum"), "_bucket")
			if !exported[base] {
				t.Errorf("%s names %s, which promamqpidem does not export", file, n)
			}
			seen++
		}
		if seen == 0 {
			t.Errorf("%s names no amqpidem metric", file)
		}
	}
}
