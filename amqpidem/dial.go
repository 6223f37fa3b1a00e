package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/secret"
)

// How connections are dialled so that stopping is heard meanwhile: a
// broker that accepts a connection and never answers must not hold up
// Shutdown, Run's context, or a copy's settle timeout.

// dialFunc dials a connection; ctx ending gives up on it when the dial is
// amqpidem's own (ConsumerConfig.URL): the sockets it opened are closed.
// keep must be called once the connection is set up: it stops that, and
// reports false when ctx ended first (the socket may be closed then). A
// dial of the user's (ConsumerConfig.Dial) cannot be given up on; its
// keep always reports true.
type dialFunc func(ctx context.Context) (conn *amqp.Connection, keep func() bool, err error)

// userDial makes a dialFunc of a ConsumerConfig.Dial (or DialPublisher's
// dial), whose panic is an error.
func userDial(dial func() (*amqp.Connection, error)) dialFunc {
	return func(context.Context) (conn *amqp.Connection, keep func() bool, err error) {
		defer func() {
			if v := recover(); v != nil {
				conn, keep, err = nil, nil, fmt.Errorf("amqpidem: Dial panicked: %v", v)
			}
		}()
		conn, err = dial()
		return conn, keepAlways, err
	}
}

func keepAlways() bool { return true }

// defaultHandshakeTimeout bounds the TCP dial and the AMQP handshake of
// the URL dial unless the URL says otherwise (connection_timeout), as
// amqp.Dial's does.
const defaultHandshakeTimeout = 30 * time.Second

// urlDial is the dialFunc of a ConsumerConfig.URL: amqp.Dial's, whose
// sockets are closed when ctx ends before keep. A URL that does not parse
// never will: its dials fail at once with a permanent error, which names
// the URL redacted and quotes none of amqp091-go's parse error (that
// quotes the URL, password included).
func urlDial(url string) dialFunc {
	uri, perr := amqp.ParseURI(url)
	if perr != nil {
		perr = &permanentError{err: secret.ParseError("amqpidem: ConsumerConfig.URL", url, perr)}
	}
	return func(ctx context.Context) (*amqp.Connection, func() bool, error) {
		if perr != nil {
			return nil, nil, perr
		}
		timeout := defaultHandshakeTimeout
		if uri.ConnectionTimeout > 0 {
			timeout = time.Duration(uri.ConnectionTimeout) * time.Millisecond
		}
		g := &socketGuard{ctx: ctx}
		conn, err := amqp.DialConfig(url, amqp.Config{Locale: "en_US", Dial: g.dial(timeout)})
		if err != nil {
			g.keep()
			if ctx.Err() != nil {
				err = fmt.Errorf("%w (%w)", ctx.Err(), err)
			}
			return nil, nil, err
		}
		return conn, g.keep, nil
	}
}

// socketGuard closes the sockets of one dial when its ctx ends, until
// keep.
type socketGuard struct {
	ctx   context.Context
	mu    sync.Mutex
	stops []func() bool
}

// dial is an amqp.Config.Dial: amqp.DefaultDial's, with ctx.
func (g *socketGuard) dial(timeout time.Duration) func(network, addr string) (net.Conn, error) {
	return func(network, addr string) (net.Conn, error) {
		d := net.Dialer{Timeout: timeout}
		conn, err := d.DialContext(g.ctx, network, addr)
		if err != nil {
			return nil, err
		}
		// As amqp.DefaultDial: the handshake has a deadline, which the
		// library clears once the connection is open.
		if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
			_ = conn.Close()
			return nil, err
		}
		stop := context.AfterFunc(g.ctx, func() { _ = conn.Close() })
		g.mu.Lock()
		g.stops = append(g.stops, stop)
		g.mu.Unlock()
		return conn, nil
	}
}

// keep stops closing the sockets; it reports false when ctx ended first.
func (g *socketGuard) keep() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	ok := true
	for _, stop := range g.stops {
		ok = stop() && ok
	}
	g.stops = nil
	return ok
}

// closeTimeout bounds the close of a connection amqpidem gives up on (it
// came after the consumer stopped, or its set-up failed): a broker that
// hangs would otherwise hold the close until the heartbeat gives up.
const closeTimeout = time.Second

// closeAbandoned closes conn within closeTimeout.
func closeAbandoned(conn *amqp.Connection) {
	_ = conn.CloseDeadline(time.Now().Add(closeTimeout))
}

// errStopping is a session's error when the consumer began stopping (or
// Run's context ended) while it connected.
var errStopping = errors.New("amqpidem: stopping while connecting")
