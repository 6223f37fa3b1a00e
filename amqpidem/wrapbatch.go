package amqpidem

import (
	"cmp"
	"errors"
	"time"

	"github.com/amqpidem/amqpidem/lock"
)

// BatchOptions say how a batch Wrapper (WrapBatch) gathers deliveries
// into batches, as ConsumerConfig's BatchSize and BatchWait do for
// NewBatchConsumer.
type BatchOptions struct {
	// Size is the most deliveries in one batch. Zero means
	// DefaultBatchSize.
	Size int
	// Wait is how long a batch waits for more deliveries once its first
	// is ready to run. Zero means DefaultBatchWait.
	Wait time.Duration
}

// WrapBatch is Wrap for a BatchHandler: a Wrapper whose Handle calls
// gather into batches, run by h as NewBatchConsumer runs them (leases
// taken for the whole batch in one call where the store allows, the
// handler given the new deliveries only, per-message answers, a batch
// error split in halves, pgstore's BatchTxHandler committing a batch's
// writes and records in one transaction), each delivery then settled on
// its own channel by its own Handle call.
//
// Handle blocks until its delivery's batch has run and the delivery is
// settled, so a batch gathers only the deliveries whose Handle calls run
// at once: call Handle from a goroutine per delivery (bounded by the
// channel's prefetch, which should be at least opts.Size), not one after
// another, or every batch holds one message and waits opts.Wait for
// nothing. A BatchCompleter (pgstore's BatchTxHandler) holds one pooled
// connection per running batch, and the heartbeat needs one more: give
// its pool more connections than batches that run at once (the Wrapper
// cannot check that, not knowing how many Handle calls the loop makes at
// once).
//
// A Handle call's ctx ending takes its delivery out of its batch (the
// batch's context is cancelled, and it runs again without it). One
// exception: the leases of deliveries arriving together are taken in one
// store call under the ctx of the Handle call that opened the group, so
// that ctx ending during that call fails the lease requests of the others
// too, each settled as any delivery whose store call failed.
//
// It returns an error for a nil handler, a negative opts field, or a
// BatchCompleter whose CompleterStore is not store, and whatever Wrap
// returns.
func WrapBatch(conn ChannelOpener, store lock.Store, cfg Config, opts BatchOptions, h BatchHandler) (*Wrapper, error) {
	switch {
	case h == nil:
		return nil, errors.New("amqpidem: WrapBatch: nil batch handler")
	case opts.Size < 0:
		return nil, errors.New("amqpidem: WrapBatch: BatchOptions.Size must not be negative")
	case opts.Wait < 0:
		return nil, errors.New("amqpidem: WrapBatch: BatchOptions.Wait must not be negative")
	}
	bc, _ := h.(BatchCompleter)
	if bc != nil && !sameStore(bc.CompleterStore(), store) {
		return nil, errors.New("amqpidem: WrapBatch: the batch handler completes records in another store than the one given (a BatchCompleter's CompleterStore must be the Wrapper's store)")
	}
	w, err := Wrap(conn, store, cfg, batchOnly{h: h})
	if err != nil {
		return nil, err
	}
	ba, _ := store.(lock.BatchAcquirer)
	bt, _ := h.(BatchLeaseTaker)
	w.proc.batch = &batcher{h: h, bc: bc, ba: ba, bt: bt, size: cmp.Or(opts.Size, DefaultBatchSize), wait: cmp.Or(opts.Wait, DefaultBatchWait)}
	// Shutdown closes wake: a batch being gathered runs at once with what
	// it has, as a batch consumer's does when it stops.
	w.proc.stopping = w.wake
	return w, nil
}
