package pgstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestBatchQueryExecModes: AcquireBatch and a batch's completion send
// their arrays (keys as bytes, NUL and non-UTF-8 included; an empty and a
// set fingerprint; an empty result) under every query mode of pgx, also
// those without a statement description, as behind a pooler.
func TestBatchQueryExecModes(t *testing.T) {
	ctx := context.Background()
	modes := map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement,
		"cache_describe":  pgx.QueryExecModeCacheDescribe,
		"describe_exec":   pgx.QueryExecModeDescribeExec,
		"exec":            pgx.QueryExecModeExec,
		"simple_protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			_, store, _ := storeOn(t, func(pcfg *pgxpool.Config) {
				pcfg.MaxConns = 2
				pcfg.ConnConfig.DefaultQueryExecMode = mode
			})
			reqs := []lock.Request{
				{Key: "plain", TTL: time.Minute},
				{Key: "nul\x00and\xffbytes", TTL: time.Minute, Fingerprint: "fp\x00\xfe"},
				{Key: "third", TTL: 2 * time.Minute, Retention: time.Hour},
			}
			rs, errs := store.AcquireBatch(ctx, reqs)
			items := make([]amqpidem.BatchItem, len(rs))
			for i, r := range rs {
				if errs[i] != nil || r.Status != lock.Acquired {
					t.Fatalf("AcquireBatch %d: %+v, %v", i, r, errs[i])
				}
				items[i] = amqpidem.BatchItem{Delivery: &amqp.Delivery{}, Lease: r.Lease}
			}
			h := store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
				return []amqpidem.BatchResult{{Result: []byte("one")}, {Result: nil}, {Result: []byte("three\x00")}}, nil
			}).(amqpidem.BatchCompleter)
			res, err := h.HandleBatchComplete(ctx, items, func(_ int, r []byte) ([]byte, error) { return r, nil })
			if err != nil {
				t.Fatal(err)
			}
			for i, r := range res {
				if r.Err != nil {
					t.Fatalf("message %d: %v", i, r.Err)
				}
			}
			again, errs := store.AcquireBatch(ctx, reqs)
			for i, want := range []string{"one", "", "three\x00"} {
				if errs[i] != nil || again[i].Status != lock.Completed || string(again[i].Value) != want {
					t.Errorf("duplicate %d: %+v, %v; want completed with %q", i, again[i], errs[i], want)
				}
			}
			conflict, errs := store.AcquireBatch(ctx, []lock.Request{{Key: reqs[1].Key, Fingerprint: "other"}})
			if errs[0] != nil || conflict[0].Status != lock.Conflict {
				t.Errorf("other fingerprint: %+v, %v; want a conflict", conflict[0], errs[0])
			}
		})
	}
}

// storeOn is a Store migrated on a schema of its own, on a pool of its
// own whose config tune adjusts (its size, exec mode, tracer), and its
// Config; tb's cleanup closes them and drops the schema.
func storeOn(tb testing.TB, tune func(*pgxpool.Config)) (*pgxpool.Pool, *pgstore.Store, pgstore.Config) {
	tb.Helper()
	ctx := context.Background()
	pcfg, err := pgxpool.ParseConfig(pgenv.DSN(tb))
	if err != nil {
		tb.Fatal(err)
	}
	tune(pcfg)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(pool.Close)
	cfg := pgstore.Config{CleanupInterval: -1, Schema: strings.ToLower(testenv.Name(tb))}
	if err := pgstore.Migrate(ctx, pool, cfg); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _, _ = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE") })
	store, err := pgstore.New(pool, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(store.Close)
	return pool, store, cfg
}
