package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/pgstore"
)

// The relay phase (issue 24): pgstore's producer outbox, in the run's
// PostgreSQL schema (pgstore.Migrate made its table), and one
// pgstore.Relay in this process publishing it to a classic queue of the
// run's own, drained by a bare consumer (manual acks, the bench's
// prefetch and workers). Two figures:
//
//	relay_msgs_per_s classic X
//
// the relay's rate from a full table: -relay-n rows are written first
// (transactions of relayWriteBatch rows, not measured), then the relay
// starts; the rate is the rows over the time from its start until every
// row is both marked sent in the table (after the broker's confirm) and
// received by the consumer. The median of -repeats runs.
//
//	relay_p99_ms classic X
//
// the latency of a row at a steady 1,000 rows/s: writers commit one row
// per transaction, paced at -relay-rate for -latency-duration, while the
// relay runs; each row's latency is from the moment its COMMIT returned
// in the writer to the moment the consumer received its message (the
// broker's confirm to the relay is not observable outside the relay; the
// delivery comes after the broker took the message, so this is the
// commit-to-consumer latency, confirm included or overtaken). The first
// -latency-warmup is left out. " saturated" ends the line when the
// writers fell behind the pace (the last commit came more than a tenth of
// the run late): the figure is then queueing in the writers.

//	relay_ordered_drain_ms 1000 X
//
// the time, in ms, for an ordered relay (RelayConfig.Ordered, the other
// settings the defaults) to drain a backlog of -relay-ordered-n messages
// of ONE order key (issue 34): the rows are written first, one per
// transaction (not measured), then the relay starts; X is from its start
// until every row is both marked sent and received by the consumer. The
// run gives up after -relay-ordered-timeout: the line then ends in
// "timeout" instead of a figure (the report says how many rows were sent
// by then). The consumer also checks that the messages arrived in the
// order they were written (the report's "out of order": first deliveries
// of a message written before one already received).

// relayWriteBatch is the rows per transaction of the rate run's writes.
const relayWriteBatch = 500

// relayLatencyWriters is how many writers commit the latency run's rows
// at once: one row per transaction, each commit waiting for its WAL flush.
// With 8, at a load average of 10 on two cores, they fell 0.9 s behind a
// 1,000 rows/s pace in 5 s.
const relayLatencyWriters = 16

// relayRun is one rate run of the relay.
type relayRun struct {
	N     int
	Write time.Duration // writing the rows up front
	// Sent is from the relay's start until every row was marked sent,
	// Consumed until every message was received; Span is the later.
	Sent, Consumed, Span time.Duration
	Rate                 float64 // N / Span
}

// relayLatency is the latency run.
type relayLatency struct {
	Rate     float64 // offered, rows/s
	N        int     // rows committed
	Samples  int     // rows after the warm-up
	P50, P99 time.Duration
	Max      time.Duration
	// Late is how late the last commit was against the pace.
	Late     time.Duration
	Duration time.Duration
}

func (l relayLatency) saturated() bool { return l.Late > l.Duration/10 }

// relayOrderedDrain is the ordered drain run.
type relayOrderedDrain struct {
	N       int
	Timeout time.Duration
	Write   time.Duration // writing the rows up front
	// Sent is from the relay's start until every row was marked sent,
	// Consumed until every message was received; Span is the later.
	Sent, Consumed, Span time.Duration
	// TimedOut says the rows were not all sent and received within
	// Timeout; SentRows and Received are how many were by then.
	TimedOut           bool
	SentRows, Received int
	// OutOfOrder counts first deliveries of a message written before one
	// already delivered.
	OutOfOrder int
}

// relayBench is the outbox and queue of a relay run.
type relayBench struct {
	e     *env
	pool  *pgxpool.Pool
	ob    *pgstore.Outbox
	table string // quoted
	queue string
}

// openRelay makes the relay phase's pool, outbox and queue.
func (e *env) openRelay(ctx context.Context, suffix string) (*relayBench, error) {
	cfg, err := pgConfig(e.opts, e.base+"-relay-writers")
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = relayLatencyWriters + 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL pool: %w", err)
	}
	scfg := e.pg.storeConfig("")
	ob, err := pgstore.NewOutbox(pool, scfg)
	if err != nil {
		pool.Close()
		return nil, err
	}
	r := &relayBench{e: e, pool: pool, ob: ob, queue: e.base + "-relay-" + suffix,
		table: pgx.Identifier{e.pg.schema, pgstore.DefaultOutboxTable}.Sanitize()}
	if err := e.brk.declare(r.queue, "classic"); err != nil {
		pool.Close()
		return nil, err
	}
	if _, err := e.pg.admin.Exec(ctx, "TRUNCATE "+r.table); err != nil {
		pool.Close()
		return nil, errors.Join(fmt.Errorf("PostgreSQL: truncate outbox: %w", err), e.brk.remove(r.queue))
	}
	return r, nil
}

func (r *relayBench) close() error {
	r.pool.Close()
	return r.e.brk.remove(r.queue)
}

