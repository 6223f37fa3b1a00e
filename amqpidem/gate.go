package amqpidem

import (
	"context"
	"sync"
)

// gate hands out a Consumer's slots in delivery order. Workers pick
// deliveries up concurrently, so without the gate a later delivery could
// start before an earlier one, and Concurrency 1 would no longer mean one
// message after the other, in queue order.
//
// Each delivery gets a ticket when it arrives (enter, called in delivery
// order), then waits for a slot (wait). A ticket gets one only when every
// earlier ticket has got one or given up (left: its wait ended without a
// slot, or its delivery was abandoned). A Consumer's session submits its
// deliveries' tickets instead (submit): the gate starts each on one of the
// session's workers when it gets its slot, and none waits. Safe for
// concurrent use.
type gate struct {
	mu    sync.Mutex
	slots int       // slots in all
	free  int       // slots not held
	queue []*ticket // tickets without a slot and not left, oldest first
}

// ticket is one delivery's place in the gate. Its zero value is a
// ticket not entered yet (add); a Consumer's is part of the delivery's
// job, not an allocation of its own.
type ticket struct {
	state ticketState
	// wake is the waiting goroutine's channel (waitOn), set while the
	// ticket waits: grant sends it one token when it hands the ticket a
	// slot. The channel is the waiter's, reused from ticket to ticket: a
	// wait ends with it empty.
	wake chan struct{}
	// workers, for a submitted ticket, start its job once it has its slot
	// (or left: abandon).
	workers *workers
	job     *job
}

type ticketState int

const (
	pending ticketState = iota // not waiting yet; holds later tickets back
	waiting                    // wants a slot
	granted                    // got one
	left                       // gave up: waited in vain, or abandoned
)

func newGate(slots int) *gate { return &gate{slots: slots, free: slots} }

// held is how many slots are held: the handlers running, or about to.
func (g *gate) held() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.slots - g.free
}

// enter gives the next delivery a new ticket (add). Calls must come in
// delivery order.
func (g *gate) enter() *ticket {
	t := new(ticket)
	g.add(t)
	return t
}

// add enters t, a zero ticket, for the next delivery. Calls must come in
// delivery order.
func (g *gate) add(t *ticket) {
	g.mu.Lock()
	g.queue = append(g.queue, t)
	g.mu.Unlock()
}

// submit enters t, the zero ticket of job t.job, for the next delivery,
// waiting for a slot: t.workers start the job once it has one. Calls must
// come in delivery order.
func (g *gate) submit(t *ticket) {
	g.mu.Lock()
	t.state = waiting
	g.queue = append(g.queue, t)
	g.grant()
	g.mu.Unlock()
}

// abandon takes the tickets of w's jobs still waiting for a slot out of
// the gate, as left, and returns their jobs, in delivery order: w starts
// none of them afterwards.
func (g *gate) abandon(w *workers) []*job {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []*job
	kept := g.queue[:0]
	for _, t := range g.queue {
		if t.workers == w && t.state != left {
			t.state = left
			out = append(out, t.job)
			continue
		}
		kept = append(kept, t)
	}
	clear(g.queue[len(kept):])
	g.queue = kept
	g.grant()
	return out
}

// wait is waitOn with a channel of its own, made only if it must wait.
func (g *gate) wait(ctx context.Context, stopping <-chan struct{}, t *ticket) bool {
	return g.waitOn(ctx, stopping, t, nil)
}

// waitOn waits until t holds a slot. It reports false, holding no slot,
// when stopping is closed or ctx is done first. A ticket that holds its
// slot already (an earlier wait reported true) reports true again, unless
// stopping is closed: then the slot is given back. A ticket that left
// reports false at once. wake, empty and buffered (a token at most), is
// what it waits on for the slot if it must (nil: one made then), and is
// empty again when it returns: a goroutine passes the same channel for
// every ticket it waits for, one at a time, rather than a channel per
// ticket.
func (g *gate) waitOn(ctx context.Context, stopping <-chan struct{}, t *ticket, wake chan struct{}) bool {
	g.mu.Lock()
	switch t.state {
	case left:
		g.mu.Unlock()
		return false
	case pending:
		t.state = waiting
		g.grant()
	}
	if t.state == granted {
		g.mu.Unlock()
		select {
		case <-stopping:
			g.leave(t)
			return false
		default:
			return true
		}
	}
	if wake == nil {
		wake = make(chan struct{}, 1)
	}
	t.wake = wake
	g.mu.Unlock()
	select {
	case <-wake:
		select {
		case <-stopping: // both were ready and the slot won: stopping wins
		default:
			return true
		}
	case <-stopping:
	case <-ctx.Done():
	}
	g.leave(t)
	return false
}

// leave gives t up, whatever its state, when no wait on t is under way: a
// ticket that never waited (its delivery is abandoned) no longer holds
// later tickets back, a slot wait handed to t is given back (call it only
// while that slot is t's: not after release gave it back), and a later
// wait on t reports false at once. It is a no-op on a ticket that left
// already.
func (g *gate) leave(t *ticket) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch t.state {
	case left:
		return
	case granted:
		g.free++
		// A slot granted as its wait gave up left a token: taken, so
		// that the channel's next wait does not take it for its own.
		select {
		case <-t.wake:
		default:
		}
	}
	t.state = left
	g.grant()
}

// release gives back a slot that wait handed out.
func (g *gate) release() {
	g.mu.Lock()
	g.free++
	g.grant()
	g.mu.Unlock()
}

// grant hands free slots to the oldest tickets, in order, for as long as
// the oldest one is waiting. g.mu is held.
func (g *gate) grant() {
	n := 0
	for ; n < len(g.queue); n++ {
		t := g.queue[n]
		if t.state == left {
			continue
		}
		if t.state != waiting || g.free == 0 {
			break
		}
		g.free--
		t.state = granted
		if t.workers != nil {
			t.workers.start(t.job)
			continue
		}
		select {
		case t.wake <- struct{}{}: // set: t waits (waitOn)
		default: // cannot be: a wait's channel is empty
		}
	}
	switch {
	case n == len(g.queue):
		// Emptied: its array is kept, rather than one allocated by the
		// next add.
		clear(g.queue)
		g.queue = g.queue[:0]
	case n > 0:
		clear(g.queue[:n])
		g.queue = g.queue[n:]
	}
}
