package pgstore_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/amqpidem/amqpidemtest"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestTxHandlerWith: handlers of one Store begin their transactions with
// their own options (issue 42, item 11): a SERIALIZABLE read-only one and
// the Store's default beside it, each completing its record.
func TestTxHandlerWith(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	cfg := schema(t, pool, pgstore.Config{CleanupInterval: -1})
	store := newStore(t, pool, cfg)
	level := func(got *string) pgstore.TxFunc {
		return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
			var iso, ro string
			if err := tx.QueryRow(ctx, "SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')").Scan(&iso, &ro); err != nil {
				return nil, err
			}
			*got = iso + " " + ro
			return nil, nil
		}
	}
	var strict, plain string
	tests := []struct {
		h    amqpidem.Handler
		got  *string
		want string
	}{
		{store.TxHandlerWith(pgx.TxOptions{IsoLevel: pgx.Serializable}, level(&strict)), &strict, "serializable off"},
		{store.TxHandler(level(&plain)), &plain, "read committed off"},
	}
	for _, tc := range tests {
		k := amqpidemtest.NewWithStore(t, store, amqpidem.Config{}, tc.h)
		for _, m := range []amqpidemtest.Message{{ID: "a"}, {ID: "a", Redelivered: true}} {
			*tc.got = ""
			if r := k.Deliver(m); r.Outcome != amqpidem.Completed && r.Outcome != amqpidem.Duplicate {
				t.Fatalf("%+v: %v %q %v", m, r.Outcome, r.Reason, r.Err)
			}
		}
		k2 := amqpidemtest.NewWithStore(t, store, amqpidem.Config{Queue: "other-" + tc.want}, tc.h)
		if r := k2.Deliver(amqpidemtest.Message{ID: "b", Redelivered: true}); r.Outcome != amqpidem.Completed {
			t.Fatalf("redelivered: %v %q %v", r.Outcome, r.Reason, r.Err)
		}
		if *tc.got != tc.want {
			t.Fatalf("transaction: got %q, want %q", *tc.got, tc.want)
		}
	}
}

// TestTxHandlerReadOnlyRefused: a read-only transaction cannot write the
// record: refused by Config.Validate and by TxHandlerWith.
func TestTxHandlerReadOnlyRefused(t *testing.T) {
	if err := (pgstore.Config{TxOptions: pgx.TxOptions{AccessMode: pgx.ReadOnly}}).Validate(); err == nil {
		t.Fatal("Config.Validate accepted a read-only TxOptions")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("TxHandlerWith accepted a read-only transaction")
		}
	}()
	var s *pgstore.Store
	s.TxHandlerWith(pgx.TxOptions{AccessMode: pgx.ReadOnly}, nil)
}
