package amqpidem

import (
	"context"
	"testing"
	"time"
)

func hasSlot(t *ticket) bool {
	select {
	case <-t.granted:
		return true
	default:
		return false
	}
}

// waitAsync runs g.wait in the background and reports its answer.
func waitAsync(g *gate, ctx context.Context, stopping <-chan struct{}, t *ticket) <-chan bool {
	out := make(chan bool, 1)
	go func() { out <- g.wait(ctx, stopping, t) }()
	return out
}

func answer(t *testing.T, c <-chan bool) bool {
	t.Helper()
	select {
	case ok := <-c:
		return ok
	case <-time.After(5 * time.Second):
		t.Fatal("wait did not return")
		return false
	}
}

func noAnswer(t *testing.T, c <-chan bool) {
	t.Helper()
	select {
	case ok := <-c:
		t.Fatalf("wait returned %v, want it still waiting", ok)
	case <-time.After(50 * time.Millisecond):
	}
}

func TestGateGrantsInDeliveryOrder(t *testing.T) {
	ctx := context.Background()
	stopping := make(chan struct{})
	g := newGate(1)
	a, b, c := g.enter(), g.enter(), g.enter()

	// c wants a slot first, but a and b came before it.
	cw := waitAsync(g, ctx, stopping, c)
	noAnswer(t, cw)
	// b wants one too; a has not asked yet and holds both back.
	bw := waitAsync(g, ctx, stopping, b)
	noAnswer(t, bw)
	if !answer(t, waitAsync(g, ctx, stopping, a)) {
		t.Fatal("a: no slot")
	}
	noAnswer(t, bw)
	// a is done: b goes next, then c waits for b's slot.
	g.release()
	if !answer(t, bw) {
		t.Fatal("b: no slot")
	}
	noAnswer(t, cw)
	g.release()
	if !answer(t, cw) {
		t.Fatal("c: no slot")
	}
	g.release()
	if g.free != 1 || len(g.queue) != 0 {
		t.Fatalf("after all: %d free, %d queued; want 1, 0", g.free, len(g.queue))
	}
}

func TestGateStopAndCancel(t *testing.T) {
	stopping := make(chan struct{})
	g := newGate(1)
	a, b, c := g.enter(), g.enter(), g.enter()
	if !answer(t, waitAsync(g, context.Background(), stopping, a)) {
		t.Fatal("a: no slot")
	}
	// b gives up (its lease was lost); c is next in line.
	bctx, cancel := context.WithCancel(context.Background())
	bw := waitAsync(g, bctx, stopping, b)
	cw := waitAsync(g, context.Background(), stopping, c)
	noAnswer(t, bw)
	cancel()
	if answer(t, bw) {
		t.Fatal("b: granted after its context ended")
	}
	noAnswer(t, cw)
	// Stopping: c gets no slot even when one frees up.
	close(stopping)
	if answer(t, cw) {
		t.Fatal("c: granted while stopping")
	}
	g.release()
	if g.free != 1 || len(g.queue) != 0 {
		t.Fatalf("after stop: %d free, %d queued; want 1, 0", g.free, len(g.queue))
	}
	if hasSlot(b) {
		t.Fatal("b was handed a slot")
	}
}

func TestGateSeveralSlots(t *testing.T) {
	stopping := make(chan struct{})
	g := newGate(2)
	var ts []*ticket
	for range 5 {
		ts = append(ts, g.enter())
	}
	var ws []<-chan bool
	for _, tk := range ts {
		ws = append(ws, waitAsync(g, context.Background(), stopping, tk))
	}
	answer(t, ws[0])
	answer(t, ws[1])
	noAnswer(t, ws[2])
	g.release()
	answer(t, ws[2])
	noAnswer(t, ws[3])
	g.release()
	g.release()
	answer(t, ws[3])
	answer(t, ws[4])
	if g.free != 0 {
		t.Fatalf("%d free, want 0", g.free)
	}
}
