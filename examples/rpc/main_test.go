package main

import (
	"context"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// The example runs end to end and passes its own checks.
func TestRun(t *testing.T) {
	t.Setenv("REDIS_ADDR", testenv.RedisAddr(t))
	t.Setenv("AMQP_URL", testenv.AMQPURL(t))
	ctx, cancel := context.WithTimeout(context.Background(), timeLimit+10*time.Second)
	defer cancel()
	if err := run(ctx); err != nil {
		t.Fatal(err)
	}
}
