package amqpidem

import (
	"context"
	"errors"
	"strconv"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// TestBatchRunExecutionsOnDemand: a batch run makes a message's execution
// when its handler first asks for the message's context, not before (a
// handler that asks for none costs no execution and no index); staging
// ends for every message when the handler returns, also for one whose
// context is asked for only then (late: its FromContext is still its own,
// Stage refuses); DiscardStaged gives each message a fresh outbox, and
// the contexts from before it stage nothing more.
func TestBatchRunExecutionsOnDemand(t *testing.T) {
	p := newBatchProcessor(t, 3)
	fs := make([]*flight, 3)
	ds := make([]*amqp.Delivery, 3)
	for i := range fs {
		k := "k" + strconv.Itoa(i)
		fs[i] = &flight{storeKey: k, attempt: i + 1}
		fs[i].ev.Key = k
		ds[i] = &amqp.Delivery{MessageId: k}
	}
	r, ctx := p.newBatchRun(context.Background(), fs, ds)
	if r.slab != nil || r.index != nil {
		t.Fatal("executions or their index made before any was asked for")
	}
	stage := func(ctx context.Context) error { return Stage(ctx, "", "next", amqp.Publishing{Body: []byte("x")}) }
	c0 := DeliveryContext(ctx, ds[0])
	if err := stage(c0); err != nil {
		t.Fatalf("Stage in message 0 while the handler runs: %v", err)
	}
	if other := DeliveryContext(ctx, &amqp.Delivery{MessageId: "k0"}); other != ctx {
		t.Error("DeliveryContext of a delivery not of the batch is not the batch's context")
	}

	staged := r.sealAll() // the handler returned
	if len(staged[0]) != 1 || staged[1] != nil || staged[2] != nil {
		t.Fatalf("staged %d, %d, %d messages; want 1, 0, 0", len(staged[0]), len(staged[1]), len(staged[2]))
	}
	if err := stage(c0); !errors.Is(err, ErrNoOutbox) {
		t.Errorf("Stage in message 0 after the handler returned: %v, want ErrNoOutbox", err)
	}
	late := DeliveryContext(ctx, ds[1])
	if info, ok := FromContext(late); !ok || info.Key != "k1" || info.Attempt != 2 {
		t.Errorf("FromContext of message 1 asked for late: %+v %v, want its own (k1, attempt 2)", info, ok)
	}
	if err := stage(late); !errors.Is(err, ErrNoOutbox) {
		t.Errorf("Stage in message 1 asked for after the handler returned: %v, want ErrNoOutbox", err)
	}
	if again := r.seal(1); again != nil {
		t.Errorf("message 1 sealed again: %d staged, want none", len(again))
	}

	r.discard()
	for i, d := range ds {
		if err := stage(DeliveryContext(ctx, d)); err != nil {
			t.Errorf("Stage in message %d after DiscardStaged: %v", i, err)
		}
	}
	if err := stage(c0); !errors.Is(err, ErrNoOutbox) {
		t.Errorf("Stage through message 0's context from before DiscardStaged: %v, want ErrNoOutbox", err)
	}
	if err := stage(late); !errors.Is(err, ErrNoOutbox) {
		t.Errorf("Stage through message 1's context from before DiscardStaged: %v, want ErrNoOutbox", err)
	}
	staged = r.sealAll()
	for i := range staged {
		if len(staged[i]) != 1 {
			t.Errorf("message %d: %d staged after DiscardStaged, want 1", i, len(staged[i]))
		}
	}
}