// message is the outbox message of row id.
func (r *relayBench) message(id string) pgstore.Message {
	return pgstore.Message{RoutingKey: r.queue, Publishing: amqp.Publishing{
		MessageId: id, ContentType: "application/octet-stream", Body: r.e.body}}
}

// startRelay runs a pgstore.Relay on the outbox until the returned stop;
// ordered sets RelayConfig.Ordered.
func (r *relayBench) startRelay(ctx context.Context, ordered bool) (stop func(context.Context) error, err error) {
	rl, err := pgstore.NewRelay(r.ob, pgstore.RelayConfig{URL: r.e.opts.AMQPURL, Name: r.e.base + "-relay", Ordered: ordered})
	if err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- rl.Run(context.WithoutCancel(ctx)) }()
	return func(ctx context.Context) error {
		serr := rl.Shutdown(ctx)
		return errors.Join(serr, <-done)
	}, nil
}

// pending is how many rows are not marked sent yet.
func (r *relayBench) pending(ctx context.Context) (int, error) {
	var n int
	err := r.e.pg.admin.QueryRow(ctx, "SELECT count(*) FROM "+r.table+" WHERE state = 'p'").Scan(&n)
	return n, err
}

// relayRate is one rate run of n rows.
func (e *env) relayRate(ctx context.Context, round, n int) (res relayRun, err error) {
	res.N = n
	r, err := e.openRelay(ctx, "rate-"+strconv.Itoa(round))
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, r.close()) }()

	start := time.Now()
	for i := 0; i < n; i += relayWriteBatch {
		err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
			for j := i; j < min(i+relayWriteBatch, n); j++ {
				if _, err := r.ob.Write(ctx, tx, r.message(fmt.Sprintf("%s-%d", r.queue, j))); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return res, fmt.Errorf("writing the outbox: %w", err)
		}
	}
	res.Write = time.Since(start)

	var received atomic.Int64
	var consumedAt atomic.Int64
	t := newTally(n, nil)
	c, err := startPlain(ctx, e.opts.AMQPURL, r.queue, e.opts.Prefetch, e.opts.Concurrency,
		func(context.Context, *amqp.Delivery) error {
			if received.Add(1) == int64(n) {
				consumedAt.Store(time.Now().UnixNano())
			}
			return nil
		}, t)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, c.stop(context.WithoutCancel(ctx))) }()

	start = time.Now()
	stop, err := r.startRelay(ctx, false)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, stop(context.WithoutCancel(ctx))) }()
	deadline := start.Add(e.opts.RunTimeout)
	for res.Sent == 0 {
		p, err := r.pending(ctx)
		if err != nil {
			return res, err
		}
		if p == 0 {
			res.Sent = time.Since(start)
			break
		}
		if time.Now().After(deadline) {
			return res, fmt.Errorf("relay: %d of %d rows still pending after %v", p, n, e.opts.RunTimeout)
		}
		if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
			return res, err
		}
	}
	if err := t.wait(ctx, time.Until(deadline), c); err != nil {
		return res, fmt.Errorf("relay's consumer: %w", err)
	}
	res.Consumed = time.Duration(consumedAt.Load() - start.UnixNano())
	res.Span = max(res.Sent, res.Consumed)
	if res.Span > 0 {
		res.Rate = float64(n) / res.Span.Seconds()
	}
	if got := received.Load(); got != int64(n) {
		return res, fmt.Errorf("relay: the consumer received %d messages, want %d", got, n)
	}
	return res, nil
}

// relayOrderedRun writes n messages of one order key, one per
// transaction, then measures how long an ordered relay takes to publish
// them all, giving up after timeout.
func (e *env) relayOrderedRun(ctx context.Context, n int, timeout time.Duration) (res relayOrderedDrain, err error) {
	res.N, res.Timeout = n, timeout
	r, err := e.openRelay(ctx, "ordered")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, r.close()) }()

	start := time.Now()
	for i := range n {
		err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
			m := r.message(fmt.Sprintf("%s-%d", r.queue, i))
			m.OrderKey = "bench-key"
			_, err := r.ob.Write(ctx, tx, m)
			return err
		})
		if err != nil {
			return res, fmt.Errorf("writing the outbox: %w", err)
		}
	}
	res.Write = time.Since(start)

	// Deliveries of the one channel, by delivery tag: the queue's order,
	// whichever worker handles them.
	var mu sync.Mutex
	byTag := map[uint64]int{}
	var consumedAt atomic.Int64
	t := newTally(n, nil)
	c, err := startPlain(ctx, e.opts.AMQPURL, r.queue, e.opts.Prefetch, e.opts.Concurrency,
		func(_ context.Context, m *amqp.Delivery) error {
			num, ok := strings.CutPrefix(m.MessageId, r.queue+"-")
			i, err := strconv.Atoi(num)
			if !ok || err != nil || i < 0 || i >= n {
				return fmt.Errorf("unexpected message id %q", m.MessageId)
			}
			mu.Lock()
			byTag[m.DeliveryTag] = i
			if len(byTag) == n {
				consumedAt.Store(time.Now().UnixNano())
			}
			mu.Unlock()
			return nil
		}, t)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, c.stop(context.WithoutCancel(ctx))) }()

	start = time.Now()
	stop, err := r.startRelay(ctx, true)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, stop(context.WithoutCancel(ctx))) }()
	deadline := start.Add(timeout)
	for res.Sent == 0 {
		p, err := r.pending(ctx)
		if err != nil {
			return res, err
		}
		res.SentRows = n - p
		if p == 0 {
			res.Sent = time.Since(start)
			break
		}
		if time.Now().After(deadline) {
			res.TimedOut = true
			break
		}
		if err := sleepCtx(ctx, 10*time.Millisecond); err != nil {
			return res, err
		}
	}
	if !res.TimedOut {
		if werr := t.wait(ctx, max(time.Until(deadline), time.Second), c); werr != nil {
			if ctx.Err() != nil {
				return res, werr
			}
			res.TimedOut = true
		}
	}
	mu.Lock()
	defer mu.Unlock()
	res.Received = len(byTag)
	tags := make([]uint64, 0, len(byTag))
	for tag := range byTag {
		tags = append(tags, tag)
	}
	slices.Sort(tags)
	seen, highest := map[int]bool{}, -1
	for _, tag := range tags {
		i := byTag[tag]
		if seen[i] {
			continue // a copy
		}
		seen[i] = true
		if i < highest {
			res.OutOfOrder++
		}
		highest = max(highest, i)
	}
	if res.TimedOut {
		return res, nil
	}
	res.Consumed = time.Duration(consumedAt.Load() - start.UnixNano())
	res.Span = max(res.Sent, res.Consumed)
	return res, nil
}

