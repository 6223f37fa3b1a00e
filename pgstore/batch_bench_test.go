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
	"github.com/amqpidem/amqpidem/internal/proccpu"
	"github.com/amqpidem/amqpidem/lock"
)

// BenchmarkBatch measures what one message of a pg-batch consumer costs
// pgstore: one op is one message, its lease taken by AcquireBatch and its
// record completed by BatchTxHandler's commit (a batch function that
// writes nothing), 100 new keys a batch (BatchSize 100, as in make
// bench). It reports allocations, this process's CPU (cpu-ns/op) and the
// statements sent per message (statements/op, counted by a tracer).
func BenchmarkBatch(b *testing.B) {
	var stmts atomic.Int64
	ctx := context.Background()
	pool, store, _ := storeOn(b, func(pcfg *pgxpool.Config) {
		pcfg.MaxConns = 1 // one server process, whose CPU is read (pg-cpu-ns/op)
		pcfg.ConnConfig.Tracer = stmtCounter{&stmts}
	})
	h := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		return nil, nil
	}).(amqpidem.BatchCompleter)
	const size = 100
	var seq int
	batches := make([][]lock.Request, 0, b.N/size+1)
	for n := b.N; n > 0; n -= size {
		reqs := make([]lock.Request, min(n, size))
		for i := range reqs {
			seq++
			reqs[i] = lock.Request{Key: "b" + strconv.Itoa(seq), TTL: time.Minute, Retention: time.Hour}
		}
		batches = append(batches, reqs)
	}
	items := make([]amqpidem.BatchItem, size)
	for i := range items {
		items[i].Delivery = &amqp.Delivery{}
	}
	value := func(_ int, r []byte) ([]byte, error) { return r, nil }
	b.ReportAllocs()
	b.ResetTimer()
	var pid int
	if err := pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		b.Fatal(err)
	}
	stmts0, cpu0, pg0 := stmts.Load(), proccpu.Self(), procCPU(pid)
	var pgAcquire time.Duration
	for _, reqs := range batches {
		a0 := procCPU(pid)
		rs, errs := store.AcquireBatch(ctx, reqs)
		pgAcquire += procCPU(pid) - a0
		for i, r := range rs {
			if errs[i] != nil || r.Status != lock.Acquired {
				b.Fatalf("AcquireBatch: %v %v", r.Status, errs[i])
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
	cpu, n, pg := proccpu.Self()-cpu0, stmts.Load()-stmts0, procCPU(pid)-pg0
	b.StopTimer()
	if pg0 >= 0 {
		b.ReportMetric(float64(pg.Nanoseconds())/float64(b.N), "pg-cpu-ns/op")
		b.ReportMetric(float64(pgAcquire.Nanoseconds())/float64(b.N), "pg-acquire-cpu-ns/op")
	}
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64(n)/float64(b.N), "statements/op")
}

// procCPU is the CPU time process pid has used (utime + stime in
// /proc/pid/stat, at USER_HZ 100), or -1 where it cannot be read (a
// server not on this host, another OS).
func procCPU(pid int) time.Duration {
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return -1
	}
	// Fields after the command name, which is in parentheses: state is
	// the first, utime the 12th, stime the 13th.
	_, rest, _ := strings.Cut(string(raw), ") ")
	f := strings.Fields(rest)
	if len(f) < 13 {
		return -1
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * 10 * time.Millisecond
}

// stmtCounter counts the statements sent: each query, and each of a
// pgx.Batch's.
type stmtCounter struct{ n *atomic.Int64 }

func (c stmtCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c stmtCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c stmtCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c stmtCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	c.n.Add(1)
}

func (c stmtCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
