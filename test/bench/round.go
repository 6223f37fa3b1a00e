package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/proccpu"
	"github.com/amqpidem/amqpidem/lock"
)

// n is the messages of each run of v on qt.
func (rep *report) n(qt string, v variant) int {
	switch {
	case v.isPG():
		return rep.NPG
	case v.isDynamo():
		return rep.NDynamo
	case v == outbox, v == publishV:
		return rep.NOutbox[qt]
	}
	return rep.N[qt]
}

// calibrate drains a run of v of calN messages and sizes N so that such a
// run lasts opts.Duration.
func (e *env) calibrate(ctx context.Context, qt string, v variant, calN int) (int, error) {
	r, err := e.throughput(ctx, qt, v, 0, calN, nil)
	if err != nil {
		return 0, err
	}
	n := int(r.Rate * e.opts.Duration.Seconds())
	if n > 10000 {
		n = (n + 500) / 1000 * 1000
	}
	n = min(max(n, e.opts.MinN), e.opts.MaxN)
	fmt.Fprintf(e.out, "calibration %-7s %-8s %9s msg/s over %d messages -> N = %d (%s run ~%v)\n",
		qt, v, thousands(r.Rate), r.N, n, v, e.opts.Duration)
	return n, nil
}

// deleteRound deletes the store records ("<prefix>:{...}") and naive keys
// ("<prefix>-naive:...") under a round's prefix.
func (e *env) deleteRound(ctx context.Context, prefix string) error {
	for _, pattern := range []string{prefix + ":*", prefix + "-naive:*"} {
		if _, err := deleteKeys(ctx, e.admin, pattern); err != nil {
			return fmt.Errorf("deleting %s: %w", pattern, err)
		}
	}
	return nil
}

// roundPrefix names a round's store records and naive keys.
func (e *env) roundPrefix(qt string, round int) string {
	return fmt.Sprintf("%s-%s-r%d", e.base, qt, round)
}