// relayLatencyRun commits rows at rate for d while a relay publishes them
// and a consumer receives them.
func (e *env) relayLatencyRun(ctx context.Context, rate float64, d, warmup time.Duration) (res relayLatency, err error) {
	res.Rate, res.Duration = rate, d
	r, err := e.openRelay(ctx, "latency")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, r.close()) }()

	n := int(rate * d.Seconds())
	committed := make([]time.Time, n) // by row
	receivedAt := make([]time.Time, n)
	var mu sync.Mutex
	var received atomic.Int64
	t := newTally(n, nil)
	c, err := startPlain(ctx, e.opts.AMQPURL, r.queue, e.opts.Prefetch, e.opts.Concurrency,
		func(_ context.Context, m *amqp.Delivery) error {
			at := time.Now()
			num, ok := strings.CutPrefix(m.MessageId, r.queue+"-")
			i, err := strconv.Atoi(num)
			if !ok || err != nil || i < 0 || i >= n {
				return fmt.Errorf("unexpected message id %q", m.MessageId)
			}
			mu.Lock()
			if receivedAt[i].IsZero() {
				receivedAt[i] = at
				received.Add(1)
			}
			mu.Unlock()
			return nil
		}, t)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, c.stop(context.WithoutCancel(ctx))) }()
	stop, err := r.startRelay(ctx, false)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, stop(context.WithoutCancel(ctx))) }()
	// Every writer's connection is made before the pace starts.
	conns := make([]*pgxpool.Conn, 0, relayLatencyWriters)
	for range relayLatencyWriters {
		c, err := r.pool.Acquire(ctx)
		if err != nil {
			return res, fmt.Errorf("PostgreSQL: %w", err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	time.Sleep(200 * time.Millisecond) // the relay listening

	// Row i is due at start + i/rate; each writer takes the next row,
	// waits for its time and commits it alone.
	start := time.Now()
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, relayLatencyWriters)
	var lastLate atomic.Int64
	for w := range relayLatencyWriters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				due := start.Add(time.Duration(float64(i) / rate * float64(time.Second)))
				if err := sleepCtx(ctx, time.Until(due)); err != nil {
					errs[w] = err
					return
				}
				id := fmt.Sprintf("%s-%d", r.queue, i)
				err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
					_, err := r.ob.Write(ctx, tx, r.message(id))
					return err
				})
				at := time.Now()
				if err != nil {
					errs[w] = fmt.Errorf("writing row %d: %w", i, err)
					return
				}
				mu.Lock()
				committed[i] = at
				mu.Unlock()
				if i == n-1 {
					lastLate.Store(int64(at.Sub(due)))
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return res, err
	}
	res.N, res.Late = n, time.Duration(lastLate.Load())
	if err := t.wait(ctx, e.opts.RunTimeout, c); err != nil {
		return res, fmt.Errorf("relay's consumer: %w", err)
	}
	mu.Lock()
	defer mu.Unlock()
	var lat []time.Duration
	for i := range n {
		if committed[i].Before(start.Add(warmup)) {
			continue
		}
		// A message may arrive before its writer has noted the commit
		// time (the relay is woken by the commit): 0, not negative.
		lat = append(lat, max(receivedAt[i].Sub(committed[i]), 0))
	}
	slices.Sort(lat)
	res.Samples = len(lat)
	if len(lat) > 0 {
		res.P50, res.P99, res.Max = percentile(lat, 0.50), percentile(lat, 0.99), lat[len(lat)-1]
	}
	return res, nil
}
