package amqpidem

import (
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
type pubConn struct {
	dial  func() (*amqp.Connection, error)
	log   *slog.Logger
	queue string

	mu       sync.Mutex // held while dialling: callers wait for the one connection
	conn     *amqp.Connection
	closed   bool
	watchers sync.WaitGroup // loggers of blocked notifications
}

// errPubConnClosed is the error of Channel after close.
var errPubConnClosed = errors.New("amqpidem: publishing connection closed")

func newPubConn(dial func() (*amqp.Connection, error), log *slog.Logger, queue string) *pubConn {
	return &pubConn{dial: dial, log: log, queue: queue}
}

// Channel opens a channel on the connection, dialling it first if there is
// none or it has closed. The channel is opened without p.mu held: on a
// blocked connection it waits until the broker unblocks it, or until close.
func (p *pubConn) Channel() (*amqp.Channel, error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, errPubConnClosed
	}
	if p.conn == nil || p.conn.IsClosed() {
		conn, err := p.dial()
		if err != nil {
			p.mu.Unlock()
			return nil, fmt.Errorf("amqpidem: dial the publishing connection: %w", err)
		}
		if err := refuseRecovery(conn, "amqpidem: the publishing connection"); err != nil {
			p.mu.Unlock()
			_ = conn.Close()
			return nil, err
		}
		p.conn = conn
		watchBlocked(conn, &p.watchers, p.log, p.queue, "publish")
	}
	conn := p.conn
	p.mu.Unlock()
	return conn.Channel()
}

// close closes the connection and waits for its watcher; Channel fails
// from then on.
func (p *pubConn) close() {
	p.mu.Lock()
	p.closed = true
	conn := p.conn
	p.conn = nil
	p.mu.Unlock()
	if conn != nil {
		_ = conn.Close()
	}
	p.watchers.Wait()
}

// watchBlocked logs conn's connection.blocked and connection.unblocked
// notifications until conn closes, in a goroutine counted by wg. role
// names the connection in the log: "consume" or "publish".
func watchBlocked(conn *amqp.Connection, wg *sync.WaitGroup, log *slog.Logger, queue, role string) {
	// Buffered: the connection's reader waits (a while) for a full one.
	blocked := conn.NotifyBlocked(make(chan amqp.Blocking, 2))
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
