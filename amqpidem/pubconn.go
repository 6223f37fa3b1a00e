package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// pubConn is a Consumer's publishing connection, apart from the ones it
// consumes on. It dials on first use and again once its connection has
// closed, so that it outlives the consuming sessions: the handlers of a
// session whose connection died can still publish their copies. It is the
// ChannelOpener of the Consumer's publisher. Safe for concurrent use.
//
// One goroutine dials at a time, without the lock held: callers wait for
// its connection only as long as their context lets them (a copy's settle
// timeout), or until abort is closed, so that a broker that accepts the
// connection and never answers holds no caller for longer.
type pubConn struct {
	dial  dialFunc
	log   *slog.Logger
	queue string
	// own is set when dial is amqpidem's (a URL): close gives up on a dial
	// in flight and waits for it. A dial of the user's cannot be given up
	// on, and close does not wait for it.
	own bool
	// abort, when closed, ends every wait for a dial at once: a Consumer
	// forced to stop does not wait for its copies' connection. Nil: never.
	abort <-chan struct{}

	ctx    context.Context // ends the dial in flight on close
	cancel context.CancelFunc

	mu       sync.Mutex
	conn     *amqp.Connection
	dialing  *dialAttempt // the dial in flight, if any
	closed   bool
	watchers sync.WaitGroup // loggers of blocked notifications
	dials    sync.WaitGroup // dials of amqpidem's own (own)
}

// dialAttempt is one dial of a pubConn: done is closed when it ended, with
// err set if it failed.
type dialAttempt struct {
	done chan struct{}
	err  error
}

// errPubConnClosed is the error of Channel after close.
var errPubConnClosed = errors.New("amqpidem: publishing connection closed")

// errPubConnAbort is the error of a wait for the publishing connection's
// dial cut short by abort.
var errPubConnAbort = errors.New("amqpidem: stopping: the publishing connection is still being dialled")

func newPubConn(dial dialFunc, own bool, log *slog.Logger, queue string) *pubConn {
	ctx, cancel := context.WithCancel(context.Background())
	return &pubConn{dial: dial, own: own, log: log, queue: queue, ctx: ctx, cancel: cancel}
}

// Channel opens a channel on the connection, dialling it first if there is
// none or it has closed; see channel.
func (p *pubConn) Channel() (*amqp.Channel, error) { return p.channel(context.Background()) }

// channel opens a channel on the connection, dialling it first if there is
// none or it has closed, waiting for the dial until ctx ends or abort is
// closed. The channel is opened without p.mu held: on a blocked connection
// it waits until the broker unblocks it, or until close.
func (p *pubConn) channel(ctx context.Context) (*amqp.Channel, error) {
	for {
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, errPubConnClosed
		}
		if p.conn != nil && !p.conn.IsClosed() {
			conn := p.conn
			p.mu.Unlock()
			return conn.Channel()
		}
		a := p.dialing
		if a == nil {
			a = &dialAttempt{done: make(chan struct{})}
			p.dialing = a
			if p.own {
				p.dials.Add(1)
			}
			go p.dialNow(a)
		}
		p.mu.Unlock()
		select {
		case <-a.done:
			if a.err != nil {
				return nil, a.err
			}
			// Connected: open the channel (or dial again, had it closed
			// already).
		case <-ctx.Done():
			return nil, fmt.Errorf("amqpidem: waiting for the publishing connection's dial: %w", ctx.Err())
		case <-p.abort:
			return nil, errPubConnAbort
		}
	}
}

// dialNow makes dial a, and makes its connection p's, unless p was closed
// meanwhile.
func (p *pubConn) dialNow(a *dialAttempt) {
	if p.own {
		defer p.dials.Done()
	}
	conn, keep, err := p.dial(p.ctx)
	switch {
	case err != nil:
		if hint := wrongPortHint(err); hint != "" {
			err = fmt.Errorf("amqpidem: dial the publishing connection: %s: %w", hint, err)
		} else {
			err = fmt.Errorf("amqpidem: dial the publishing connection: %w", hideParseError(err))
		}
	case !keep():
		err = errPubConnClosed // closed while dialling: its socket too
	default:
		err = refuseRecovery(conn, "amqpidem: the publishing connection")
	}
	p.mu.Lock()
	p.dialing = nil
	if err == nil && p.closed {
		err = errPubConnClosed
	}
	if err == nil {
		p.conn = conn
		watchBlocked(conn, &p.watchers, p.log, p.queue, "publish")
	}
	p.mu.Unlock()
	if err != nil && conn != nil {
		closeAbandoned(conn)
	}
	a.err = err
	close(a.done)
}

// close closes the connection (within closeTimeout) and waits for its
// watcher, and for a dial of amqpidem's own in flight, which it gives up
// on; Channel fails from then on. A dial of the user's in flight is not waited for: its
// connection is closed when it comes.
func (p *pubConn) close() {
	p.mu.Lock()
	p.closed = true
	conn := p.conn
	p.conn = nil
	p.mu.Unlock()
	p.cancel()
	if conn != nil {
		// Bounded: a connection the broker has blocked answers
		// connection.close only once unblocked.
		closeAbandoned(conn)
	}
	p.dials.Wait()
	p.watchers.Wait()
}

// watchBlocked logs conn's connection.blocked and connection.unblocked
// notifications until conn closes, in a goroutine counted by wg. role
// names the connection in the log: "consume" or "publish".
func watchBlocked(conn *amqp.Connection, wg *sync.WaitGroup, log *slog.Logger, queue, role string) {
	// Buffered: the connection's reader waits (a while) for a full one.
	logBlockedIn(wg, log, queue, role, conn.NotifyBlocked(make(chan amqp.Blocking, 2)))
}

// logBlockedIn runs logBlocked in a goroutine counted by wg.
func logBlockedIn(wg *sync.WaitGroup, log *slog.Logger, queue, role string, blocked <-chan amqp.Blocking) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		logBlocked(log, queue, role, blocked)
	}()
}

// logBlocked logs each notification of blocked until it is closed:
// connection.blocked at warn level, with the broker's reason, so that a
// broker that stops taking publishes (a memory or disk alarm) does not
// hang the Consumer silently, and connection.unblocked at info level.
func logBlocked(log *slog.Logger, queue, role string, blocked <-chan amqp.Blocking) {
	var since time.Time
	for b := range blocked {
		if b.Active {
			since = time.Now()
			log.Warn("amqpidem: connection.blocked: the broker stopped taking publishes on this connection "+
				"(a resource alarm); publishes wait until it unblocks",
				"queue", queue, "connection", role, "reason", b.Reason)
			continue
		}
		attrs := []any{"queue", queue, "connection", role}
		if !since.IsZero() {
			attrs = append(attrs, "blocked_for", time.Since(since))
		}
		log.Info("amqpidem: connection unblocked", attrs...)
		since = time.Time{}
	}
}
