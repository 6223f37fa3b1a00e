package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// The outbox variant (issue 23): unique, but the handler stages one small
// message per message (amqpidem.Stage), which amqpidem stores with the
// outcome, publishes confirmed and mandatory, and records as published
// (lock.Amender) before the ack.
//
// Where the staged messages go: to a durable queue of the run's own
// (outboxSink), of the run's queue type, declared empty before the
// prefill and deleted with the run's queue. A run stages N messages, so
// that queue never holds more than N, and as it fills the run's queue
// drains: the broker holds about the N messages it held when the run
// started, as in every other run. A max-length queue (x-max-length,
// drop-head) would bound it too, but past its length every publish would
// also drop a message, work that no pipeline does; and the bench could no
// longer check that every message staged exactly one.
//
// -outbox-sink says whether anyone consumes it. "idle" (the default):
// nobody does, as when the downstream consumer is down or on another
// machine; the broker only stores the messages. "consumed": a bare
// consumer (manual acks, the same prefetch and workers) drains it while
// the run is measured, as stage B of a pipeline on the same broker would;
// the broker then delivers and forgets each message too, and that
// consumer's CPU counts in the run's client CPU.
const (
	sinkIdle     = "idle"
	sinkConsumed = "consumed"
)

// stagedBodySize is the body size of every staged message: a small event,
// as a follow-up message usually is.
const stagedBodySize = 64

var stagedBody = func() []byte {
	b := make([]byte, stagedBodySize)
	for i := range b {
		b[i] = 'A' + byte(i%26)
	}
	return b
}()

// outboxSink names the queue the outbox run of queue stages its messages
// to.
func outboxSink(queue string) string { return queue + ".staged" }

// stagingHandler is the outbox variant's handler: it stages one message
// to queue sink (through the default exchange) and returns no result.
func stagingHandler(sink string) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) ([]byte, error) {
		return nil, amqpidem.Stage(ctx, "", sink, amqp.Publishing{
			ContentType: "application/octet-stream",
			Body:        stagedBody,
		})
	})
}

// sink is an outbox run's queue of staged messages, and its consumer in
// mode consumed.
type sink struct {
	brk   *broker
	name  string
	drain *plain // nil: idle
	t     *tally // what drain acked
}

// openSink declares the sink of queue (type qt) empty and, in mode
// consumed, starts draining it, expecting n messages.
func (e *env) openSink(ctx context.Context, qt, queue string, n int) (*sink, error) {
	s := &sink{brk: e.brk, name: outboxSink(queue)}
	if err := e.brk.declare(s.name, qt); err != nil {
		return nil, err
	}
	if e.opts.OutboxSink == sinkConsumed {
		s.t = newTally(n, nil)
		d, err := startPlain(ctx, e.opts.AMQPURL, s.name, e.opts.Prefetch, e.opts.Concurrency, noop, s.t)
		if err != nil {
			return nil, errors.Join(err, e.brk.remove(s.name))
		}
		s.drain = d
	}
	return s, nil
}

// close counts the messages that reached the sink (consumed, then still
// in it), waiting up to 30 seconds for its consumer to have n, then
// stops that consumer and deletes the queue.
func (s *sink) close(ctx context.Context) (staged int, err error) {
	defer func() { err = errors.Join(err, s.brk.remove(s.name)) }()
	if s.drain != nil {
		werr := s.t.wait(ctx, 30*time.Second, s.drain)
		if werr != nil {
			werr = fmt.Errorf("consumer of %s: %w", s.name, werr)
		}
		err = errors.Join(werr, s.drain.stop(ctx))
		staged = int(s.t.ok.Load())
	}
	left, derr := s.brk.depth(s.name)
	return staged + left, errors.Join(err, derr)
}