// throughput publishes n messages to a fresh queue, then drains it with
// variant v and measures. round 0 is a calibration or profiled run. With
// profile set, the consuming is CPU-profiled into that file.
func (e *env) throughput(ctx context.Context, qt string, v variant, round, n int, profile *string) (res runResult, err error) {
	res = runResult{QueueType: qt, Variant: v, Round: round, N: n}
	ctx, cancel := context.WithTimeout(ctx, e.opts.RunTimeout)
	defer cancel()

	prefix := e.roundPrefix(qt, round)
	if round == 0 {
		prefix += "-" + randomHex(2)
	}
	queue := prefix + "-" + string(v)
	if err := e.brk.declare(queue, qt); err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, e.brk.remove(queue)) }()

	// unique and duplicate share the round's ids and store prefix:
	// duplicate replays what unique completed; so do pg-unique and
	// pg-duplicate (in their own table).
	ids := string(v) + "-"
	switch v {
	case unique, duplicate:
		ids = "m-"
	case pgUnique, pgDuplicate:
		ids = "pg-m-"
	case dynamoUnique, dynamoDuplicate:
		ids = "dynamo-m-"
	}
	t0 := time.Now()
	if err := e.brk.prefill(ctx, queue, ids, n, e.body); err != nil {
		return res, err
	}
	res.Publish = time.Since(t0)

	// A PostgreSQL variant's pool and store, made (and every connection
	// opened) before measuring, closed after.
	var pr *pgRun
	if v.isPG() {
		if pr, err = e.pg.open(ctx, v, queue, prefix); err != nil {
			return res, err
		}
		defer func() {
			cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer ccancel()
			c, cerr := pr.close(cctx)
			res.PG = &c
			if cerr == nil {
				res.EffectRows, cerr = e.pg.effectRows(cctx, queue)
			}
			err = errors.Join(err, cerr)
		}()
		if v != pgDuplicate {
			res.Effects = n
		}
	}

	// A DynamoDB variant's store and effects table (dynamo.go).
	var dr *dynRun
	if v.isDynamo() {
		if e.dyn == nil {
			return res, fmt.Errorf("%s: DynamoDB variants skipped", v)
		}
		if dr, err = e.dyn.open(ctx, queue, prefix); err != nil {
			return res, err
		}
		defer func() {
			cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			defer ccancel()
			var cerr error
			res.EffectRows, cerr = dr.close(cctx)
			err = errors.Join(err, cerr)
		}()
		if v == dynamoUnique {
			res.Effects = n
		}
	}

	// outbox's handler stages to a queue of the run's own (outbox.go),
	// publish's publishes to one (publish.go).
	if v == outbox || v == publishV {
		s, err := e.openSink(ctx, qt, queue, n)
		if err != nil {
			return res, err
		}
		defer func() {
			cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 45*time.Second)
			defer ccancel()
			staged, serr := s.close(cctx)
			res.Staged = staged
			err = errors.Join(err, serr)
		}()
	}

	t := newTally(n, nil)
	// The broker's pid is looked up for each run: someone else's test
	// may restart the node between runs.
	broker := brokerPID(e.opts.AMQPURL)
	bcpu0, bok0 := pidCPU(broker)
	cpu0, rcpu0, mcpu0, pcpu0 := proccpu.Self(), redisCPU(ctx, e.admin), machineCPU(), e.pgCPU()
	allocs0, bytes0 := heapAllocs()
	rt0 := e.rts.n.Load()
	sr0, sw0 := selfSyscalls()
	if profile != nil {
		f, err := os.Create(*profile)
		if err != nil {
			return res, err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return res, err
		}
		defer pprof.StopCPUProfile()
		// And its allocations: see writeAllocs.
		defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
		runtime.MemProfileRate = allocsSampleRate
		if err := writeAllocs(*profile + ".allocs-base"); err != nil {
			return res, err
		}
	}
	// The profiled run also times each delivery's steps.
	var st *steps
	if profile != nil {
		st = &steps{}
		defer func() {
			if r := st.result(qt, v); r.N > 0 {
				res.Steps = r
			}
		}()
	}
	var c consumer
	if v.isDynamo() {
		c, err = e.startDynamo(ctx, v, dr, queue, t)
	} else {
		c, err = e.start(ctx, qt, v, queue, prefix, pr, t, st)
	}
	if err != nil {
		return res, err
	}
	werr := t.wait(ctx, e.opts.RunTimeout, c)
	res.Batches, res.BatchMsgs = t.batches.Load(), t.batchMsgs.Load()
	res.RoundTrips = e.rts.n.Load() - rt0
	sr1, sw1 := selfSyscalls()
	res.Reads, res.Writes = sr1-sr0, sw1-sw0
	res.ClientCPU, res.RedisCPU = proccpu.Self()-cpu0, redisCPU(ctx, e.admin)-rcpu0
	allocs1, bytes1 := heapAllocs()
	res.ClientAllocs, res.ClientBytes = allocs1-allocs0, bytes1-bytes0
	res.MachineCPU, res.PGCPU = machineCPU()-mcpu0, e.pgCPU()-pcpu0
	// Measured only when the node was read at both ends, the same
	// process (not restarted meanwhile: its CPU would start again).
	// A short run may see no tick (10 ms) of the node's CPU: measured
	// as 0, not unmeasured.
	if bcpu1, bok1 := pidCPU(broker); bok0 && bok1 && bcpu1 >= bcpu0 && brokerPID(e.opts.AMQPURL) == broker {
		res.BrokerCPU = bcpu1 - bcpu0
		res.ProcCPU = res.ClientCPU + res.RedisCPU + res.BrokerCPU
		if v.isPG() {
			res.ProcCPU += res.PGCPU
		}
	}
	if profile != nil {
		pprof.StopCPUProfile()
		if err := writeAllocs(*profile + ".allocs"); err != nil {
			return res, err
		}
	}
	sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer scancel()
	serr := c.stop(sctx)

	res.Settled, res.Unexpected, res.FirstUnexpected = int(t.ok.Load()), int(t.bad.Load()), t.firstReason()
	if werr == nil {
		res.Span = t.span()
		if res.Span > 0 {
			res.Rate = float64(n-1) / res.Span.Seconds()
		}
	}
	err = errors.Join(werr, serr)
	if round == 0 {
		err = errors.Join(err, e.deleteRound(context.WithoutCancel(ctx), prefix))
	}
	return res, err
}

