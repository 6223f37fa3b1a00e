package worker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
	"github.com/amqpidem/amqpidem/test/linearizable"
)

// EffectsTable is the pg mode's side-effect sink: one row per execution
// that inserted it, in the handler's transaction, with no unique key. It
// is deliberately not idempotent: an effect that took place twice is two
// rows. Only the transaction (the effect and the completed record commit
// together or not at all) keeps it to one row per operation.
const EffectsTable = "pg_effects"

// EffectsDDL creates EffectsTable in the search_path's schema.
const EffectsDDL = `CREATE TABLE ` + EffectsTable + ` (
	seq      bigserial PRIMARY KEY,
	op_id    text NOT NULL,
	exec_id  text NOT NULL,
	fence    bigint NOT NULL,
	consumer text NOT NULL,
	at       timestamptz NOT NULL DEFAULT clock_timestamp()
)`

// StoreConfig is the pgstore configuration of a pg-mode worker with the
// given key prefix and schema; a test makes the same one to Migrate and to
// read the records.
func StoreConfig(prefix, schema string, leaseTTL time.Duration) pgstore.Config {
	return pgstore.Config{
		Config:          lock.Config{Prefix: prefix, LeaseTTL: leaseTTL},
		Schema:          schema,
		CleanupInterval: -1, // a run lasts minutes; nothing expires
	}
}

// openPG connects the pgstore pool (application_name StoreAppName,
// search_path Schema) and makes the store and the transactional handler.
// The returned function closes both.
func (w *Worker) openPG(ctx context.Context) (lock.Store, amqpidem.Handler, func(), error) {
	cfg := w.cfg
	pcfg, err := pgxpool.ParseConfig(cfg.StoreDSN)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("worker: store DSN: %w", err)
	}
	// Every running handler holds a connection for its transaction; the
	// keeper and the Acquires of new deliveries need more besides.
	handlers := cfg.Concurrency
	if handlers == 0 {
		handlers = cmp.Or(cfg.Prefetch, amqpidem.DefaultPrefetch)
	}
	pcfg.MaxConns = int32(handlers + 4)
	pcfg.ConnConfig.ConnectTimeout = 2 * time.Second
	app := cfg.StoreAppName
	if app == "" {
		app = cfg.Name + "-store"
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = app
	pcfg.ConnConfig.RuntimeParams["search_path"] = cfg.Schema
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("worker: store pool: %w", err)
	}
	scfg := StoreConfig(cfg.Prefix, cfg.Schema, cfg.StoreLeaseTTL)
	scfg.Logger = cfg.Logger
	scfg.RowLeases = cfg.RowLeases
	ps, err := pgstore.New(pool, scfg)
	if err != nil {
		pool.Close()
		return nil, nil, nil, err
	}
	fn := w.handleTx
	if w.staging() {
		fn = w.handleTxStage
	}
	c, ok := ps.TxHandler(fn).(amqpidem.Completer)
	if !ok {
		ps.Close()
		pool.Close()
		return nil, nil, nil, errors.New("worker: pgstore's TxHandler is not an amqpidem.Completer")
	}
	rec, err := w.recorded(ps)
	if err != nil {
		ps.Close()
		pool.Close()
		return nil, nil, nil, err
	}
	w.pgStore, w.pgPool = ps, pool
	st := &store{Store: rec, w: w}
	closeAll := func() {
		ps.Close()
		pool.Close()
	}
	return st, &txCompleter{Completer: c, store: st, w: w}, closeAll, nil
}

// handleTx is the pg mode's handler, run by pgstore in the transaction
// that also completes the record: it logs its execution in the ledger (in
// autocommit, outside the transaction, so that an execution that rolls
// back is still counted), follows the message's plan, and inserts its
// effect in tx.
func (w *Worker) handleTx(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
	info, op, plan, execID, err := w.start(ctx, d)
	if err != nil {
		return nil, err
	}
	// How the execution ended is logged by txCompleter, once pgstore has
	// committed or rolled back.

	if plan.Crash == workload.BeforeEffect {
		w.crash(op, plan.Crash, execID, info.Fence)
	}
	if err := sleep(ctx, plan.Work(info.Attempt)); err != nil {
		w.cancelled(ctx, execID)
		return nil, err
	}
	switch {
	case plan.Permanent:
		return nil, amqpidem.Permanent(fmt.Errorf("chaos: %s fails for good", op))
	case plan.AlwaysFail || info.Attempt < plan.FailUntil:
		return nil, fmt.Errorf("chaos: %s fails at attempt %d", op, info.Attempt)
	}
	if ctx.Err() != nil {
		w.cancelled(ctx, execID)
		return nil, context.Cause(ctx)
	}
	// The effect: a plain insert, once per execution, no unique key.
	if _, err := tx.Exec(ctx, `INSERT INTO `+EffectsTable+` (op_id, exec_id, fence, consumer) VALUES ($1, $2, $3, $4)`,
		op, execID, info.Fence, w.cfg.Name); err != nil {
		return nil, err
	}
	w.markInserted(info.Key, info.Fence)
	if plan.Stall && w.firstExecution(op, execID, info.Attempt) {
		w.stallUntilCompleted(ctx, op, execID, plan)
	}
	if plan.Crash == workload.InTx {
		w.crash(op, plan.Crash, execID, info.Fence)
	}
	return make([]byte, plan.ResultBytes), nil
}

// firstExecution reports whether execID is the first execution of op,
// the one a Stall plan makes a stale holder: by the ledger, since a lease
// held by a transaction that the server ended counted no attempt, so the
// execution taking over may be attempt 1 too; by attempt if the ledger
// does not answer.
func (w *Worker) firstExecution(op, execID string, attempt int) bool {
	lctx, cancel := ledgerCtx()
	defer cancel()
	first, err := w.led.FirstExecution(lctx, op, execID)
	if err != nil {
		return attempt == 1
	}
	return first
}

