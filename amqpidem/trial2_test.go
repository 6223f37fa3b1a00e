package amqpidem_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/amqpidem/amqpidemtest"
)

// nilOrder is a handler bug: a nil pointer dereference.
type nilOrder struct{ id string }

// panicky panics with a runtime error, as a real handler bug does.
func panicky(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	var o *nilOrder
	return []byte(o.id), nil
}

// TestTrial2PanicStackLogged: a handler that panics is retried, then
// dead-lettered; its log lines said only "handler panic: runtime error:
// invalid memory address or nil pointer dereference", with nothing
// saying where. The stack amqpidem recovered (PanicError.Stack) reached
// an Observer but neither the log nor the docs: an operator had no way to
// find the line at fault. The log line of a panicked execution must name
// the function that panicked.
func TestTrial2PanicStackLogged(t *testing.T) {
	var b bytes.Buffer
	log := slog.New(slog.NewTextHandler(&b, nil))
	k := amqpidemtest.New(t, amqpidem.Config{MaxAttempts: 1, Logger: log}, amqpidem.HandlerFunc(panicky))
	r := k.Deliver(amqpidemtest.Message{ID: "order-1", Body: []byte("x")})
	if r.Outcome != amqpidem.DeadLettered {
		t.Fatalf("outcome %v %q, want dead_lettered", r.Outcome, r.Reason)
	}
	if !strings.Contains(b.String(), "amqpidem_test.panicky") {
		t.Errorf("the log does not say where the handler panicked:\n%s", b.String())
	}
}
