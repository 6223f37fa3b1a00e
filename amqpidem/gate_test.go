package amqpidem

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

func hasSlot(g *gate, t *ticket) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return t.state == granted
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
	if hasSlot(g, b) {
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

// stopDuringAcquire is a store whose Acquire, once it has taken the lease,
// closes stop: the consumer begins stopping while the answer is on its way.
type stopDuringAcquire struct {
	lock.Store
	stop chan struct{}
}

func (s *stopDuringAcquire) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	res, err := s.Store.Acquire(ctx, req)
	close(s.stop)
	return res, err
}

// A delivery whose lease arrives after stopping began goes back to the
// queue without its handler running, and its attempt is taken back.
func TestProcessStoppingBetweenAcquireAndHandler(t *testing.T) {
	ran := false
	p, store := newTestProcessor(t, Config{}, func(context.Context, *amqp.Delivery) ([]byte, error) {
		ran = true
		return nil, nil
	})
	stop := make(chan struct{})
	p.store = &stopDuringAcquire{Store: store, stop: stop}
	p.gate, p.stopping = newGate(1), stop
	b := &fakeBroker{}
	d, acks := delivery("k", "body")

	ev := p.process(context.Background(), b, d, p.gate.enter())
	if ran {
		t.Fatal("the handler ran after stopping began")
	}
	if ev.Outcome != Abandoned || ev.Reason != "shutdown" || ev.Attempt != 0 {
		t.Fatalf("event: %v %q attempt %d; want abandoned, shutdown, attempt 0", ev.Outcome, ev.Reason, ev.Attempt)
	}
	if len(b.pubs) != 1 || b.pubs[0].key != "requeue" || b.pubs[0].delay != 0 || acks.acks != 1 {
		t.Fatalf("broker: %+v, acks %v; want one copy back to the queue, then an ack", b.pubs, acks.acks)
	}
	res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "k")})
	if err != nil || res.Status != lock.Acquired || res.Lease.Attempt != 1 {
		t.Fatalf("next lease: %v attempt %d %v; want acquired, attempt 1", res.Status, res.Lease.Attempt, err)
	}
	if g := p.gate; g.free != 1 {
		t.Fatalf("%d slots free after the delivery, want 1", g.free)
	}
}

// A ticket that holds its slot can wait again (the Consumer's worker waits
// before process does): it keeps the slot, or gives it back when stopping.
func TestGateWaitAgainHoldingTheSlot(t *testing.T) {
	stopping := make(chan struct{})
	g := newGate(1)
	a := g.enter()
	if !answer(t, waitAsync(g, context.Background(), stopping, a)) {
		t.Fatal("a: no slot")
	}
	if !answer(t, waitAsync(g, context.Background(), stopping, a)) {
		t.Fatal("a: lost its slot waiting again")
	}
	if g.free != 0 {
		t.Fatalf("%d free while a holds the only slot", g.free)
	}
	close(stopping)
	if answer(t, waitAsync(g, context.Background(), stopping, a)) {
		t.Fatal("a: kept its slot while stopping")
	}
	if g.free != 1 {
		t.Fatalf("%d free after a gave its slot back, want 1", g.free)
	}
}

// An abandoned ticket (its delivery's channel died) does not hold later
// tickets back, whether it never waited or holds a slot, and waits for
// nothing after.
func TestGateLeave(t *testing.T) {
	stopping := make(chan struct{})
	ctx := context.Background()
	g := newGate(1)
	a, b, c, d := g.enter(), g.enter(), g.enter(), g.enter()

	g.leave(a) // never waited
	if !answer(t, waitAsync(g, ctx, stopping, b)) {
		t.Fatal("b: no slot after a left")
	}
	cw := waitAsync(g, ctx, stopping, c)
	noAnswer(t, cw)
	g.leave(b) // holds the slot: it goes to c
	if !answer(t, cw) {
		t.Fatal("c: no slot after b left with it")
	}
	g.leave(d)
	g.leave(d) // a no-op
	for name, tk := range map[string]*ticket{"a": a, "b": b, "d": d} {
		if answer(t, waitAsync(g, ctx, stopping, tk)) { // at once, c holds the slot
			t.Fatalf("%s: granted after it left", name)
		}
	}
	g.release() // c is done
	if g.free != 1 || len(g.queue) != 0 {
		t.Fatalf("after all: %d free, %d queued; want 1, 0", g.free, len(g.queue))
	}
}

