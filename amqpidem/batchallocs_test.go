package amqpidem

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// TestBatchAllocationsPerMessage: a batch consumer's message costs no
// more allocations than a single-message consumer's, on the same store
// (lock.MemoryStore) with handlers that do nothing: what the batch path
// adds (gathering, the batch's run) must be paid for by what it shares
// (one lease call, one completion call, one context per batch). Keeping
// each lease with a context of its own (heartbeat.Keeper.Keep) and
// watching each with a context.AfterFunc cost about nine allocations a
// message, more than the batch saves.
func TestBatchAllocationsPerMessage(t *testing.T) {
	const size, runs = 100, 20
	body := []byte(`{"order":42,"amount_cents":1999}`)
	ids := make([]string, 2*size*(runs+1)) // AllocsPerRun runs f runs+1 times
	for i := range ids {
		ids[i] = "op-" + strconv.Itoa(i)
	}
	next := 0
	id := func() string { next++; return ids[next-1] }
	ctx, br, ack := context.Background(), nopBroker{}, &countChannel{}

	p := newBatchProcessor(t, size)
	batch := testing.AllocsPerRun(runs, func() {
		var wg sync.WaitGroup
		for range size {
			d := &amqp.Delivery{Acknowledger: ack, MessageId: id(), Body: body}
			wg.Go(func() {
				if ev := p.process(ctx, br, d, nil); ev.Outcome != Completed {
					t.Errorf("batch: %v %s %v", ev.Outcome, ev.Reason, ev.Err)
				}
			})
		}
		wg.Wait()
	}) / size

	singleStore, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	sp, err := newProcessor(singleStore, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)},
		HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = sp.keeper.Shutdown(context.Background()) }()
	single := testing.AllocsPerRun(runs, func() {
		var wg sync.WaitGroup
		for range size {
			d := &amqp.Delivery{Acknowledger: ack, MessageId: id(), Body: body}
			wg.Go(func() {
				if ev := sp.process(ctx, br, d, nil); ev.Outcome != Completed {
					t.Errorf("single: %v %s %v", ev.Outcome, ev.Reason, ev.Err)
				}
			})
		}
		wg.Wait()
	}) / size
	t.Logf("allocations per message: batch %.2f, single %.2f", batch, single)
	if batch > single {
		t.Errorf("a batch consumer's message costs %.2f allocations, a single consumer's %.2f: want no more", batch, single)
	}
}
