package main

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/examples/internal/templatecheck"
	"github.com/amqpidem/amqpidem/internal/testenv"
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

// A malformed AMQP_URL stops the example without printing its password
// (amqp091-go's parse error quotes the whole URL).
func TestMalformedURLHidesPassword(t *testing.T) {
	t.Setenv("REDIS_ADDR", testenv.RedisAddr(t))
	t.Setenv("AMQP_URL", "amqp://guest:s3cr%zz@127.0.0.1:5672/")
	err := run(slog.New(slog.DiscardHandler))
	if err == nil || strings.Contains(err.Error(), "s3cr") {
		t.Fatalf("run: %v; want an error without the password", err)
	}
}
