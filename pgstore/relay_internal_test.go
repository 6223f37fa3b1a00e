package pgstore

import (
	"context"
	"fmt"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// What counts toward MaxAttempts: the broker refusing the message itself,
// never the broker or the connection failing to take it now.
func TestRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"unroutable", fmt.Errorf("%w: exchange \"\" routing key \"q\": 312 NO_ROUTE", amqpidem.ErrUnroutable), true},
		{"exchange not found", fmt.Errorf("%w: the broker closed the channel: %w", amqpidem.ErrNotConfirmed,
			&amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no exchange 'x'"}), true},
		{"property refused", fmt.Errorf("%w: the broker closed the channel: %w", amqpidem.ErrNotConfirmed,
			&amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - invalid expiration"}), true},
		{"undecodable row", fmt.Errorf("%w: truncated", errUndecodable), true},
		// A quorum queue without a leader nacks: the row must wait, not die.
		{"plain nack", fmt.Errorf("%w: exchange \"\" routing key \"q\"", amqpidem.ErrNotConfirmed), false},
		{"connection forced", fmt.Errorf("%w: the broker closed the channel: %w", amqpidem.ErrNotConfirmed,
			&amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED - shutdown"}), false},
		{"connection lost", fmt.Errorf("%w: the broker closed the channel: %w", amqpidem.ErrNotConfirmed,
			&amqp.Error{Code: amqp.FrameError, Reason: "read: connection reset by peer"}), false},
		{"channel closed", fmt.Errorf("publish: channel closed: %w", amqp.ErrClosed), false},
		{"confirm timeout", fmt.Errorf("waiting for confirm: %w", context.DeadlineExceeded), false},
	} {
		if got := refused(c.err); got != c.want {
			t.Errorf("%s: refused(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}
