package pgstore_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// TestWrapBatchTxHandler: BatchTxHandler under a user's own delivery loop
// (amqpidem.WrapBatch, a goroutine per delivery): each message's effect
// and completed record are written by one transaction, shared by the
// messages of its batch, each once.
func TestWrapBatchTxHandler(t *testing.T) {
	r := newRig(t)
	conn, err := amqp.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	const size = 10
	w, err := amqpidem.WrapBatch(conn, r.store, amqpidem.Config{Queue: r.queue, LeaseTTL: 5 * time.Second, Logger: slog.New(slog.DiscardHandler)},
		amqpidem.BatchOptions{Size: size, Wait: 200 * time.Millisecond},
		r.store.BatchTxHandler(func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
			for _, d := range ds {
				if err := r.insert(ctx, tx, d.MessageId); err != nil {
					return nil, err
				}
			}
			return nil, nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	ops := ids("b", 30)
	r.publish(ops...)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Qos(2*size, 0, false); err != nil {
		t.Fatal(err)
	}
	msgs, err := ch.Consume(r.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	outcomes := map[string]amqpidem.Outcome{}
	timeout := time.After(30 * time.Second)
	for range ops {
		select {
		case d := <-msgs:
			wg.Add(1)
			go func() {
				defer wg.Done()
				ev := w.Handle(context.Background(), d)
				mu.Lock()
				outcomes[d.MessageId] = ev.Outcome
				mu.Unlock()
			}()
		case <-timeout:
			t.Fatal("deliveries missing after 30s")
		}
	}
	wg.Wait()
	if err := w.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	got := r.effects()
	for _, op := range ops {
		if got[op] != 1 || outcomes[op] != amqpidem.Completed {
			t.Errorf("%s: %d effect rows, outcome %v; want 1, completed", op, got[op], outcomes[op])
		}
	}
	same, txs := r.xmins(ops)
	for op, ok := range same {
		if !ok {
			t.Errorf("%s: effect and completed record not written by one transaction", op)
		}
	}
	if txs >= len(ops)/2 {
		t.Errorf("%d transactions for %d messages, want batches", txs, len(ops))
	}
	t.Logf("%d messages in %d transactions", len(ops), txs)
}
