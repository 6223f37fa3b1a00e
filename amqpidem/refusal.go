package amqpidem

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/secret"
)

// How a Consumer tells the broker's refusals that no reconnection cures
// (Run ends with an error that says what to fix) from passing failures.

// errConsumed marks a session that consumed before it ended.
var errConsumed = errors.New("amqpidem: session ended")

// permanentError is a session's failure that reconnecting does not cure:
// Run ends with err. ambiguous marks one that a broker going down could
// also cause: Run ends only when the next attempt fails the same way.
type permanentError struct {
	err       error
	ambiguous bool
}

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// hideParseError returns err, or, when a URL did not parse in it (in a
// user's Dial: ConsumerConfig.URL is refused by urlDial), an error saying
// so without the parser's error, which quotes the URL, password included.
func hideParseError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) && ue.Op == "parse" {
		return secret.ParseError("the URL that Dial dialled", "", err)
	}
	return err
}

// dialError explains a failed dial; the broker's refusals are permanent.
// A URL that does not parse in a ConsumerConfig.Dial is not: the Dial may
// build another next time.
func dialError(err error) error {
	err = hideParseError(err)
	if hint := wrongPortHint(err); hint != "" {
		return fmt.Errorf("amqpidem: dial: %s: %w", hint, err)
	}
	var ae *amqp.Error
	if !errors.As(err, &ae) {
		return fmt.Errorf("amqpidem: dial: %w", err)
	}
	var why string
	switch {
	case errors.Is(err, amqp.ErrSASL):
		why = "the broker offers no authentication mechanism the client has (SASL): " +
			"give the amqp.Config of your Dial one that the broker accepts"
	case errors.Is(err, amqp.ErrVhost):
		why = "the broker refused access to the vhost: check the vhost in ConsumerConfig.URL (or Dial), and the user's permissions on it"
	case ae.Code == amqp.AccessRefused:
		why = "the broker refused the login (ACCESS_REFUSED): check the credentials, " +
			"user name and password, in ConsumerConfig.URL (or Dial)"
	case ae.Code == amqp.NotAllowed && !strings.Contains(ae.Reason, "limit"):
		why = "the broker does not let the user in (NOT_ALLOWED): check that the vhost in ConsumerConfig.URL (or Dial) exists " +
			"and that the user has permissions on it"
	default:
		return fmt.Errorf("amqpidem: dial: %w", err)
	}
	// The broker's own reply is sure; the library's fallbacks, when the
	// socket closed without one, are not.
	return &permanentError{err: fmt.Errorf("amqpidem: dial: %s: %w", why, err),
		ambiguous: !ae.Server && !errors.Is(err, amqp.ErrSASL)}
}

// wrongPortHint says what to check when a dial failed the way a port
// that is not RabbitMQ's AMQP listener fails it ("" when err is not such
// a failure): amqp091-go's own 501 for a handshake that the server closed,
// never answered or answered with something other than AMQP, or a TLS
// record error for amqps:// on a plain port. A broker starting or
// stopping closes handshakes too, so such dials are retried; a wrong port
// fails them for ever, and "EOF" alone says neither.
func wrongPortHint(err error) string {
	if re := (tls.RecordHeaderError{}); errors.As(err, &re) {
		return "the server did not answer TLS (an amqps:// URL on a plain AMQP port? " +
			"RabbitMQ's plain listener is 5672, its TLS one usually 5671)"
	}
	if ae := (*amqp.Error)(nil); errors.As(err, &ae) && ae.Code == amqp.FrameError && !ae.Server {
		return "the server closed the connection, did not answer, or did not answer AMQP 0-9-1 " +
			"during the handshake; if this lasts, check that the URL's host and port are a RabbitMQ AMQP listener " +
			"(5672; amqps:// for its TLS one, usually 5671) and the broker's log"
	}
	return ""
}

// The steps of setting up a session after dialling, for setupError.
const (
	stepChannel = "open a channel for queue"
	stepQos     = "set QoS for queue"
	stepDeclare = "declare queue"
	stepConsume = "consume queue"
)

// setupError explains a failure at step of setting up a session: the
// broker's refusals that the next connection would meet again are
// permanent.
func (c *Consumer) setupError(step string, err error) error {
	q := c.cfg.Queue
	if step == stepDeclare && c.ownDeclare {
		step = "declare (ConsumerConfig.Declare) the topology of queue"
	}
	var ae *amqp.Error
	if !errors.As(err, &ae) {
		return fmt.Errorf("amqpidem: %s %q: %w", step, q, err)
	}
	var why string
	switch ae.Code {
	case amqp.AccessRefused:
		why = "the broker refused access (ACCESS_REFUSED): give the user configure, write and read permissions on the queue, " +
			"or stop the other connection that uses it exclusively"
	case amqp.PreconditionFailed:
		switch {
		case step == stepDeclare:
			why = fmt.Sprintf("the queue exists with arguments other than ConsumerConfig.QueueArgs (%s), or the broker refuses these "+
				"(PRECONDITION_FAILED): make QueueArgs match the queue's, or delete the queue so that it is declared again",
				tableText(c.cfg.QueueArgs))
		case c.ownDeclare && strings.HasPrefix(step, "declare"):
			why = "the broker refused a declaration (PRECONDITION_FAILED), typically of a queue or exchange that exists " +
				"with other arguments or of another type: make Declare match it, or delete it so that it is declared again"
		default:
			why = "the broker refused it (PRECONDITION_FAILED)"
		}
	case amqp.NotFound:
		if step == stepConsume || strings.Contains(ae.Reason, "queue '"+q+"'") {
			why = "the queue does not exist (NOT_FOUND): declare it in ConsumerConfig.Declare (the default Declare does), or fix Config.Queue"
		}
	case amqp.NotAllowed:
		why = "the broker does not allow it (NOT_ALLOWED)"
	}
	if why == "" {
		return fmt.Errorf("amqpidem: %s %q: %w", step, q, err)
	}
	return &permanentError{err: fmt.Errorf("amqpidem: %s %q: %s: %w", step, q, why, err)}
}

// ErrAutoRecovery means a connection has amqp091-go's automatic recovery
// on (amqp.Config.Recovery, v1.16): such a connection is rebuilt under
// its channels after a drop, and a rebuilt channel numbers its deliveries
// and publishes from 1 again while acks and confirms of the old ones are
// still on their way, so that an ack of an old delivery can settle a new
// one whose handler still runs. amqpidem reconnects itself: leave
// Recovery nil on the connections it consumes or publishes on. Run ends
// with it (a configuration error) when ConsumerConfig.Dial returns such a
// connection, Wrap refuses one, and a Publisher's publishes on one fail
// with it.
var ErrAutoRecovery = errors.New("amqpidem: the connection recovers by itself (amqp.Config.Recovery is set); " +
	"amqpidem reconnects itself: leave Recovery nil")

// refuseRecovery returns an error wrapping ErrAutoRecovery, naming where
// conn came from (what), when conn recovers by itself.
func refuseRecovery(conn *amqp.Connection, what string) error {
	if conn.IsRecoveryEnabled() {
		return fmt.Errorf("%s: %w", what, ErrAutoRecovery)
	}
	return nil
}
