package pgstore

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// listen wakes the relay on each notification
// of Outbox.Write, until ctx ends, on a connection of its own (see dial):
// not one of the pool, which it would hold for good, so that a pool of one
// connection, or one the application keeps busy, still serves the relay's
// statements. It listens again, after a second, when the connection fails.
func (r *Relay) listen(ctx context.Context) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		r.log.Warn("pgstore: relay: listen for notifications (polling meanwhile): "+err.Error(), "relay", r.cfg.Name)
		t := time.NewTimer(time.Second)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
	}
}

// listenOnce listens on one connection until it fails or ctx ends, then
// closes it. Its connect and LISTEN are bounded by listenWait: a server
// or network that does not answer them is a warning and another try, not
// a wait in silence while notifications are lost
// (TestHrelay3ListenHungDatabase). The wait for notifications is not
// bounded: a silent channel is no fault.
func (r *Relay) listenOnce(ctx context.Context) error {
	lctx, cancel := context.WithTimeout(ctx, listenWait)
	defer cancel()
	late := func(err error) error {
		if ctx.Err() == nil && lctx.Err() != nil {
			return fmt.Errorf("no answer within %v (a server or network that does not answer): %w", listenWait, err)
		}
		return err
	}
	c, err := r.dial(lctx)
	if err != nil {
		return late(err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = c.Close(cctx)
		cancel()
	}()
	if _, err := c.Exec(lctx, r.sql.listen); err != nil {
		return late(classify(err))
	}
	r.poke() // rows written before the LISTEN sent no notification we saw
	for {
		if _, err := c.WaitForNotification(ctx); err != nil {
			return classify(err)
		}
		r.poke()
	}
}

// dial opens a connection as the Outbox's pool opens one (its ConnConfig,
// BeforeConnect and AfterConnect), outside the pool and its MaxConns.
func (r *Relay) dial(ctx context.Context) (*pgx.Conn, error) {
	pc := r.o.pool.Config() // a copy
	if pc.BeforeConnect != nil {
		if err := pc.BeforeConnect(ctx, pc.ConnConfig); err != nil {
			return nil, fmt.Errorf("connect: the pool's BeforeConnect: %w", err)
		}
	}
	c, err := pgx.ConnectConfig(ctx, pc.ConnConfig)
	if err != nil {
		return nil, classify(err)
	}
	if pc.AfterConnect != nil {
		if err := pc.AfterConnect(ctx, c); err != nil {
			cctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = c.Close(cctx)
			cancel()
			return nil, fmt.Errorf("connect: the pool's AfterConnect: %w", err)
		}
	}
	return c, nil
}

// poke wakes the relay's loop, or leaves it a wake-up if it is busy.
func (r *Relay) poke() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *Relay) isStopping() bool {
	select {
	case <-r.stopping:
		return true
	default:
		return false
	}
}

// Shutdown stops the relay: it claims nothing more, lets the round in
// flight finish until ctx ends (then its publishes give up: their rows are
// released, due again after RetryBackoff, or, if the release cannot be
// written, once their claim ends), and waits for Run to return: the marks
// of the messages already confirmed are still written, and tried again
// for up to half of ClaimTTL when they fail. It returns ctx.Err() if it
// had to cut the round short.
// Shutdown is idempotent and may be called before, during or after Run;
// a Run called after it returns nil at once, having started nothing.
func (r *Relay) Shutdown(ctx context.Context) error {
	r.stopOnce.Do(func() { close(r.stopping) })
	if !r.started.Load() {
		return nil
	}
	select {
	case <-r.done:
		return nil
	case <-ctx.Done():
	}
	r.canOnce.Do(func() { close(r.cancel) })
	<-r.done
	return ctx.Err()
}

// poolWait bounds how long one of the relay's statements waits for a
// connection of the pool (a variable: tests shorten it).
var poolWait = 5 * time.Second

// listenWait bounds the listener's connect and LISTEN (a variable: tests
// shorten it). Polling goes on meanwhile.
var listenWait = 10 * time.Second
