package amqpidem

import (
	"context"
	"errors"
	"fmt"
)

// ConnPool is implemented by a store whose calls share a bounded pool of
// connections (pgstore.Store: its pgxpool's MaxConns). NewConsumer checks
// ConsumerConfig.Concurrency against it (see checkPool); amqpidem needs
// nothing else of it, and does not import the store's driver.
type ConnPool interface {
	// MaxConns is the most connections the store's pool opens.
	MaxConns() int
}

// ErrPoolTooSmall is what NewConsumer returns, wrapped with the numbers,
// when a Completer (pgstore's TxHandler) would run on a store whose pool
// (ConnPool) has no more connections than Concurrency.
var ErrPoolTooSmall = errors.New("amqpidem: the store's connection pool is too small for Concurrency")

// checkPool refuses a Completer on a store whose pool has no connection
// beyond one per handler. Each running Completer holds a connection for
// as long as it runs, and the heartbeat renewing their leases, like a
// cancelled handler ending its transaction, needs one more: with every
// connection held, leases go unrenewed, handlers are cancelled, then wait
// for a connection that never comes free until their commit timeout
// passes, and come back to do the same. Work that takes longer than most
// of a lease would never complete.
func checkPool(store any, h Handler, concurrency int) error {
	p, ok := store.(ConnPool)
	if !ok {
		return nil
	}
	if _, completer := h.(Completer); !completer {
		return nil
	}
	if n := p.MaxConns(); n <= concurrency {
		return fmt.Errorf("%w: its pool has %d connections and ConsumerConfig.Concurrency is %d, but each running "+
			"transactional handler holds one and the heartbeat needs another to renew their leases: "+
			"give the pool more than Concurrency connections (pool_max_conns=%d, more if other consumers share it), "+
			"or set Concurrency below %d", ErrPoolTooSmall, n, concurrency, concurrency+1, n)
	}
	return nil
}

// checkBatchPool refuses a BatchCompleter (pgstore's BatchTxHandler) on a
// store whose pool has no connection beyond one per batch that may run at
// once (batches): each running batch holds one for its transaction, and
// the heartbeat renewing its leases needs another, as in checkPool.
func checkBatchPool(store any, bc BatchCompleter, batches int) error {
	p, ok := store.(ConnPool)
	if !ok || bc == nil {
		return nil
	}
	if n := p.MaxConns(); n <= batches {
		return fmt.Errorf("%w: its pool has %d connections and up to %d batches run at once (Concurrency over BatchSize), "+
			"but each running batch holds one and the heartbeat needs another to renew their leases: "+
			"give the pool more than %d connections, or lower Concurrency", ErrPoolTooSmall, n, batches, batches)
	}
	return nil
}

// batchesAtOnce is how many batches of up to size deliveries a consumer
// of concurrency handlers runs at once, at most.
func batchesAtOnce(concurrency, size int) int { return (concurrency + size - 1) / size }

// warnSizes logs, at start, what in c's configuration holds handlers back
// without saying so: a store pool with no more connections than
// Concurrency (the store calls of its deliveries wait for one another) and
// a Concurrency above Prefetch (the broker never sends that many at once).
func (c *Consumer) warnSizes(ctx context.Context) {
	log := c.proc.cfg.Logger
	if p, ok := c.proc.given.(ConnPool); ok {
		// What holds a connection at once: a handler each, or a batch
		// each for a batch consumer.
		holders := c.cfg.Concurrency
		if b := c.proc.batch; b != nil {
			holders = batchesAtOnce(c.cfg.Concurrency, b.size)
		}
		if n := p.MaxConns(); n <= holders {
			log.WarnContext(ctx, "amqpidem: the store's connection pool is not larger than Concurrency; "+
				"store calls wait for a free connection (give the pool more connections than Concurrency)",
				"queue", c.cfg.Queue, "max_conns", n, "concurrency", c.cfg.Concurrency)
		}
	}
	if c.cfg.Concurrency > c.cfg.Prefetch {
		log.WarnContext(ctx, "amqpidem: Concurrency is above Prefetch; at most Prefetch handlers run at once "+
			"(raise Prefetch, or lower Concurrency)",
			"queue", c.cfg.Queue, "prefetch", c.cfg.Prefetch, "concurrency", c.cfg.Concurrency)
	}
}