// stallUntilCompleted is a stale holder (with its transaction open, in pg
// mode; with its message staged, in stage A): it waits, ignoring its
// context, until another execution has completed op (or StallMS passes),
// gives its context a moment to be cancelled, and records whether it was.
// Its handler then returns success, leaving the store to complete the
// record, which must fail: the record has another owner.
func (w *Worker) stallUntilCompleted(ctx context.Context, op, execID string, plan workload.Plan) {
	limit := time.Now().Add(time.Duration(max(plan.StallMS, 1000)) * time.Millisecond)
	for time.Now().Before(limit) {
		lctx, cancel := ledgerCtx()
		n, err := w.led.Completions(lctx, op)
		cancel()
		if err == nil && n > 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	t := time.NewTimer(5 * time.Second)
	select {
	case <-ctx.Done():
	case <-t.C:
	}
	t.Stop()
	w.cancelled(ctx, execID)
}

// markInserted notes that the lease's execution inserted its effect.
func (w *Worker) markInserted(key string, fence int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if li := w.leases[leaseID{key, fence}]; li != nil {
		li.plan.inserted = true
	}
}

// txCompleter wraps pgstore's Completer: once HandleComplete returned, it
// logs how the execution ended (committed, or why not), logs a completion
// in the ledger when it committed, and takes the AfterCommit crash and
// stop windows there (committed, not acked; on stage A, not published
// either). Its CompleterStore is the worker's store wrapper, the store the
// Consumer is given.
type txCompleter struct {
	amqpidem.Completer
	store lock.Store
	w     *Worker
}

func (c *txCompleter) CompleterStore() lock.Store { return c.store }

// AcquireLease takes the lease as the wrapped Completer does when it is an
// amqpidem.LeaseTaker (pgstore's lease held by the transaction), tracked
// as the store wrapper's Acquire tracks its leases; else through the
// store wrapper.
func (c *txCompleter) AcquireLease(ctx context.Context, req lock.Request, d *amqp.Delivery) (lock.Result, error) {
	t, ok := c.Completer.(amqpidem.LeaseTaker)
	if !ok {
		return c.store.Acquire(ctx, req)
	}
	at := time.Now()
	acquire := func(ctx context.Context, req lock.Request) (lock.Result, error) { return t.AcquireLease(ctx, req, d) }
	var res lock.Result
	var err error
	if c.w.rec != nil {
		res, err = c.w.rec.AcquireBy(ctx, req, acquire)
	} else {
		res, err = acquire(ctx, req)
	}
	if err == nil && res.Status == lock.Acquired {
		c.w.track(messageKey(req.Key), res.Lease.Fence, at)
	}
	return res, err
}

func (c *txCompleter) HandleComplete(ctx context.Context, d *amqp.Delivery, lease lock.Lease,
	value func([]byte) ([]byte, error)) ([]byte, error) {
	var end func(error) // the history's Complete, once the handler succeeded
	if c.w.rec != nil {
		inner := value
		value = func(result []byte) ([]byte, error) {
			v, err := inner(result)
			if err == nil && end == nil {
				end = c.w.rec.Begin(linearizable.KindComplete, lease, string(v))
			}
			return v, err
		}
	}
	res, err := c.Completer.HandleComplete(ctx, d, lease, value)
	if end != nil {
		end(err)
	}
	done := time.Now()
	key := messageKey(lease.Key)
	p := c.w.lookup(key, lease.Fence)
	if err != nil || !c.w.staging() { // a stage A worker's Amend still needs it
		defer c.w.untrack(key, lease.Fence)
	}
	lctx, cancel := ledgerCtx()
	defer cancel()
	if p.execID != "" { // the handler ran
		if lerr := c.w.led.Finish(lctx, p.execID, TxResult(err, p.inserted)); lerr != nil {
			c.w.cfg.Logger.Error("chaos: execution end not logged", "exec", p.execID, "error", lerr)
		}
	}
	if err != nil {
		return res, err
	}
	op := cmp.Or(p.op, ledger.OpID(key))
	for try := 0; ; try++ {
		lerr := c.w.led.Completed(lctx, op, lease.Fence, c.w.cfg.Name, c.w.pid, done)
		if lerr == nil {
			break
		}
		if try == 20 || lctx.Err() != nil {
			c.w.cfg.Logger.Error("chaos: completion not logged", "op", op, "fence", lease.Fence, "error", lerr)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if p.crash == workload.AfterCommit {
		c.w.crash(p.op, p.crash, p.execID, lease.Fence)
	}
	if p.stop == workload.AfterCommit {
		c.w.stopSelf(p.op, p.stop, p.execID, lease.Fence)
	}
	return res, nil
}

// TxResult is how a pg-mode execution ended, as logged in the ledger's
// executions.result: "committed", or "failed <stage> <kind>: <error>"
// where stage is "after-effect" when the effect had been inserted in the
// transaction and "before-effect" otherwise, and kind is "lease-lost"
// (lock.ErrLeaseLost: the compare-and-set on owner and fence refused),
// "unavailable" (lock.ErrUnavailable: not committed, or the commit's
// outcome unknown), "cancelled" (a context error) or "error".
func TxResult(err error, inserted bool) string {
	if err == nil {
		return "committed"
	}
	stage := "before-effect"
	if inserted {
		stage = "after-effect"
	}
	kind := "error"
	switch {
	case errors.Is(err, lock.ErrLeaseLost):
		kind = "lease-lost"
	case errors.Is(err, lock.ErrUnavailable):
		kind = "unavailable"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		kind = "cancelled"
	}
	return fmt.Sprintf("failed %s %s: %v", stage, kind, err)
}
