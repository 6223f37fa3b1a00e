package worker

import (
	"cmp"
	"context"
	"errors"
	"time"

	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// store wraps the Redis store to watch the lease lifecycle: when each
// Acquire was sent, every Complete the store accepted (logged in the ledger)
// and the crash windows around Complete.
type store struct {
	lock.Store
	w *Worker
}

func (s *store) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	at := time.Now()
	res, err := s.Store.Acquire(ctx, req)
	if err == nil && res.Status == lock.Acquired {
		s.w.track(messageKey(req.Key), res.Lease.Fence, at)
	}
	return res, err
}

// Complete is called once the handler returned: the side effect is done,
// the record not yet completed. The AfterEffect window is here; the
// AfterComplete window is right after the store accepted the result, before
// the processor acks.
func (s *store) Complete(ctx context.Context, l lock.Lease, result []byte) error {
	p := s.w.lookup(messageKey(l.Key), l.Fence)
	if p.crash == workload.AfterEffect {
		s.w.crash(p.op, p.crash, p.execID, l.Fence)
	}
	err := s.Store.Complete(ctx, l, result)
	if err != nil {
		return err
	}
	done := time.Now()
	op := cmp.Or(p.op, ledger.OpID(messageKey(l.Key)))
	lctx, cancel := ledgerCtx()
	defer cancel()
	for try := 0; ; try++ {
		lerr := s.w.led.Completed(lctx, op, l.Fence, s.w.cfg.Name, s.w.pid, done)
		if lerr == nil {
			break
		}
		if try == 20 || lctx.Err() != nil {
			s.w.cfg.Logger.Error("chaos: completion not logged", "op", op, "fence", l.Fence, "error", lerr)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if p.crash == workload.AfterComplete {
		s.w.crash(p.op, p.crash, p.execID, l.Fence)
	}
	if p.stop == workload.AfterComplete {
		s.w.stopSelf(p.op, p.stop, p.execID, l.Fence)
	}
	if !s.w.staging() { // a stage A worker's Amend still needs it
		s.w.untrack(messageKey(l.Key), l.Fence)
	}
	return nil
}

// Amend forwards to the store's Amend (lock.Amender), which amqpidem's
// outbox calls once it has published a completed record's staged
// messages, to record that they are. A wrapper that did not forward it
// would leave the Consumer without an outbox (Stage: ErrNoOutbox). The
// AfterPublish window is before the real call (published and confirmed,
// not recorded), the AfterAmend window right after it (recorded, not
// acked); both only in the execution that staged the messages.
func (s *store) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	a, ok := s.Store.(lock.Amender)
	if !ok {
		return errors.New("worker: the store cannot amend records (lock.Amender)")
	}
	p := s.w.lookup(messageKey(key), fence)
	if p.crash == workload.AfterPublish {
		s.w.crash(p.op, p.crash, p.execID, fence)
	}
	if p.stop == workload.AfterPublish {
		s.w.stopSelf(p.op, p.stop, p.execID, fence)
	}
	err := a.Amend(ctx, key, fence, old, value)
	if err == nil && p.crash == workload.AfterAmend {
		s.w.crash(p.op, p.crash, p.execID, fence)
	}
	if err == nil {
		s.w.untrack(messageKey(key), fence)
	}
	return err
}

func (s *store) Fail(ctx context.Context, l lock.Lease, reason string) error {
	defer s.w.untrack(messageKey(l.Key), l.Fence)
	return s.Store.Fail(ctx, l, reason)
}

func (s *store) Release(ctx context.Context, l lock.Lease) error {
	defer s.w.untrack(messageKey(l.Key), l.Fence)
	return s.Store.Release(ctx, l)
}

func (s *store) Cancel(ctx context.Context, l lock.Lease) error {
	defer s.w.untrack(messageKey(l.Key), l.Fence)
	return s.Store.Cancel(ctx, l)
}
