package amqpidem

import (
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// TestWhoClosedNamesTheBrokerOnlyWhenItDid: a publish whose channel
// closed says the broker closed it only when the broker sent the close
// (trial2: a lost TCP connection, amqp091's own 501 "EOF", read "the
// broker closed the channel").
func TestWhoClosedNamesTheBrokerOnlyWhenItDid(t *testing.T) {
	for _, c := range []struct {
		reason error
		broker bool
	}{
		{&amqp.Error{Code: amqp.FrameError, Reason: "EOF"}, false},
		{amqp.ErrClosed, false},
		{&amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED", Server: true}, true},
		{&amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED", Server: true}, true},
	} {
		got := whoClosed(c.reason)
		if strings.Contains(got, "the broker closed") != c.broker {
			t.Errorf("%v: %q", c.reason, got)
		}
	}
}