// TestGateWaitOnAllocatesNothing: a ticket that is part of its job, waiting
// on its worker's channel, costs the gate no allocation.
func TestGateWaitOnAllocatesNothing(t *testing.T) {
	g := newGate(1)
	stopping := make(chan struct{})
	wake := make(chan struct{}, 1)
	var j job
	allocs := testing.AllocsPerRun(1000, func() {
		j.t = ticket{}
		g.add(&j.t)
		if !g.waitOn(context.Background(), stopping, &j.t, wake) {
			t.Fatal("no slot")
		}
		g.release()
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per delivery, want 0", allocs)
	}
}

// TestGateWakeReusedAfterGrantLeft: a slot granted to a ticket whose wait
// gave up at that moment leaves a token on its waiter's channel; leave
// takes it, so that the next ticket waiting on that channel waits for a
// slot of its own rather than take the token for one.
func TestGateWakeReusedAfterGrantLeft(t *testing.T) {
	g := newGate(1)
	stopping := make(chan struct{})
	wake := make(chan struct{}, 1)
	a, b := g.enter(), g.enter()
	if !g.waitOn(context.Background(), stopping, a, wake) {
		t.Fatal("a: no slot")
	}
	// b waits on wake (as waitOn leaves it); a's slot goes to it just as
	// its wait gives up.
	g.mu.Lock()
	b.state, b.wake = waiting, wake
	g.mu.Unlock()
	g.release()
	if !hasSlot(g, b) {
		t.Fatal("b: not granted")
	}
	g.leave(b)
	if g.held() != 0 {
		t.Fatalf("%d slots held after b left, want 0", g.held())
	}
	// The slot is taken again; c, on the same channel, must wait for it.
	d := g.enter()
	if !g.waitOn(context.Background(), stopping, d, nil) {
		t.Fatal("d: no slot")
	}
	c := g.enter()
	cw := make(chan bool, 1)
	go func() { cw <- g.waitOn(context.Background(), stopping, c, wake) }()
	noAnswer(t, cw)
	g.release() // d's
	if !answer(t, cw) {
		t.Fatal("c: no slot")
	}
	g.release()
}

// TestGateSubmitStartsInOrder: submitted tickets wait in the gate with no
// goroutine of their own; each is started on its workers as it gets its
// slot, in delivery order, and abandon takes the waiting ones out, left,
// for their session to send back or drop.
func TestGateSubmitStartsInOrder(t *testing.T) {
	g := newGate(1)
	w := &workers{work: make(chan *job, 8)} // an idle worker for each: start never spawns
	other := &workers{work: make(chan *job, 8)}
	js := make([]*job, 4)
	for i := range js {
		js[i] = &job{}
		js[i].d.DeliveryTag = uint64(i + 1)
		js[i].t.workers, js[i].t.job = w, js[i]
	}
	js[3].t.workers = other // a later session's
	started := func(w *workers) uint64 {
		select {
		case j := <-w.work:
			return j.d.DeliveryTag
		default:
			return 0
		}
	}
	for _, j := range js {
		g.submit(&j.t)
	}
	if got := started(w); got != 1 {
		t.Fatalf("started %d, want 1", got)
	}
	if got := started(w); got != 0 {
		t.Fatalf("started %d with no slot free", got)
	}
	g.release() // 1's
	if got := started(w); got != 2 {
		t.Fatalf("started %d, want 2", got)
	}
	out := g.abandon(w)
	if len(out) != 1 || out[0] != js[2] || js[2].t.state != left {
		t.Fatalf("abandoned %v, want job 3, left", out)
	}
	g.release() // 2's: the other session's 4 is next
	if got := started(other); got != 4 {
		t.Fatalf("started %d, want 4", got)
	}
	if got := started(w); got != 0 {
		t.Fatalf("started %d after abandon", got)
	}
	g.release()
	if g.held() != 0 || len(g.queue) != 0 {
		t.Fatalf("%d held, %d queued; want 0, 0", g.held(), len(g.queue))
	}
}
