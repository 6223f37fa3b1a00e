package pgstore_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// TestHrelay3RunAfterShutdown: Run called after Shutdown returned (which
// Shutdown's doc allows: "before, during or after Run") returns nil at
// once and opens no connection: neither the listening session to
// PostgreSQL (counted by the pool's BeforeConnect, which the relay's
// listener calls too) nor one to RabbitMQ (counted by Dial). Many relays,
// since a listener dialled from a goroutine of Run's may or may not get
// there before Run returns.
func TestHrelay3RunAfterShutdown(t *testing.T) {
	r := newOutboxRig(t)
	pc, err := pgxpool.ParseConfig(pgenv.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	var pgDials, amqpDials atomic.Int64
	pc.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		pgDials.Add(1)
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	url := testenv.AMQPURL(t)
	dial := func() (*amqp.Connection, error) {
		amqpDials.Add(1)
		return amqp.Dial(url)
	}
	r.write(true, r.msg("waiting")) // something for a round to publish
	const relays = 200
	for range relays {
		rl, err := pgstore.NewRelay(ob, pgstore.RelayConfig{Dial: dial, PollInterval: 10 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := rl.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown before Run: %v", err)
		}
		start := time.Now()
		err = rl.Run(ctx)
		cancel()
		if err != nil {
			t.Errorf("Run after Shutdown: %v, want nil", err)
		}
		if took := time.Since(start); took > time.Second {
			t.Errorf("Run after Shutdown took %v, want at once", took)
		}
	}
	if n := pgDials.Load(); n > 0 {
		t.Errorf("%d of %d relays run after their Shutdown dialled PostgreSQL (their listener), want none", n, relays)
	}
	if n := amqpDials.Load(); n > 0 {
		t.Errorf("%d of %d relays run after their Shutdown dialled RabbitMQ, want none", n, relays)
	}
	if n := r.count("p"); n != 1 {
		t.Errorf("%d pending rows, want the one written: a relay run after Shutdown published", n)
	}
}
