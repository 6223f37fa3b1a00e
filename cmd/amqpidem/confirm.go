package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/secret"
)

// dial connects to RabbitMQ at --amqp.
// A URL that does not parse is bad usage, told without amqp091-go's
// parse error, which quotes the URL with its password.
func (o *options) dial() (*amqp.Connection, error) {
	if _, err := amqp.ParseURI(o.amqpURL); err != nil {
		return nil, withCode(exitUsage, "%w", secret.ParseError("--amqp", o.amqpURL, err))
	}
	timeout := o.timeout
	conn, err := amqp.DialConfig(o.amqpURL, amqp.Config{Properties: amqp.Table{"connection_name": "amqpidem cli"},
		Locale: "en_US", Dial: boundedDial(timeout)})
	if err != nil {
		if isTimeout(err) {
			return nil, withCode(exitFailed, "RabbitMQ at %s: no connection within --timeout %v (a node that accepts and never answers, or a wrong port): %w",
				secret.URL(o.amqpURL), timeout, err)
		}
		return nil, withCode(exitFailed, "RabbitMQ at %s: %w", secret.URL(o.amqpURL), err)
	}
	return conn, nil
}

// boundedDial is an amqp.Config.Dial whose TCP dial and AMQP handshake end
// together within timeout: amqp.DefaultDial's is 30 s whatever --timeout
// says. amqp091-go clears the deadline once the connection is open.
func boundedDial(timeout time.Duration) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		deadline := time.Now().Add(timeout)
		d := net.Dialer{Deadline: deadline}
		conn, err := d.Dial(network, addr)
		if err != nil {
			return nil, err
		}
		if err := conn.SetDeadline(deadline); err != nil {
			conn.Close()
			return nil, err
		}
		return conn, nil
	}
}

// isTimeout reports whether err is a network deadline passing, even as
// amqp091-go wraps it (in an *amqp.Error, as text only).
func isTimeout(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	return errors.Is(err, os.ErrDeadlineExceeded) || strings.Contains(err.Error(), "i/o timeout")
}

// confirmer publishes one message at a time, mandatory, on a channel in
// confirm mode, and waits for the broker's answer.
type confirmer struct {
	conn    *amqp.Connection
	ch      *amqp.Channel
	returns chan amqp.Return
	closes  chan *amqp.Error // the channel's close, with the broker's reason
}

func newConfirmer(conn *amqp.Connection) (*confirmer, error) {
	c := &confirmer{conn: conn}
	return c, c.open()
}

// open opens the publishing channel, in confirm mode.
func (c *confirmer) open() error {
	ch, err := c.conn.Channel()
	if err != nil {
		return withCode(exitFailed, "RabbitMQ: opening a publishing channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		ch.Close()
		return withCode(exitFailed, "RabbitMQ: confirm mode: %w", err)
	}
	c.ch, c.returns, c.closes = ch, ch.NotifyReturn(make(chan amqp.Return, 1)), ch.NotifyClose(make(chan *amqp.Error, 1))
	return nil
}

// errUnroutable means a mandatory message came back: no queue is bound to
// take it.
var errUnroutable = errors.New("unroutable")

// channelClosed means the broker closed the publishing channel over a
// publish (an exchange that does not exist, access refused) while the
// connection stayed up: the message was not taken, and reopen gives a
// channel for the next one. Code is the broker's reply code, 0 when it
// did not say.
type channelClosed struct {
	code   int
	reason string
}

func (e *channelClosed) Error() string {
	if e.code == 0 {
		return "the broker closed the channel"
	}
	return fmt.Sprintf("the broker closed the channel: %d %s", e.code, e.reason)
}

// publish sends msg and returns nil once the broker confirmed it routed
// to a queue; an error otherwise (returned as unroutable, nacked, the
// channel closed over it, or no answer within timeout).
func (c *confirmer) publish(ctx context.Context, exchange, key string, msg amqp.Publishing, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if err != nil {
		return err
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return fmt.Errorf("no confirm: %w", err)
	}
	// A mandatory message no queue took comes back before its confirm.
	// (returns is closed, and reads as a zero Return, once the channel
	// is.)
	select {
	case r, ok := <-c.returns:
		if ok {
			return fmt.Errorf("%w: %d %s", errUnroutable, r.ReplyCode, r.ReplyText)
		}
	default:
	}
	if !acked {
		if c.ch.IsClosed() && !c.conn.IsClosed() {
			// A channel the broker closed nacks what it had in flight;
			// the reason comes on closes, sent before those nacks.
			select {
			case e := <-c.closes:
				if e != nil {
					return &channelClosed{code: e.Code, reason: e.Reason}
				}
			case <-time.After(time.Second):
			}
			return &channelClosed{}
		}
		return fmt.Errorf("the broker refused it (nack)")
	}
	return nil
}

// reopen replaces a channel the broker closed.
func (c *confirmer) reopen() error {
	if !c.ch.IsClosed() {
		return nil
	}
	return c.open()
}
