package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// tally counts the messages a consumer settled as expected, until want of
// them; it records the time of the first and of the want-th. Anything else
// (an unexpected amqpidem outcome, a failed handler or ack) is counted
// apart, with the first reason kept. Safe for concurrent use.
type tally struct {
	want int64
	// onOK, if set, is told of every expected settlement: the message id
	// (amqpidem: the key) and when it was settled.
	onOK func(id string, at time.Time)

	ok, bad     atomic.Int64
	first, last atomic.Int64 // unix ns
	// batches and batchMsgs count the handler batches a batch consumer
	// ran (amqpidem.BatchInfo) and the deliveries they gathered.
	batches, batchMsgs atomic.Int64
	done               chan struct{}
	once               sync.Once

	mu     sync.Mutex
	reason string
}

func newTally(want int, onOK func(string, time.Time)) *tally {
	return &tally{want: int64(want), onOK: onOK, done: make(chan struct{})}
}

func (t *tally) settled(id string, at time.Time) {
	if t.onOK != nil {
		t.onOK(id, at)
	}
	n := t.ok.Add(1)
	if n == 1 {
		t.first.Store(at.UnixNano())
	}
	if n == t.want {
		t.last.Store(at.UnixNano())
		t.once.Do(func() { close(t.done) })
	}
}

func (t *tally) failed(reason string) {
	if t.bad.Add(1) == 1 {
		t.mu.Lock()
		t.reason = reason
		t.mu.Unlock()
	}
}

func (t *tally) firstReason() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.reason
}

// span is the time from the first expected settlement to the want-th.
func (t *tally) span() time.Duration {
	return time.Duration(t.last.Load() - t.first.Load())
}

// wait waits until want messages were settled as expected, for at most
// timeout, or until c ends on its own.
func (t *tally) wait(ctx context.Context, timeout time.Duration, c consumer) error {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-t.done:
		return nil
	case <-c.ended():
		return fmt.Errorf("consumer ended early with %d of %d settled: %v", t.ok.Load(), t.want, c.err())
	case <-timer.C:
		return fmt.Errorf("timed out after %v with %d of %d settled (%d unexpected; first: %s)",
			timeout, t.ok.Load(), t.want, t.bad.Load(), t.firstReason())
	case <-ctx.Done():
		return fmt.Errorf("%w with %d of %d settled", ctx.Err(), t.ok.Load(), t.want)
	}
}

// waitFor waits until at least n messages were settled as expected.
func (t *tally) waitFor(ctx context.Context, n int64, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for t.ok.Load() < n {
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %v waiting for %d settled messages (have %d)", timeout, n, t.ok.Load())
		}
		if err := sleepCtx(ctx, 2*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// consumer is a running consumer of one of the variants.
type consumer interface {
	// ended is closed when the consumer ended on its own (connection
	// lost, Run returned); err then says why.
	ended() <-chan struct{}
	err() error
	// stop stops consuming and waits for the consumer to be gone.
	stop(ctx context.Context) error
}

// exit records why a consumer ended, once.
type exit struct {
	once sync.Once
	done chan struct{}
	why  error
}

func newExit() exit { return exit{done: make(chan struct{})} }

func (e *exit) set(err error) {
	e.once.Do(func() { e.why = err; close(e.done) })
}

func (e *exit) ended() <-chan struct{} { return e.done }

func (e *exit) err() error {
	select {
	case <-e.done:
		return e.why
	default:
		return nil
	}
}

// plain is a bare amqp091-go consumer: one connection, one channel with QoS
// prefetch, manual acks, and a pool of workers that each take a delivery,
// run handle and ack it (or nack it with requeue when handle fails).
type plain struct {
	exit
	conn    *amqp.Connection
	ch      *amqp.Channel
	tag     string
	workers sync.WaitGroup
}

// handleFunc is a plain consumer's per-message work, before the ack.
type handleFunc func(ctx context.Context, d *amqp.Delivery) error

func startPlain(ctx context.Context, url, queue string, prefetch, workers int, handle handleFunc, t *tally) (*plain, error) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return nil, fmt.Errorf("bare consumer: dial: %w", err)
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Qos(prefetch, 0, false)
	}
	p := &plain{exit: newExit(), conn: conn, ch: ch, tag: "bench-plain-" + randomHex(4)}
	var deliveries <-chan amqp.Delivery
	if err == nil {
		deliveries, err = ch.Consume(queue, p.tag, false, false, false, false, nil)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("bare consumer on %s: %w", queue, err)
	}
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		if e, ok := <-closed; ok && e != nil {
			p.set(e)
		}
	}()
	for range workers {
		p.workers.Add(1)
		go func() {
			defer p.workers.Done()
			for d := range deliveries {
				if err := handle(ctx, &d); err != nil {
					t.failed(err.Error())
					_ = d.Nack(false, true)
					continue
				}
				if err := d.Ack(false); err != nil {
					t.failed("ack: " + err.Error())
					continue
				}
				t.settled(d.MessageId, time.Now())
			}
		}()
	}
	return p, nil
}

