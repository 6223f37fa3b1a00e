package worker

import (
	"context"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/heartbeat"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// handle is the chaos handler: it logs its execution, follows the message's
// plan (work, crash, fail) and writes the side effect to the ledger with
// the lease's fence. A write the fence check rejects means a newer holder
// already wrote: the handler returns success, and the store refuses its
// Complete.
func (w *Worker) handle(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
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

	if plan.Crash == workload.BeforeEffect {
		w.crash(op, plan.Crash, execID, info.Fence)
	}
	if plan.Stall && info.Attempt == 1 {
		out, err := w.stall(ctx, op, execID, info.Fence, plan)
		if err != nil {
			return nil, err
		}
		result = out.String()
		return nil, nil
	}
	if err := sleep(ctx, plan.Work(info.Attempt)); err != nil {
		w.cancelled(ctx, execID)
		result = "cancelled"
		return nil, err
	}
	switch {
	case plan.Permanent:
		result = "permanent failure"
		return nil, amqpidem.Permanent(fmt.Errorf("chaos: %s fails for good", op))
	case plan.Broken && !w.cfg.Fixed:
		result = "permanent failure"
		return nil, amqpidem.Permanent(fmt.Errorf("chaos: %s fails for good until the handler is fixed", op))
	case plan.AlwaysFail || info.Attempt < plan.FailUntil:
		result = "retryable failure"
		return nil, fmt.Errorf("chaos: %s fails at attempt %d", op, info.Attempt)
	}
	if ctx.Err() != nil {
		w.cancelled(ctx, execID)
		result = "cancelled"
		return nil, context.Cause(ctx)
	}
	lctx, cancel := ledgerCtx()
	out, err := w.led.Apply(lctx, op, execID, info.Fence)
	cancel()
	if err != nil {
		result = "error: " + err.Error()
		return nil, err
	}
	result = out.String()
	return make([]byte, plan.ResultBytes), nil
}

// stall is a stale holder: it waits, ignoring its context, until another
// execution has applied op (or StallMS passes), gives its context a moment
// to be cancelled (a handler that looked would stop here), records whether
// it was, and writes anyway.
func (w *Worker) stall(ctx context.Context, op, execID string, fence int64, plan workload.Plan) (ledger.Outcome, error) {
	limit := time.Now().Add(time.Duration(max(plan.StallMS, 1000)) * time.Millisecond)
	for time.Now().Before(limit) {
		lctx, cancel := ledgerCtx()
		by, ok, err := w.led.AppliedBy(lctx, op)
		cancel()
		if err == nil && ok && by != execID {
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
	lctx, cancel := ledgerCtx()
	defer cancel()
	return w.led.Apply(lctx, op, execID, fence)
}

// cancelled records the state of the handler's context: its cause if it is
// done, and how far ahead the lease's confirmed deadline still was.
func (w *Worker) cancelled(ctx context.Context, execID string) {
	cause := ""
	if ctx.Err() != nil {
		cause = context.Cause(ctx).Error()
	}
	var left time.Duration
	if l, ok := heartbeat.LeaseFromContext(ctx); ok {
		left = time.Until(l.Deadline)
	}
	lctx, cancel := ledgerCtx()
	defer cancel()
	if err := w.led.Cancelled(lctx, execID, cause, left); err != nil {
		w.cfg.Logger.Error("chaos: cancellation not logged", "exec", execID, "error", err)
	}
}

// sleep waits d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// headerInt reads an AMQP integer of any width; -2 for another type.
func headerInt(v any) int {
	switch v := v.(type) {
	case int:
		return v
	case int8:
		return int(v)
	case int16:
		return int(v)
	case int32:
		return int(v)
	case int64:
		return int(v)
	case uint8:
		return int(v)
	case uint16:
		return int(v)
	case uint32:
		return int(v)
	}
	return -2
}

// start logs the start of an execution of d in the ledger and returns what
// the handler goes on with: the execution's Info, operation id, plan and
// execution id.
func (w *Worker) start(ctx context.Context, d *amqp.Delivery) (amqpidem.Info, string, workload.Plan, string, error) {
	info, _ := amqpidem.FromContext(ctx)
	op := ledger.OpID(info.Key)
	plan := workload.ParsePlan(d.Body)
	if plan.Origin != nil && plan.Op != "" {
		// Stage B: the key is the staged message's MessageId; the
		// ledger knows the operation by the id stage A staged it for.
		op = plan.Op
	}
	execID := fmt.Sprintf("%s.%d.%d", w.cfg.Name, w.pid, w.seq.Add(1))
	acquired := w.attach(info.Key, info.Fence, planRef{crash: plan.Crash, stop: plan.Stop, op: op, execID: execID})

	hdr := -1
	if v, ok := d.Headers[amqpidem.HeaderAttempt]; ok {
		hdr = headerInt(v)
	}
	lctx, cancel := ledgerCtx()
	defer cancel()
	err := w.led.Start(lctx, ledger.Execution{
		ExecID: execID, OpID: op, Consumer: w.cfg.Name, PID: w.pid,
		Attempt: info.Attempt, Fence: info.Fence, HeaderAttempt: hdr, Acquired: acquired,
	})
	return info, op, plan, execID, err
}
