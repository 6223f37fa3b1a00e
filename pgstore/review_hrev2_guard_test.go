package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestTxGuardEveryModeAndIsolation: the commit's guard (txGuardSQL) under
// every pgx query mode, every isolation level of TxOptions, and generic
// plans forced from the first run (plan_cache_mode): a handler that only
// works, one that uses savepoints (its own and pgx's nested tx.Begin),
// and one that commits its work itself and begins again are completed
// (held lease and row lease, TxHandler and BatchTxHandler, many runs on
// the pool's two connections); one that rolls back and begins again is
// not, each time.
func TestTxGuardEveryModeAndIsolation(t *testing.T) {
	ctx := context.Background()
	modes := []pgx.QueryExecMode{
		pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
	}
	for _, mode := range modes {
		for _, iso := range []pgx.TxIsoLevel{"", pgx.RepeatableRead, pgx.Serializable} {
			t.Run(fmt.Sprintf("%v/%s", mode, map[pgx.TxIsoLevel]string{"": "default"}[iso]+string(iso)), func(t *testing.T) {
				pcfg, err := pgxpool.ParseConfig(pgenv.DSN(t))
				if err != nil {
					t.Fatal(err)
				}
				pcfg.MaxConns = 2
				pcfg.ConnConfig.DefaultQueryExecMode = mode
				pcfg.ConnConfig.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
				pool, err := pgxpool.NewWithConfig(ctx, pcfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(pool.Close)
				cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1, TxOptions: pgx.TxOptions{IsoLevel: iso}})
				if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{cfg.Schema, "effects"}.Sanitize()+" (op text NOT NULL)"); err != nil {
					t.Fatal(err)
				}
				r := &rig{t: t, pool: pool, cfg: cfg, store: newStore(t, pool, cfg)}
				kinds := map[string]func(ctx context.Context, tx pgx.Tx, key string) error{
					"plain": func(ctx context.Context, tx pgx.Tx, key string) error { return r.insert(ctx, tx, key) },
					"savepoint": func(ctx context.Context, tx pgx.Tx, key string) error {
						if _, err := tx.Exec(ctx, "SAVEPOINT mine"); err != nil {
							return err
						}
						if err := r.insert(ctx, tx, key+"-undone"); err != nil {
							return err
						}
						if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT mine"); err != nil {
							return err
						}
						nested, err := tx.Begin(ctx)
						if err != nil {
							return err
						}
						if err := r.insert(ctx, nested, key); err != nil {
							return err
						}
						return nested.Commit(ctx)
					},
					"commit-begin": func(ctx context.Context, tx pgx.Tx, key string) error {
						if err := r.insert(ctx, tx, key); err != nil {
							return err
						}
						if _, err := tx.Conn().Exec(ctx, "COMMIT"); err != nil {
							return err
						}
						_, err := tx.Conn().Exec(ctx, "BEGIN")
						return err
					},
					"rollback-begin": func(ctx context.Context, tx pgx.Tx, key string) error {
						if err := r.insert(ctx, tx, key); err != nil {
							return err
						}
						if _, err := tx.Conn().Exec(ctx, "ROLLBACK"); err != nil {
							return err
						}
						_, err := tx.Conn().Exec(ctx, "BEGIN")
						return err
					},
				}
				for round := range 8 {
					for _, kind := range []string{"plain", "savepoint", "commit-begin", "rollback-begin"} {
						fn := kinds[kind]
						for _, path := range []string{"held", "row", "batch"} {
							key := fmt.Sprintf("%s-%s-%d", kind, path, round)
							var err error
							if path == "batch" {
								var rs []amqpidem.BatchResult
								rs, err = r.batchAttempt([]string{key}, func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
									return nil, fn(ctx, tx, ds[0].MessageId)
								})
								if err == nil && rs != nil {
									err = rs[0].Err
								}
							} else {
								err = r.attempt(key, path == "row", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
									return nil, fn(ctx, tx, d.MessageId)
								})
							}
							rec := r.record(key)
							completed := rec != nil && rec.state == "c"
							if kind == "rollback-begin" {
								if !errors.Is(err, pgstore.ErrTxEnded) || completed || r.effects()[key] != 0 {
									t.Fatalf("%s: %v, completed %v, %d effects: want ErrTxEnded, not completed, no effect", key, err, completed, r.effects()[key])
								}
								continue
							}
							if err != nil || !completed || r.effects()[key] != 1 {
								t.Fatalf("%s: %v, completed %v, %d effects: the guard refused a run it must let through", key, err, completed, r.effects()[key])
							}
						}
					}
				}
			})
		}
	}
}
