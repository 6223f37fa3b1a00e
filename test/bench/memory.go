package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// memoryResult is the memory phase: many long handlers in flight at once,
// each lease renewed by the heartbeat while it sleeps.
type memoryResult struct {
	QueueType string
	Handlers  int
	Sleep     time.Duration
	LeaseTTL  time.Duration

	InFlight int           // handlers running when sampled
	SampleAt time.Duration // after the first handler started

	GoroutinesBefore, GoroutinesAt, GoroutinesAfter int
	HeapBefore, HeapAt                              uint64 // HeapInuse after a GC, bytes

	Settled    int
	Unexpected int
	RoundTrips int64 // Redis round trips during the phase
}

// PerHandler is the goroutines added per in-flight handler.
func (m memoryResult) PerHandler() float64 {
	if m.InFlight == 0 {
		return 0
	}
	return float64(m.GoroutinesAt-m.GoroutinesBefore) / float64(m.InFlight)
}

func (e *env) memory(ctx context.Context, qt string) (res memoryResult, err error) {
	o := e.opts
	res = memoryResult{QueueType: qt, Handlers: o.MemHandlers, Sleep: o.MemSleep, LeaseTTL: o.MemLeaseTTL}
	ctx, cancel := context.WithTimeout(ctx, o.RunTimeout)
	defer cancel()
	prefix := fmt.Sprintf("%s-%s-mem", e.base, qt)
	queue := prefix
	if err := e.brk.declare(queue, qt); err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, e.brk.remove(queue)) }()
	if err := e.brk.prefill(ctx, queue, "mem-", o.MemHandlers, e.body); err != nil {
		return res, err
	}

	var inflight, firstStart atomic.Int64
	handler := amqpidem.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) ([]byte, error) {
		firstStart.CompareAndSwap(0, time.Now().UnixNano())
		inflight.Add(1)
		defer inflight.Add(-1)
		t := time.NewTimer(o.MemSleep)
		defer t.Stop()
		select {
		case <-t.C:
			return nil, nil
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	})
	store, err := lock.NewRedisStore(e.rdb, lock.Config{Prefix: prefix})
	if err != nil {
		return res, err
	}

	runtime.GC()
	res.GoroutinesBefore, res.HeapBefore = runtime.NumGoroutine(), heapInuse()
	rt0 := e.rts.n.Load()
	t := newTally(o.MemHandlers, nil)
	c, err := startIdem(ctx, store, idemConfig{
		url: o.AMQPURL, queue: queue, queueType: qt,
		prefetch: o.MemHandlers, concurrency: o.MemHandlers,
		leaseTTL: o.MemLeaseTTL, retention: retention,
		handler: handler, want: amqpidem.Completed,
	}, t)
	if err != nil {
		return res, err
	}
	defer func() {
		sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
		defer scancel()
		err = errors.Join(err, c.stop(sctx))
		runtime.GC()
		res.GoroutinesAfter = runtime.NumGoroutine()
		_, _ = deleteKeys(context.WithoutCancel(ctx), e.admin, prefix+"*")
	}()

	// Sample once every handler is in flight and the heartbeat has renewed
	// each lease at least once (the keeper renews about every TTL/3), but
	// before the first handler is done.
	if err := until(ctx, 30*time.Second, func() bool { return firstStart.Load() != 0 }); err != nil {
		return res, fmt.Errorf("no handler started: %w", err)
	}
	first := time.Unix(0, firstStart.Load())
	lastChance := first.Add(o.MemSleep - o.MemSleep/10)
	_ = until(ctx, time.Until(lastChance), func() bool { return inflight.Load() == int64(o.MemHandlers) })
	renewed := first.Add(min(o.MemLeaseTTL*4/3, o.MemSleep/2))
	if err := sleepCtx(ctx, time.Until(renewed)); err != nil {
		return res, err
	}
	runtime.GC()
	res.InFlight = int(inflight.Load())
	res.GoroutinesAt, res.HeapAt = runtime.NumGoroutine(), heapInuse()
	res.SampleAt = time.Since(first)
	if res.SampleAt >= o.MemSleep {
		return res, fmt.Errorf("sampled %v after the first handler started, not before it finished (%v)", res.SampleAt, o.MemSleep)
	}

	werr := t.wait(ctx, o.RunTimeout, c)
	res.RoundTrips = e.rts.n.Load() - rt0
	res.Settled, res.Unexpected = int(t.ok.Load()), int(t.bad.Load())
	if werr != nil {
		return res, werr
	}
	if res.Unexpected > 0 {
		return res, fmt.Errorf("%d unexpected outcomes (first: %s)", res.Unexpected, t.firstReason())
	}
	fmt.Fprintf(e.out, "memory  %-7s %d handlers in flight (of %d), sampled %v after the first started: %d goroutines (%d before), heap in use %.1f MB (%.1f before)\n",
		qt, res.InFlight, res.Handlers, res.SampleAt.Round(time.Millisecond), res.GoroutinesAt, res.GoroutinesBefore,
		mb(res.HeapAt), mb(res.HeapBefore))
	return res, nil
}

// until polls cond every 5 ms until it holds or timeout passes.
func until(ctx context.Context, timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if !time.Now().Before(deadline) {
			return fmt.Errorf("condition not met within %v", timeout)
		}
		if err := sleepCtx(ctx, 5*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

func heapInuse() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

func mb(b uint64) float64 { return float64(b) / (1 << 20) }
