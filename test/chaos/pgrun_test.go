//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
	"github.com/amqpidem/amqpidem/test/chaos/internal/worker"
)

// pgRun is the world of a scenario on the PostgreSQL store (issue 11): an
// effect run (queue, ledger, consumer processes) whose consumers keep their
// records with pgstore and insert their effect, one plain row per
// execution with no unique key (worker.EffectsTable), in pgstore's handler
// transaction. Records and effects live in the scenario's schema of the
// store's database: the shared server (the ledger's database) or, for the
// restart scenario, a private server. The ledger's executions, completions
// and crash claims stay on the shared server, written in autocommit, so
// that executions that rolled back are counted too.
type pgRun struct {
	effectRun
	storeDSN string
	// app is the application_name of the consumers' store connections
	// (the default of every consumer of the run).
	app  string
	pool *pgxpool.Pool // the test's own connections to the store's database
	cfg  pgstore.Config
	// recordKey, when set, is the key of the record of operation op in
	// cfg's store (default amqpidem.StoreKey(queue, op)): the outbox
	// scenarios' stage B keys its records by the staged messages' ids.
	recordKey func(op string) string
}

// newPGRun makes the env, the effects table and the store's table (Migrate)
// in the store's database: the shared one, or with private a private
// server, started here and returned.
func newPGRun(t *testing.T, private bool) (*pgRun, *pgenv.Server) {
	t.Helper()
	start := time.Now()
	e := newEnv(t, envOptions{})
	consumerBinary(t)
	r := &pgRun{effectRun: effectRun{env: e, start: start}, storeDSN: e.dsn, app: e.name + "-store", cfg: worker.StoreConfig(e.name, e.schema, 0)}
	r.sink = r
	var srv *pgenv.Server
	if private {
		srv = pgenv.StartServer(t)
		r.storeDSN = srv.DSN
	}
	pcfg, err := pgxpool.ParseConfig(r.storeDSN)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = 4
	pcfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pcfg.ConnConfig.RuntimeParams["search_path"] = e.schema
	pcfg.ConnConfig.RuntimeParams["application_name"] = "amqpidem-chaos"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r.pool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.pool.Close)
	if private {
		if _, err := r.pool.Exec(ctx, "CREATE SCHEMA "+e.schema); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := r.pool.Exec(ctx, worker.EffectsDDL); err != nil {
		t.Fatalf("creating the effects table: %v", err)
	}
	if err := pgstore.Migrate(ctx, r.pool, r.cfg); err != nil {
		t.Fatal(err)
	}
	r.logf("set up")
	return r, srv
}

// flags are a consumer's flags for the pg store, then extra.
func (r *pgRun) flags(extra ...string) []string {
	return append([]string{"-store-pg", r.storeDSN, "-store-app", r.app}, extra...)
}

// storeCount runs a query returning one integer on the store's database.
func (r *pgRun) storeCount(sql string, args ...any) int {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var n int
	if err := r.pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		r.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// countApplied returns how many operations have an effect row (effectSink).
func (r *pgRun) countApplied(ctx context.Context) (int, error) {
	var n int
	err := r.pool.QueryRow(ctx, `SELECT count(DISTINCT op_id) FROM `+worker.EffectsTable).Scan(&n)
	return n, err
}

// readEffects returns the exec ids of each operation's effect rows, in the
// order they were inserted (effectSink).
func (r *pgRun) readEffects(ctx context.Context) (map[string][]string, error) {
	rows, err := r.pool.Query(ctx, `SELECT op_id, exec_id FROM `+worker.EffectsTable+` ORDER BY seq`)
	if err != nil {
		return nil, err
	}
	effects := map[string][]string{}
	var op, exec string
	_, err = pgx.ForEachRow(rows, []any{&op, &exec}, func() error {
		effects[op] = append(effects[op], exec)
		return nil
	})
	return effects, err
}

// readRecords reads the records through pgstore's Acquire (effectSink): a
// record that is not completed is leased by the read, which disturbs
// nobody once the consumers have stopped.
func (r *pgRun) readRecords(context.Context) (func(context.Context, string) (bool, string, error), func(), error) {
	store, err := pgstore.New(r.pool, r.cfg)
	if err != nil {
		return nil, nil, err
	}
	check := func(ctx context.Context, op string) (bool, string, error) {
		key := amqpidem.StoreKey(r.queue, op)
		if r.recordKey != nil {
			key = r.recordKey(op)
		}
		res, err := store.Acquire(ctx, lock.Request{Key: key})
		if err != nil {
			return false, "", err
		}
		return res.Status == lock.Completed, fmt.Sprintf("%v (attempts %d, fence %d)", res.Status, res.Attempts, res.Fence), nil
	}
	return check, store.Close, nil
}

// commitUnknown reports whether an execution's logged end (worker.TxResult)
// is a commit whose outcome pgstore could not know (the connection broke
// during COMMIT): then its effect row may or may not exist. Any other
// failure means nothing was committed (effectSink).
func (r *pgRun) commitUnknown(result string) bool {
	return strings.HasPrefix(result, "failed after-effect unavailable: ") && strings.Contains(result, "pgstore: commit")
}

// words names pgstore and its effects, rows (effectSink).
func (r *pgRun) words() (store, effect string) { return "pgstore", "row" }

// pgFlags are the consumer flags the pg scenarios share: a 2 s lease, short
// waits, and attempts enough for the faults (every execution a crash or a
// kill interrupted counts as an attempt).
var pgFlags = []string{"-lease", "2s", "-in-progress-delay", "300ms", "-unavailable-delay", "300ms",
	"-backoff", "100ms", "-max-attempts", "20"}
