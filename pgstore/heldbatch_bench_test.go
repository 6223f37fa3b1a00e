package pgstore_test

import (
	"context"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// BenchmarkBatchCommits counts what one message of a batch of 100 new
// keys costs in statements, round trips and committed transactions (an
// autocommit statement or pipeline counts as one), its lease taken and
// its record completed by BatchTxHandler (a batch function that writes
// nothing): "row", leases taken by the Store's AcquireBatch (record rows,
// Config.RowLeases); "held", by the handler's AcquireLeaseBatch (held by
// a session, amqpidem.BatchLeaseTaker), as a batch consumer takes them.
// pg-ns/op is the CPU time the pool's server processes used (Linux, a
// server on this machine).
func BenchmarkBatchCommits(b *testing.B) {
	for _, held := range []bool{false, true} {
		name := "row"
		if held {
			name = "held"
		}
		b.Run(name, func(b *testing.B) {
			var c tripCounter
			ctx := context.Background()
			pool, store, _ := storeOn(b, func(pcfg *pgxpool.Config) {
				pcfg.MaxConns = 4
				pcfg.ConnConfig.Tracer = &c
			})
			h := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				return nil, nil
			}).(amqpidem.BatchCompleter)
			acquire := func(reqs []lock.Request, _ []*amqp.Delivery) ([]lock.Result, []error) {
				return store.AcquireBatch(ctx, reqs)
			}
			if held {
				lt, ok := h.(interface {
					AcquireLeaseBatch(context.Context, []lock.Request, []*amqp.Delivery) ([]lock.Result, []error)
				})
				if !ok {
					b.Skip("no AcquireLeaseBatch")
				}
				acquire = func(reqs []lock.Request, ds []*amqp.Delivery) ([]lock.Result, []error) {
					return lt.AcquireLeaseBatch(ctx, reqs, ds)
				}
			}
			const size = 100
			var seq int
			items := make([]amqpidem.BatchItem, size)
			ds := make([]*amqp.Delivery, size)
			for i := range items {
				ds[i] = &amqp.Delivery{}
				items[i].Delivery = ds[i]
			}
			value := func(_ int, r []byte) ([]byte, error) { return r, nil }
			backends := poolBackends(b, pool)
			b.ReportAllocs()
			b.ResetTimer()
			stmts0, trips0, commits0 := c.stmts.Load(), c.trips.Load(), c.commits.Load()
			cpu0, cpuOK := backendCPU(backends)
			for n := b.N; n > 0; n -= size {
				reqs := make([]lock.Request, min(n, size))
				for i := range reqs {
					seq++
					reqs[i] = lock.Request{Key: "c" + strconv.Itoa(seq), TTL: time.Minute, Retention: time.Hour}
				}
				rs, errs := acquire(reqs, ds[:len(reqs)])
				for i, r := range rs {
					if errs[i] != nil || r.Status != lock.Acquired {
						b.Fatalf("acquire: %v %v", r.Status, errs[i])
					}
					items[i].Lease = r.Lease
				}
				res, err := h.HandleBatchComplete(ctx, items[:len(rs)], value)
				if err != nil {
					b.Fatal(err)
				}
				for _, r := range res {
					if r.Err != nil {
						b.Fatal(r.Err)
					}
				}
			}
			b.StopTimer()
			n := float64(b.N)
			b.ReportMetric(float64(c.stmts.Load()-stmts0)/n, "statements/op")
			b.ReportMetric(float64(c.trips.Load()-trips0)/n, "roundtrips/op")
			b.ReportMetric(float64(c.commits.Load()-commits0)/n, "commits/op")
			if cpu1, ok := backendCPU(backends); ok && cpuOK {
				b.ReportMetric(float64(cpu1-cpu0)/n, "pg-ns/op")
			}
		})
	}
}

// poolBackends opens every connection pool may have (its MaxConns) and
// returns their backends' process IDs: the server processes that do the
// work of pool's statements, for backendCPU.
func poolBackends(tb testing.TB, pool *pgxpool.Pool) []uint32 {
	tb.Helper()
	var pids []uint32
	var conns []*pgxpool.Conn
	for range pool.Config().MaxConns {
		conn, err := pool.Acquire(context.Background())
		if err != nil {
			tb.Fatal(err)
		}
		conns = append(conns, conn)
		pids = append(pids, conn.Conn().PgConn().PID())
	}
	for _, conn := range conns {
		conn.Release()
	}
	return pids
}

// backendCPU is the CPU time, in ns, the server processes pids have
// used so far (the first field of Linux's /proc/<pid>/schedstat), and
// false where one cannot be read (another OS, a server elsewhere, or a
// backend that ended).
func backendCPU(pids []uint32) (int64, bool) {
	var total int64
	for _, pid := range pids {
		data, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/schedstat")
		if err != nil {
			return 0, false
		}
		f := strings.Fields(string(data))
		if len(f) == 0 {
			return 0, false
		}
		ns, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, false
		}
		total += ns
	}
	return total, true
}

// tripCounter is a pgx tracer that counts statements, round trips (a
// statement sent alone, or a pipeline) and committed transactions: a
// COMMIT that answered COMMIT, or a statement or pipeline with no
// transaction open before or after it (autocommit).
type tripCounter struct{ stmts, trips, commits atomic.Int64 }

// tripState is a round trip's, in its context.
type tripState struct {
	before   byte
	explicit bool
}

type tripKey struct{}

func (c *tripCounter) start(ctx context.Context, conn *pgx.Conn) context.Context {
	c.trips.Add(1)
	return context.WithValue(ctx, tripKey{}, &tripState{before: conn.PgConn().TxStatus()})
}

func (c *tripCounter) end(ctx context.Context, conn *pgx.Conn, err error) {
	st, _ := ctx.Value(tripKey{}).(*tripState)
	if st != nil && !st.explicit && err == nil && st.before == 'I' && conn.PgConn().TxStatus() == 'I' {
		c.commits.Add(1)
	}
}

func (c *tripCounter) TraceQueryStart(ctx context.Context, conn *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.stmts.Add(1)
	return c.start(ctx, conn)
}

func (c *tripCounter) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryEndData) {
	if d.CommandTag.String() == "COMMIT" && d.Err == nil {
		c.commits.Add(1)
		if st, _ := ctx.Value(tripKey{}).(*tripState); st != nil {
			st.explicit = true
		}
	}
	c.end(ctx, conn, d.Err)
}

func (c *tripCounter) TraceBatchStart(ctx context.Context, conn *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return c.start(ctx, conn)
}

func (c *tripCounter) TraceBatchQuery(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.stmts.Add(1)
	switch d.CommandTag.String() {
	case "COMMIT", "ROLLBACK", "BEGIN":
		if d.CommandTag.String() == "COMMIT" && d.Err == nil {
			c.commits.Add(1)
		}
		if st, _ := ctx.Value(tripKey{}).(*tripState); st != nil {
			st.explicit = true
		}
	}
}

func (c *tripCounter) TraceBatchEnd(ctx context.Context, conn *pgx.Conn, d pgx.TraceBatchEndData) {
	c.end(ctx, conn, d.Err)
}
