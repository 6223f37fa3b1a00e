package amqpidem_test

import (
	"context"
	"fmt"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// What a refusal of the message is (it counts toward MaxAttempts), and
// what is the broker or the connection failing to take it now.
func TestIsRefused(t *testing.T) {
	closed := func(code int, reason string) error {
		return fmt.Errorf("%w: exchange \"x\" routing key \"q\": the broker closed the channel: %w", amqpidem.ErrNotConfirmed,
			&amqp.Error{Code: code, Reason: reason, Server: true})
	}
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"unroutable", fmt.Errorf("%w: exchange \"\" routing key \"q\": 312 NO_ROUTE", amqpidem.ErrUnroutable), true},
		{"exchange not found", closed(amqp.NotFound, "NOT_FOUND - no exchange 'x'"), true},
		{"property refused", closed(amqp.PreconditionFailed, "PRECONDITION_FAILED - invalid expiration"), true},
		{"access refused", closed(amqp.AccessRefused, "ACCESS_REFUSED - user_id property set to 'x'"), true},
		{"plain nack", fmt.Errorf("%w: exchange \"\" routing key \"q\"", amqpidem.ErrNotConfirmed), false},
		{"connection forced", closed(amqp.ConnectionForced, "CONNECTION_FORCED - shutdown"), false},
		{"connection lost", closed(amqp.FrameError, "EOF"), false},
		{"connection closed by us", fmt.Errorf("%w: the broker closed the channel: %w", amqpidem.ErrNotConfirmed, amqp.ErrClosed), false},
		{"internal error", closed(amqp.InternalError, "INTERNAL_ERROR"), false},
		{"channel closed before the publish", fmt.Errorf("publish: channel closed: %w", &amqp.Error{Code: amqp.NotFound}), false},
		{"confirm timeout", fmt.Errorf("waiting for confirm: %w", context.DeadlineExceeded), false},
		{"nil", nil, false},
	} {
		if got := amqpidem.IsRefused(c.err); got != c.want {
			t.Errorf("%s: IsRefused(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}
