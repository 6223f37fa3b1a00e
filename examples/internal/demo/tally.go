package demo

import (
	"context"
	"sync"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// Tally is an amqpidem.Observer that counts outcomes, in total and per key,
// and lets a program wait for a condition on the counts instead of
// sleeping. It is safe for concurrent use.
type Tally struct {
	mu      sync.Mutex
	total   map[amqpidem.Outcome]int
	byKey   map[string]map[amqpidem.Outcome]int
	events  []amqpidem.Event
	changed chan struct{}
}

// NewTally returns an empty Tally.
func NewTally() *Tally {
	return &Tally{
		total:   map[amqpidem.Outcome]int{},
		byKey:   map[string]map[amqpidem.Outcome]int{},
		changed: make(chan struct{}, 1),
	}
}

// Observe counts e. amqpidem calls it once per processed delivery.
func (t *Tally) Observe(_ context.Context, e amqpidem.Event) {
	t.mu.Lock()
	t.total[e.Outcome]++
	if t.byKey[e.Key] == nil {
		t.byKey[e.Key] = map[amqpidem.Outcome]int{}
	}
	t.byKey[e.Key][e.Outcome]++
	t.events = append(t.events, e)
	t.mu.Unlock()
	select {
	case t.changed <- struct{}{}:
	default:
	}
}

// Counts is a read-only view of a Tally, valid inside a Wait condition or
// a View call.
type Counts struct{ t *Tally }

// Total is how many deliveries ended with o.
func (c Counts) Total(o amqpidem.Outcome) int { return c.t.total[o] }

// Key is how many deliveries of key ended with o.
func (c Counts) Key(key string, o amqpidem.Outcome) int { return c.t.byKey[key][o] }

// Settled is how many deliveries ended for good: completed, duplicate,
// dead-lettered or dropped. Busy, Retried and Abandoned deliveries come
// back, so once every published message has settled the queue is done.
func (c Counts) Settled() int {
	return c.Total(amqpidem.Completed) + c.Total(amqpidem.Duplicate) +
		c.Total(amqpidem.DeadLettered) + c.Total(amqpidem.Dropped)
}

// Events is every event observed so far, in order.
func (c Counts) Events() []amqpidem.Event { return c.t.events }

// View calls f with the current counts.
func (t *Tally) View(f func(c Counts)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	f(Counts{t})
}

// Wait returns nil once cond holds, or context.Cause(ctx) when ctx ends
// first. One goroutine at a time may Wait.
func (t *Tally) Wait(ctx context.Context, cond func(c Counts) bool) error {
	for {
		t.mu.Lock()
		ok := cond(Counts{t})
		t.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-t.changed:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}
}
