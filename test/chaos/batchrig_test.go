//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// What the batch scenarios (22, 22b, 22c and 23) share: their ops, their
// queue, their child consumers and how those are run, killed and stopped.

// batchOps is a batch scenario's ops: nGood good ones (g00000, ...) with
// nPoison poison ones (poison000, ...) spread evenly among them.
func batchOps(nGood, nPoison int) (ops, poison []string) {
	for i := range nGood {
		ops = append(ops, fmt.Sprintf("g%05d", i))
		if i%(nGood/nPoison) == nGood/nPoison/2 && len(poison) < nPoison {
			p := fmt.Sprintf("poison%03d", len(poison))
			poison = append(poison, p)
			ops = append(ops, p)
		}
	}
	return ops, poison
}

// batchQueue declares the queue name afresh (deleting that of an earlier
// run that did not clean up, its binary timed out, and its DLQ) and
// returns a channel on a connection closed at the test's end.
func batchQueue(t *testing.T, url, name string) *amqp.Channel {
	t.Helper()
	testenv.DeleteQueues(t, url, name, name+".dlq")
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{name, name + ".dlq"} {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	return ch
}

// publishOps publishes one persistent message per op to the queue name,
// the op as its MessageId.
func publishOps(ctx context.Context, t *testing.T, ch *amqp.Channel, name string, ops []string) {
	t.Helper()
	for _, op := range ops {
		if err := ch.PublishWithContext(ctx, "", name, false, false, amqp.Publishing{MessageId: op, DeliveryMode: amqp.Persistent}); err != nil {
			t.Fatal(err)
		}
	}
}

// batchSchema creates a schema named after the test (dropped at its end),
// with pgstore's tables in it, and returns it with the store's config.
func batchSchema(ctx context.Context, t *testing.T, pool *pgxpool.Pool) (string, pgstore.Config) {
	t.Helper()
	schema := strings.ToLower(strings.NewReplacer("-", "_", ".", "_").Replace(testenv.Name(t)))
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})
	scfg := pgstore.Config{Schema: schema, CleanupInterval: -1}
	if err := pgstore.Migrate(ctx, pool, scfg); err != nil {
		t.Fatal(err)
	}
	return schema, scfg
}

// perOpRows runs a query of (op, count) rows into a map.
func perOpRows(ctx context.Context, t *testing.T, pool *pgxpool.Pool, sql string) map[string]int {
	t.Helper()
	rows, err := pool.Query(ctx, sql)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]int{}
	var op string
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&op, &n}, func() error { m[op] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	return m
}

// poisonFailed counts the poison ops whose record in store is failed.
func poisonFailed(ctx context.Context, store lock.Admin, name string, poison []string) int {
	n := 0
	for _, p := range poison {
		rec, err := store.Inspect(ctx, amqpidem.StoreKey(name, p))
		if err == nil && rec.State == lock.StateFailed {
			n++
		}
	}
	return n
}

// batchChild is one running child consumer.
type batchChild struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// batchChildren are a scenario's child consumers: this test binary run
// with -test.run=^run$ and env added to its environment. Those still
// running at the test's end are killed (only the processes started here,
// by PID).
type batchChildren struct {
	t    *testing.T
	run  string
	env  []string
	list []*batchChild
}

// startBatchChildren starts n children.
func startBatchChildren(t *testing.T, n int, run string, env ...string) *batchChildren {
	t.Helper()
	cs := &batchChildren{t: t, run: run, env: env}
	for range n {
		cs.list = append(cs.list, cs.start())
	}
	t.Cleanup(func() {
		for _, c := range cs.list {
			_ = c.cmd.Process.Kill() // a stopped process dies of SIGKILL too
			<-c.done
		}
	})
	return cs
}

func (cs *batchChildren) start() *batchChild {
	cs.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+cs.run+"$", "-test.count=1")
	cmd.Env = append(os.Environ(), cs.env...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		cs.t.Fatal(err)
	}
	c := &batchChild{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.done) }()
	return c
}

// signal sends s to child i.
func (cs *batchChildren) signal(i int, s syscall.Signal) {
	cs.t.Helper()
	if err := cs.list[i].cmd.Process.Signal(s); err != nil {
		cs.t.Fatal(err)
	}
}

// kill9 kills child i with SIGKILL and starts another in its place.
func (cs *batchChildren) kill9(i int) {
	cs.t.Helper()
	cs.signal(i, syscall.SIGKILL)
	<-cs.list[i].done
	cs.list[i] = cs.start()
}

// stop stops every child in good order (SIGTERM) and waits for it.
func (cs *batchChildren) stop() {
	for _, c := range cs.list {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		<-c.done
	}
}

// runBatchChild is a child's consumer on queue: batches of up to size
// within 20 ms, 2 s leases, 3 attempts, short delays, no logs; more
// changes that. It consumes until killed or stopped (SIGTERM).
func runBatchChild(t *testing.T, store lock.Store, h amqpidem.BatchHandler, queue string, size, prefetch int, more func(*amqpidem.Config)) {
	t.Helper()
	cfg := amqpidem.Config{
		Queue:            queue,
		LeaseTTL:         2 * time.Second,
		MaxAttempts:      3,
		UnavailableDelay: 100 * time.Millisecond,
		Backoff:          func() backoff.BackOff { return backoff.NewConstantBackOff(50 * time.Millisecond) },
		Logger:           slog.New(slog.DiscardHandler),
	}
	if more != nil {
		more(&cfg)
	}
	c, err := amqpidem.NewBatchConsumer(store, amqpidem.ConsumerConfig{
		URL:       testenv.AMQPURL(t),
		BatchSize: size,
		BatchWait: 20 * time.Millisecond,
		Prefetch:  prefetch,
		Config:    cfg,
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := signalContext()
	defer stop()
	_ = c.Run(ctx)
}

// signalContext is cancelled by SIGTERM: a child stopped in good order.
func signalContext() (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM)
	go func() {
		select {
		case <-sig:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}
