package amqpidem

import (
	"context"
	"log/slog"
	"strconv"
	"testing"
	"unsafe"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// TestFlyAllocations checks what a Consumer's session saves per delivery
// over process: the flight is part of the delivery's job (one allocation
// for both), and the calls that settle it use the session's context
// without cancellation (calm) rather than one made per delivery. A
// delivery run to completion, and one whose handler stages a message
// (its Complete, publish and Amend all settle with calm), each cost at
// least two allocations fewer through fly than through process.
func TestFlyAllocations(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handler HandlerFunc
	}{
		{"unique", func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }},
		{"outbox", func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			return nil, Stage(ctx, "", "next", amqp.Publishing{Body: d.Body})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store, err := lock.NewMemoryStore(lock.Config{})
			if err != nil {
				t.Fatal(err)
			}
			p, err := newProcessor(store, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)}, tc.handler)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = p.keeper.Shutdown(context.Background()) }()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			calm := context.WithoutCancel(ctx)
			ack := &countChannel{}
			const runs = 200
			ids := make([]string, 2*(runs+1))
			for i := range ids {
				ids[i] = "fly-" + strconv.Itoa(i)
			}
			next := 0
			id := func() string { next++; return ids[next-1] }
			viaProcess := testing.AllocsPerRun(runs, func() {
				d := &amqp.Delivery{Acknowledger: ack, MessageId: id(), Body: []byte("x")}
				if ev := p.process(ctx, nopBroker{}, d, nil); ev.Outcome != Completed {
					t.Fatalf("process: %v %s %v", ev.Outcome, ev.Reason, ev.Err)
				}
			})
			viaFly := testing.AllocsPerRun(runs, func() {
				j := p.newJob(amqp.Delivery{Acknowledger: ack, MessageId: id(), Body: []byte("x")})
				if ev := p.fly(&j.f, ctx, calm, nopBroker{}, &j.d, nil); ev.Outcome != Completed {
					t.Fatalf("fly: %v %s %v", ev.Outcome, ev.Reason, ev.Err)
				}
			})
			t.Logf("allocations per delivery: process %.0f, fly %.0f", viaProcess, viaFly)
			if viaFly > viaProcess-2 {
				t.Errorf("fly costs %.0f allocations per delivery, process %.0f: want at least 2 fewer", viaFly, viaProcess)
			}
		})
	}
}

// TestJobSize: a Consumer allocates one job per delivery, and the
// allocator rounds it up to a size class; a job that grows past 1,536
// bytes is allocated as 1,792 (and past that as 2,048, as it was when it
// held both kinds of flight's parts): 256 bytes more per message for the
// garbage collector. Moving a field, or adding one, shows here.
func TestJobSize(t *testing.T) {
	const class = 1536
	for _, tc := range []struct {
		name string
		size uintptr
	}{
		{"soloJob", unsafe.Sizeof(soloJob{})},
		{"batchJob", unsafe.Sizeof(batchJob{})},
	} {
		if tc.size > class {
			t.Errorf("%s is %d bytes, over the %d-byte size class", tc.name, tc.size, class)
		}
	}
}
