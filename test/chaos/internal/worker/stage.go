package worker

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Stage A of a two-stage pipeline (Config.StageTo): the handler does the
// plan's work and stages exactly one message per execution for stage B
// (amqpidem.Stage), whose body is the plan's Next with the operation id
// and the staging execution (workload.Origin). It writes no ledger effect:
// stage B does, once per operation. The store keeps the staged message
// with the outcome (Redis: in the completed record; pg mode: in pgstore's
// transaction) and amqpidem publishes it, confirmed, before the ack.
//
// The plan's failures (FailUntil, AlwaysFail, Permanent) come after the
// staging: a failed execution's staged message must never be published.
// Its Stall stages, then waits as a stale holder (stallUntilCompleted) and
// returns success: the store must refuse its completion, and with it the
// message.

// handleStage is stage A's handler on the Redis store.
func (w *Worker) handleStage(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
	info, op, plan, execID, err := w.start(ctx, d)
	if err != nil {
		return nil, err
	}
	result := "error"
	defer func() {
		lctx, cancel := ledgerCtx()
		defer cancel()
		_ = w.led.Finish(lctx, execID, result)
	}()
	out, res, err := w.stageWork(ctx, info, op, execID, plan)
	result = out
	return res, err
}

// handleTxStage is stage A's handler in pg mode, run by pgstore in the
// transaction that completes the record: the staged message is stored in
// that transaction (Stage with the handler's ctx). How it ended is logged
// by txCompleter.
func (w *Worker) handleTxStage(ctx context.Context, _ pgx.Tx, d *amqp.Delivery) ([]byte, error) {
	info, op, plan, execID, err := w.start(ctx, d)
	if err != nil {
		return nil, err
	}
	_, res, err := w.stageWork(ctx, info, op, execID, plan)
	return res, err
}

// stageWork is stage A's work: the plan's work (honouring ctx), the
// staging, the plan's stall or failure. It returns how the execution ended,
// for the ledger, and the handler's result and error.
func (w *Worker) stageWork(ctx context.Context, info amqpidem.Info, op, execID string, plan workload.Plan) (string, []byte, error) {
	if plan.Crash == workload.BeforeEffect {
		w.crash(op, plan.Crash, execID, info.Fence)
	}
	if err := sleep(ctx, plan.Work(info.Attempt)); err != nil {
		w.cancelled(ctx, execID)
		return "cancelled", nil, err
	}
	if ctx.Err() != nil {
		w.cancelled(ctx, execID)
		return "cancelled", nil, context.Cause(ctx)
	}
	next := workload.Plan{}
	if plan.Next != nil {
		next = *plan.Next
	}
	next.Op = op
	next.Origin = &workload.Origin{Exec: execID, Fence: info.Fence, Attempt: info.Attempt}
	msg := amqp.Publishing{MessageId: plan.StageID, ContentType: "application/json", Body: next.Body()}
	if err := amqpidem.Stage(ctx, w.cfg.StageExchange, w.cfg.StageTo, msg); err != nil {
		return "stage failed: " + err.Error(), nil, err
	}
	// In pg mode, TxResult then says "after-effect": the staged message
	// is this handler's effect.
	w.markInserted(info.Key, info.Fence)
	switch {
	case plan.Stall && w.firstExecution(op, execID, info.Attempt):
		w.stallUntilCompleted(ctx, op, execID, plan)
		return "staged, stalled", make([]byte, plan.ResultBytes), nil
	case plan.Permanent:
		return "permanent failure after staging", nil, amqpidem.Permanent(fmt.Errorf("chaos: %s fails for good", op))
	case plan.AlwaysFail || info.Attempt < plan.FailUntil:
		return "retryable failure after staging", nil, fmt.Errorf("chaos: %s fails at attempt %d after staging", op, info.Attempt)
	}
	return "staged", make([]byte, plan.ResultBytes), nil
}