// start starts variant v's consumer on queue. prefix names its Redis keys
// (or pgstore records, or pg-naive keys); pr is a PostgreSQL variant's
// pool; st, if set, times the steps of an amqpidem consumer on Redis or
// MemoryStore.
func (e *env) start(ctx context.Context, qt string, v variant, queue, prefix string, pr *pgRun, t *tally, st *steps) (consumer, error) {
	if v.isPG() {
		return e.startPG(ctx, v, pr, queue, prefix, t)
	}
	switch v {
	case bare:
		return startPlain(ctx, e.opts.AMQPURL, queue, e.opts.Prefetch, e.opts.Concurrency, noop, t)
	case naive:
		return startPlain(ctx, e.opts.AMQPURL, queue, e.opts.Prefetch, e.opts.Concurrency,
			naiveHandle(e.rdb, prefix+"-naive:", leaseTTL, retention), t)
	}
	var store lock.Store
	var err error
	switch v {
	case memstore:
		store, err = lock.NewMemoryStore(lock.Config{Prefix: prefix})
	case uniqueWait:
		store, err = lock.NewRedisStore(e.rdb, lock.Config{Prefix: prefix, Replicas: 1})
	default:
		store, err = lock.NewRedisStore(e.rdb, lock.Config{Prefix: prefix})
	}
	if err != nil {
		return nil, err
	}
	want := amqpidem.Completed
	if v == duplicate {
		want = amqpidem.Duplicate
	}
	if v == batchV {
		return startIdem(ctx, store, idemConfig{
			url: e.opts.AMQPURL, queue: queue, queueType: qt,
			leaseTTL: leaseTTL, retention: retention, want: want,
			batch: noopBatchHandler, batchSize: pgBatchSize,
		}, t)
	}
	var handler amqpidem.Handler = noopHandler
	if v == outbox {
		handler = stagingHandler(outboxSink(queue))
	}
	cfg := idemConfig{
		url: e.opts.AMQPURL, queue: queue, queueType: qt,
		prefetch: e.opts.Prefetch, concurrency: e.opts.Concurrency,
		leaseTTL: leaseTTL, retention: retention,
		handler: handler, want: want, steps: st,
	}
	if v == publishV {
		return e.startPublishing(ctx, store, cfg, t)
	}
	return startIdem(ctx, store, cfg, t)
}

// roundOrder is the order in which round (from 1) runs n units: it starts
// at unit round-1 and steps by the round's step, the round-th number
// coprime with n (1, 2, 3 for 7 units; 1, 3, 5 for 8), cycling. Round 1
// runs them in the tables' order. Each unit leads one round in n, and
// follows a different unit in each round for as many rounds as there are
// such steps (6 for 7 units, 4 for 8; 1 for 2 units, which can only
// alternate): with a plain rotation (a step of 1 in every round) a unit
// always ran after the same one, and took the aftermath of that one's run
// in every round.
func roundOrder(n, round int) []int {
	var steps []int
	for s := 1; s < n; s++ {
		if gcd(s, n) == 1 {
			steps = append(steps, s)
		}
	}
	step := 1
	if len(steps) > 0 {
		step = steps[(round-1)%len(steps)]
	}
	order := make([]int, n)
	for k := range order {
		order[k] = (round - 1 + k*step) % n
	}
	return order
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

// units are the groups of variants of a round on queue type qt, in the
// order of the first round; a group runs in its order (a duplicate after
// the unique run it replays).
func (e *env) units(qt string) [][]variant {
	all := [][]variant{{bare}, {unique, duplicate}, {outbox}, {publishV}, {naive}, {memstore}, {batchV}}
	if e.replica != nil {
		all = append(all, []variant{uniqueWait})
	}
	if e.pg != nil && qt == "classic" {
		all = append(all, []variant{pgUnique, pgDuplicate}, []variant{pgNaive}, []variant{pgBatch})
	}
	if e.dyn != nil && qt == "classic" {
		all = append(all, []variant{dynamoUnique, dynamoDuplicate})
	}
	var u [][]variant
	for _, group := range all {
		var g []variant
		for _, v := range group {
			if e.opts.measures(v) {
				g = append(g, v)
			}
		}
		if len(g) > 0 {
			u = append(u, g)
		}
	}
	return u
}
