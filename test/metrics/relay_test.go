package metrics_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// A pgstore.Relay is what a RelayCollector reads, dead rows included.
var _ promamqpidem.RelayDeadSource = (*pgstore.Relay)(nil)

// series is the series name (without labels) of what c collects; nil if
// there is none.
func series(t *testing.T, c prometheus.Collector, name string) *dto.Metric {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0]
		}
	}
	return nil
}

// value is the gauge's value of series name; 0 if there is none.
func value(t *testing.T, c prometheus.Collector, name string) float64 {
	t.Helper()
	return series(t, c, name).GetGauge().GetValue()
}

// TestRelayCollectorDatabaseDown reads a real outbox (one pending row, one
// dead row) through a pgstore.Relay, then makes the database refuse the
// reads (the outbox's schema renamed away): relay_collect_up reads 0, and
// the gauges an operator alerts on (pending rows, oldest pending age, dead
// rows) keep their last values instead of vanishing; renamed back, up
// reads 1 again.
func TestRelayCollectorDatabaseDown(t *testing.T) {
	ctx := context.Background()
	pool := pgenv.Pool(t, 4)
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(t)), CleanupInterval: -1}
	if err := pgstore.Migrate(ctx, pool, cfg); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	schema := pgx.Identifier{cfg.Schema}.Sanitize()
	away := pgx.Identifier{cfg.Schema + "_away"}.Sanitize()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "ALTER SCHEMA "+away+" RENAME TO "+schema) // if the test stopped with it away
		if _, err := pool.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", cfg.Schema, err)
		}
	})
	ob, err := pgstore.NewOutbox(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for _, body := range []string{"dead", "pending"} {
		m := pgstore.Message{RoutingKey: testenv.Name(t), Publishing: amqp.Publishing{Body: []byte(body)}}
		if _, err := ob.Write(ctx, tx, m); err != nil {
			t.Fatalf("Write: %v", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// The first row dead, as after MaxAttempts refusals.
	if _, err := pool.Exec(ctx, "UPDATE "+schema+"."+pgstore.DefaultOutboxTable+
		" SET state = 'd' WHERE id = (SELECT min(id) FROM "+schema+"."+pgstore.DefaultOutboxTable+")"); err != nil {
		t.Fatal(err)
	}
	relay, err := pgstore.NewRelay(ob, pgstore.RelayConfig{URL: testenv.AMQPURL(t)})
	if err != nil {
		t.Fatal(err)
	}
	c := promamqpidem.NewRelayCollector(relay, promamqpidem.Options{})

	check := func(when string, up float64) {
		t.Helper()
		if got := value(t, c, "amqpidem_relay_collect_up"); got != up {
			t.Errorf("%s: relay_collect_up: got %v, want %v", when, got, up)
		}
		for _, g := range []struct {
			name string
			want float64
		}{{"amqpidem_relay_pending_rows", 1}, {"amqpidem_relay_dead_rows", 1}} {
			if series(t, c, g.name) == nil {
				t.Errorf("%s: %s is missing", when, g.name)
			} else if got := value(t, c, g.name); got != g.want {
				t.Errorf("%s: %s: got %v, want %v", when, g.name, got, g.want)
			}
		}
		if m := series(t, c, "amqpidem_relay_oldest_pending_seconds"); m == nil || !(m.GetGauge().GetValue() > 0) {
			t.Errorf("%s: relay_oldest_pending_seconds: got %v, want a positive age", when, m)
		}
		if m := series(t, c, "amqpidem_relay_collect_success_timestamp_seconds"); m == nil ||
			time.Since(time.Unix(int64(m.GetGauge().GetValue()), 0)) > time.Minute {
			t.Errorf("%s: relay_collect_success_timestamp_seconds: got %v, want about now", when, m)
		}
	}
	check("database answering", 1)

	if _, err := pool.Exec(ctx, "ALTER SCHEMA "+schema+" RENAME TO "+away); err != nil {
		t.Fatal(err)
	}
	if _, _, err := relay.Backlog(ctx); err == nil {
		t.Fatal("Backlog succeeded with the outbox's schema renamed away")
	}
	check("database refusing", 0)

	if _, err := pool.Exec(ctx, "ALTER SCHEMA "+away+" RENAME TO "+schema); err != nil {
		t.Fatal(err)
	}
	check("database answering again", 1)
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}
