package main

import (
	"context"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/examples/internal/templatecheck"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
)

// The self-check runs end to end and passes.
func TestSelfCheck(t *testing.T) {
	t.Setenv("PG_DSN", pgenv.DSN(t))
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