// stop cancels the consumer; the deliveries channel then closes, the
// workers finish what they hold and exit.
func (p *plain) stop(ctx context.Context) error {
	err := p.ch.Cancel(p.tag, false)
	done := make(chan struct{})
	go func() { p.workers.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		err = errors.Join(err, fmt.Errorf("bare consumer: workers still busy: %w", ctx.Err()))
	}
	return errors.Join(err, p.conn.Close())
}

// noop is the bare variant's handler: nothing.
func noop(context.Context, *amqp.Delivery) error { return nil }

// naiveHandle is the seeds' approach: SET key NX (with a TTL), run the
// handler, SET key done. Two round trips per message, no lease kept, no
// fencing, no stored result. A key already set is a duplicate: acked
// without running.
func naiveHandle(rdb *redis.Client, prefix string, ttl, retention time.Duration) handleFunc {
	return func(ctx context.Context, d *amqp.Delivery) error {
		key := prefix + d.MessageId
		fresh, err := rdb.SetNX(ctx, key, "processing", ttl).Result()
		if err != nil {
			return fmt.Errorf("naive SET NX: %w", err)
		}
		if !fresh {
			return nil
		}
		if err := noop(ctx, d); err != nil {
			return err
		}
		if err := rdb.Set(ctx, key, "done", retention).Err(); err != nil {
			return fmt.Errorf("naive SET done: %w", err)
		}
		return nil
	}
}

// idem is an amqpidem.Consumer running in the background.
type idem struct {
	exit
	c *amqpidem.Consumer
}

// idemConfig is what varies between the harness's amqpidem consumers.
type idemConfig struct {
	url, queue, queueType string
	prefetch, concurrency int
	leaseTTL, retention   time.Duration
	handler               amqpidem.Handler
	// want is the outcome every message should have; the tally counts the
	// others as unexpected.
	want amqpidem.Outcome
	// steps, if set, times each delivery's steps (Tracer and Observer).
	steps *steps
	// batch, if set, is run by a batch consumer (NewBatchConsumer) with
	// batchSize, in place of handler; prefetch and concurrency are then
	// the batch consumer's defaults (four and two times batchSize)
	// when zero.
	batch     amqpidem.BatchHandler
	batchSize int
}

func startIdem(ctx context.Context, store lock.Store, cfg idemConfig, t *tally) (*idem, error) {
	obs := amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) {
		at := time.Now()
		if e.Outcome == cfg.want {
			t.settled(e.Key, at)
			return
		}
		reason := e.Outcome.String()
		if e.Reason != "" {
			reason += " (" + e.Reason + ")"
		}
		if e.Err != nil {
			reason += ": " + e.Err.Error()
		}
		t.failed(reason)
	})
	var observer amqpidem.Observer = obs
	var tracer amqpidem.Tracer
	if cfg.steps != nil {
		cfg.steps.inner = obs
		observer, tracer = cfg.steps, cfg.steps
	}
	if cfg.batch != nil {
		observer = batchCounter{Observer: observer, t: t}
	}
	ccfg := amqpidem.ConsumerConfig{
		Config: amqpidem.Config{
			Queue: cfg.queue,
			// One inbox for the round's queues: the duplicate variant
			// consumes another queue and replays what unique completed.
			// The store's prefix keeps rounds apart.
			Endpoint:  "bench",
			LeaseTTL:  cfg.leaseTTL,
			Retention: cfg.retention,
			Observer:  observer,
			Tracer:    tracer,
		},
		URL:         cfg.url,
		Prefetch:    cfg.prefetch,
		Concurrency: cfg.concurrency,
		QueueArgs:   queueArgs(cfg.queueType),
	}
	var c *amqpidem.Consumer
	var err error
	if cfg.batch != nil {
		ccfg.BatchSize = cfg.batchSize
		c, err = amqpidem.NewBatchConsumer(store, ccfg, cfg.batch)
	} else {
		c, err = amqpidem.NewConsumer(store, ccfg, cfg.handler)
	}
	if err != nil {
		return nil, err
	}
	i := &idem{exit: newExit(), c: c}
	go func() { i.set(c.Run(ctx)) }()
	return i, nil
}

func (i *idem) stop(ctx context.Context) error {
	err := i.c.Shutdown(ctx)
	select {
	case <-i.ended():
		if runErr := i.err(); !errors.Is(runErr, amqpidem.ErrConsumerClosed) {
			err = errors.Join(err, fmt.Errorf("amqpidem Run: %w", runErr))
		}
	case <-ctx.Done():
		err = errors.Join(err, fmt.Errorf("amqpidem Run did not return: %w", ctx.Err()))
	}
	return err
}

// batchCounter counts a batch consumer's batches in its tally.
type batchCounter struct {
	amqpidem.Observer
	t *tally
}

func (c batchCounter) ObserveBatch(_ context.Context, b amqpidem.BatchInfo) {
	c.t.batches.Add(1)
	c.t.batchMsgs.Add(int64(b.Size))
}

// noopBatchHandler is the batch variant's handler: nothing, no results.
var noopBatchHandler = amqpidem.BatchHandlerFunc(func(context.Context, []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
	return nil, nil
})

// noopHandler is the amqpidem variants' handler: nothing, no result.
var noopHandler = amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) {
	return nil, nil
})
