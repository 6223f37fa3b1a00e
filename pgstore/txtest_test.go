package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/internal/txtest"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestTxHandlerConformance runs the handler idioms of package txtest
// through a Consumer on both leases a TxHandler takes: held by the
// transaction (a first delivery; the retry of an op that failed first
// takes a record row) and record rows only (Config.RowLeases). Every idiom
// comes to the same on both, its effect once or a dead letter. The table
// is logged (go test -v -run TestTxHandlerConformance ./pgstore/).
func TestTxHandlerConformance(t *testing.T) {
	pool := pgenv.Pool(t, 24)
	var all [][]txtest.Row
	for _, path := range []struct {
		name string
		cfg  pgstore.Config
	}{{"held", pgstore.Config{}}, {"row", pgstore.Config{RowLeases: true}}} {
		cfg := path.cfg
		cfg.CleanupInterval = -1
		cfg = schema(t, pool, cfg)
		effects := pgx.Identifier{cfg.Schema, "effects"}.Sanitize()
		if _, err := pool.Exec(context.Background(), "CREATE TABLE "+effects+" (op text NOT NULL)"); err != nil {
			t.Fatal(err)
		}
		env := txtest.Env{
			Store: newStore(t, pool, cfg),
			Effects: func(t testing.TB, op string) int {
				var n int
				if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+effects+" WHERE op = $1", op).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			},
		}
		all = append(all, txtest.Check(t, path.name, func(*testing.T) txtest.Env { return env }, idioms(env.Store.(*pgstore.Store), effects)))
	}
	txtest.Same(t, all...)
	for _, rows := range all {
		for _, r := range rows {
			t.Log(r)
		}
	}
}

// idioms are the handler shapes users write with pgx, on store, whose
// effect is a row of the effects table (a plain INSERT, not idempotent by
// itself).
func idioms(store *pgstore.Store, effects string) []txtest.Case {
	errDeclined := errors.New("the card was declined")
	insert := func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (op) VALUES ($1)", txtest.Op(ctx, d))
		return err
	}
	// handler makes the idiom fn into a TxHandler whose function fails
	// first as txtest wants, then does the effect, then fn.
	handler := func(fn func(r *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error)) func(r *txtest.Run) amqpidem.Handler {
		return func(r *txtest.Run) amqpidem.Handler {
			return store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
				if err := r.FailFirst(d); err != nil {
					return nil, err
				}
				if err := insert(ctx, tx, d); err != nil {
					return nil, err
				}
				return fn(r, ctx, tx, d)
			})
		}
	}
	exec := func(ctx context.Context, tx pgx.Tx, sql string) error {
		_, err := tx.Exec(ctx, sql)
		return err
	}
	return []txtest.Case{
		{Name: "plain success", Effects: 1, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, nil
		})},
		{Name: "an error every time", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, errDeclined
		})},
		{Name: "Permanent", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, amqpidem.Permanent(errDeclined)
		})},
		{Name: "panic", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			panic("the handler panicked")
		})},
		{Name: "defer tx.Rollback, return nil", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			defer func() { _ = tx.Rollback(ctx) }()
			return nil, nil
		})},
		{Name: "defer tx.Rollback, return tx.Commit", Effects: 1, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			defer func() { _ = tx.Rollback(ctx) }()
			return nil, tx.Commit(ctx)
		})},
		{Name: "return tx.Commit", Effects: 1, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, tx.Commit(ctx)
		})},
		{Name: "Exec COMMIT", Effects: 1, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, exec(ctx, tx, "COMMIT")
		})},
		{Name: "Exec COMMIT, then an error", Effects: 1, DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			if err := exec(ctx, tx, "COMMIT"); err != nil {
				return nil, err
			}
			return nil, errDeclined
		})},
		{Name: "Exec ROLLBACK", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			return nil, exec(ctx, tx, "ROLLBACK")
		})},
		{Name: "Exec ROLLBACK, then BEGIN, return nil", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			// Its work undone, the record must not be completed in the
			// second, empty transaction (txGuardSQL).
			if err := exec(ctx, tx, "ROLLBACK"); err != nil {
				return nil, err
			}
			return nil, exec(ctx, tx, "BEGIN")
		})},
		{Name: "SAVEPOINT, ROLLBACK TO and RELEASE by the handler", Effects: 1, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			for _, sql := range []string{"SAVEPOINT mine", "INSERT INTO " + effects + " (op) VALUES ('undone')",
				"ROLLBACK TO SAVEPOINT mine", "SAVEPOINT again", "RELEASE SAVEPOINT again"} {
				if err := exec(ctx, tx, sql); err != nil {
					return nil, err
				}
			}
			return nil, nil
		})},
		{Name: "a failed statement in a nested transaction, rolled back", Effects: 1, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			nested, err := tx.Begin(ctx)
			if err != nil {
				return nil, err
			}
			if err := exec(ctx, nested, "SELECT 1/0"); err == nil {
				return nil, errors.New("SELECT 1/0 did not fail")
			}
			return nil, nested.Rollback(ctx)
		})},
		{Name: "a failed statement whose error is swallowed", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			_ = exec(ctx, tx, "SELECT 1/0")
			return nil, nil
		})},
		{Name: "an aborted transaction, then an error", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			_ = exec(ctx, tx, "SELECT 1/0")
			return nil, errDeclined
		})},
		{Name: "an aborted transaction, then a Permanent error", DeadLettered: true, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			_ = exec(ctx, tx, "SELECT 1/0")
			return nil, amqpidem.Permanent(errDeclined)
		})},
		{Name: "idle past the lease", Effects: 1, Handler: handler(func(r *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			if r.First(d) {
				time.Sleep(txtest.LeaseTTL * 3 / 2) // a slow call elsewhere, the transaction idle
			}
			return nil, exec(ctx, tx, "SELECT 1")
		})},
		{Name: "busy in a statement past the lease", Effects: 1, Handler: handler(func(r *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			if r.First(d) {
				return nil, exec(ctx, tx, "SELECT pg_sleep(1.5)")
			}
			return nil, nil
		})},
		{Name: "a library given tx.Conn() begins and commits", Effects: 1, Handler: handler(func(_ *txtest.Run, ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			own, err := tx.Conn().Begin(ctx)
			if err != nil {
				return nil, err
			}
			defer func() { _ = own.Rollback(ctx) }()
			if _, err := own.Exec(ctx, "INSERT INTO "+effects+" (op) VALUES ('library')"); err != nil {
				return nil, err
			}
			return nil, own.Commit(ctx)
		})},
	}
}
