package main

// A PostgreSQL variant's pool for one run (pg.go has the run's schema
// and handlers): made, traced and closed around the run.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/pgstore"
)

// pgRun is one throughput run's pool: by default (-pg-pool-per-run) made
// before the run, every connection opened, traced, closed after it; with
// -pg-pool-per-run=false (-short) the pool all pg runs share, its
// connections made as needed.
type pgRun struct {
	p     *pgEnv
	app   string
	pool  *pgxpool.Pool
	tr    *pgTracer
	own   bool           // the run made pool and closes it
	store *pgstore.Store // pg-unique and pg-duplicate

	xact0 int64
	xerr  error
	// The tracer and the pool's acquire figures when measuring starts.
	tr0    tracerCounts
	waits0 int64
	wait0  time.Duration
}

// errSharedPool is why a run on the shared pool has no server figure: its
// sessions do not end, so they report their statistics when they like.
var errSharedPool = errors.New("the pool outlives the run (-pg-pool-per-run=false)")

// newPool makes a traced pool of p.conns connections named app.
func (p *pgEnv) newPool(ctx context.Context, app string, tr *pgTracer) (*pgxpool.Pool, error) {
	cfg, err := pgConfig(p.o, app)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = p.conns
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL pool: %w", err)
	}
	return pool, nil
}

// open gives run v a pool and, for the amqpidem variants, a Store on it
// with prefix. A pool of its own has all its connections opened first, so
// that none is made while measuring.
func (p *pgEnv) open(ctx context.Context, v variant, app, prefix string) (r *pgRun, err error) {
	r = &pgRun{p: p, app: app}
	if p.o.PGPoolPerRun {
		r.own, r.tr = true, &pgTracer{}
		// Before the pool exists: the connections' own start-up
		// transactions are in the server's figure, as in any run.
		r.xact0, r.xerr = p.xactCommit(ctx)
		if r.pool, err = p.newPool(ctx, app, r.tr); err != nil {
			return nil, err
		}
		if err := openAll(ctx, r.pool, p.conns); err != nil {
			r.pool.Close()
			return nil, fmt.Errorf("%s pool: %w", v, err)
		}
	} else {
		if p.shared == nil {
			p.sharedTr = &pgTracer{}
			if p.shared, err = p.newPool(ctx, p.sharedApp, p.sharedTr); err != nil {
				return nil, err
			}
		}
		r.pool, r.tr, r.xerr = p.shared, p.sharedTr, errSharedPool
	}
	st := r.pool.Stat()
	r.tr0, r.waits0, r.wait0 = r.tr.counts(), st.EmptyAcquireCount(), st.EmptyAcquireWaitTime()
	if v == pgUnique || v == pgDuplicate || v == pgBatch {
		if r.store, err = pgstore.New(r.pool, p.storeConfig(prefix)); err != nil {
			if r.own {
				r.pool.Close()
			}
			return nil, err
		}
	}
	return r, nil
}

// openAll makes pool open n connections, all at once: each Acquire holds
// its connection until all are made.
func openAll(ctx context.Context, pool *pgxpool.Pool, n int32) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	held := make([]*pgxpool.Conn, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range held {
		wg.Go(func() { held[i], errs[i] = pool.Acquire(ctx) })
	}
	wg.Wait()
	for _, c := range held {
		if c != nil {
			c.Release()
		}
	}
	for _, err := range errs {
		if err != nil {
			return fmt.Errorf("opening %d connections: %w", n, err)
		}
	}
	return nil
}

// pgCounts is what a run's pool did: with a pool of its own, over the
// pool's life (from before it was made to after its sessions ended); on
// the shared pool, from the run's start to its end.
type pgCounts struct {
	tracerCounts
	// XactCommit is the pg_stat_database.xact_commit delta over the
	// pool's life, -1 when not measured (shared pool) or not readable.
	XactCommit int64
	// Waits counts the pool acquires that found no idle connection
	// (with a pool of its own: once every connection was open; on the
	// shared pool those that made one are included), and Wait the time
	// they waited.
	Waits int64
	Wait  time.Duration
}

// close closes the store and a pool of the run's own, waits (bounded)
// until the server has ended the pool's sessions, which report their
// statistics when they end, and reads what the run did.
func (r *pgRun) close(ctx context.Context) (pgCounts, error) {
	if r.store != nil {
		r.store.Close()
	}
	st := r.pool.Stat()
	c := pgCounts{
		tracerCounts: r.tr.counts().minus(r.tr0),
		XactCommit:   -1,
		Waits:        st.EmptyAcquireCount() - r.waits0,
		Wait:         st.EmptyAcquireWaitTime() - r.wait0,
	}
	if !r.own {
		return c, nil
	}
	r.pool.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err := until(ctx, 10*time.Second, func() bool {
		var n int
		err := r.p.admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", r.app).Scan(&n)
		return err == nil && n == 0
	})
	if err != nil {
		return c, fmt.Errorf("PostgreSQL: the sessions of %s did not end: %w", r.app, err)
	}
	if r.xerr == nil {
		if x1, err := r.p.xactCommit(ctx); err == nil {
			c.XactCommit = x1 - r.xact0
		}
	}
	return c, nil
}
