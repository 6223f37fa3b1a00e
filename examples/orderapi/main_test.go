package main

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/examples/internal/templatecheck"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// The self-check runs end to end and passes.
func TestSelfCheck(t *testing.T) {
	t.Setenv("PG_DSN", pgenv.DSN(t))
	t.Setenv("AMQP_URL", testenv.AMQPURL(t))
	t.Setenv("REDIS_ADDR", testenv.RedisAddr(t))
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

// A malformed AMQP_URL stops the service without printing its password
// (amqp091-go's parse error quotes the whole URL).
func TestMalformedURLHidesPassword(t *testing.T) {
	pool := pgenv.Pool(t, 2)
	ctx := context.Background()
	schema := "orderapi_url_test"
	if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE") })
	a := app{log: slog.New(slog.DiscardHandler), cfg: pgstore.Config{Schema: schema}, queue: queue}
	err := a.setup(ctx, pool, "amqp://guest:s3cr%zz@127.0.0.1:5672/")
	if err == nil || strings.Contains(err.Error(), "s3cr") {
		t.Fatalf("setup: %v; want an error without the password", err)
	}
}
