package amqpidem

import (
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ackHold bounds how long an ack may be held back waiting to be folded into
// a multiple ack, and ackHeldMax how many may be held.
const (
	ackHold    = 20 * time.Millisecond
	ackHeldMax = 64
)

// acker settles the deliveries of one channel, the one they came from,
// folding acks together: "ack every delivery up to tag t" is one frame for
// the broker to handle instead of one per message (a bare consumer runs
// about half again as fast that way here).
//
// Tags are settled in any order. An ack of the lowest unsettled tag (the
// frontier) is sent at once, as a multiple ack of every held ack the
// frontier then passes. An ack above the frontier is held, for at most
// ackHold and while fewer than ackHeldMax are held, in case the frontier
// catches up; then the held acks go out one by one. Nacks and rejects go
// out at once, and a tag counts as settled only after its frame is written,
// so a multiple ack never covers a tag that was to be requeued.
//
// acker is safe for concurrent use. It implements amqp.Acknowledger so
// that processing code acks a delivery as usual.
type acker struct {
	ch amqp.Acknowledger

	mu      sync.Mutex
	next    uint64          // lowest tag not settled yet
	settled map[uint64]bool // settled tags >= next: true while the ack is held
	held    int             // acks held back
	sending bool            // a goroutine is writing acks; others leave theirs to it
	timer   *time.Timer     // flushes held acks after ackHold
	err     error           // the last write error
	closed  bool
}

func newAcker(ch amqp.Acknowledger) *acker {
	return &acker{ch: ch, next: 1, settled: make(map[uint64]bool)}
}

// Ack acknowledges tag. The frame may go out later, folded into a multiple
// ack; a write error is reported by a later call, and the broker then
// delivers the message again.
func (a *acker) Ack(tag uint64, multiple bool) error {
	if multiple {
		return a.sent(tag, a.ch.Ack(tag, true))
	}
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return a.ch.Ack(tag, false)
	}
	a.settled[tag] = true
	a.held++
	if a.held == 1 && tag != a.next {
		a.armTimer()
	}
	return a.write(false) // unlocks
}

// Nack sends a nack for tag at once.
func (a *acker) Nack(tag uint64, multiple, requeue bool) error {
	return a.sent(tag, a.ch.Nack(tag, multiple, requeue))
}

// Reject sends a reject for tag at once.
func (a *acker) Reject(tag uint64, requeue bool) error {
	return a.sent(tag, a.ch.Reject(tag, requeue))
}

// sent records a tag whose frame was written (or failed to be).
func (a *acker) sent(tag uint64, err error) error {
	a.mu.Lock()
	if !a.closed {
		a.settled[tag] = false
	}
	_ = a.write(false) // unlocks; the frontier may have moved
	return err
}

// flush sends every held ack, one by one where need be, and stops holding:
// later acks are sent at once. Call it before the channel closes.
func (a *acker) flush() {
	a.mu.Lock()
	a.closed = true
	if a.timer != nil {
		a.timer.Stop()
	}
	_ = a.write(true) // unlocks
}

func (a *acker) armTimer() {
	if a.timer == nil {
		a.timer = time.AfterFunc(ackHold, func() {
			a.mu.Lock()
			_ = a.write(true) // unlocks
		})
		return
	}
	a.timer.Reset(ackHold)
}

// write sends what is due, with a.mu held on entry; it unlocks. all sends
// every held ack. Only one goroutine writes at a time; the others' acks are
// picked up by its next round.
func (a *acker) write(all bool) error {
	if a.sending {
		err := a.err
		a.mu.Unlock()
		return err
	}
	a.sending = true
	for {
		// Move the frontier over settled tags; the highest held one among
		// them is acked with multiple, covering all held below it.
		var upto uint64
		for {
			h, ok := a.settled[a.next]
			if !ok {
				break
			}
			if h {
				upto = a.next
				a.held--
			}
			delete(a.settled, a.next)
			a.next++
		}
		var single []uint64
		if all || a.held > ackHeldMax {
			for tag, h := range a.settled {
				if h {
					single = append(single, tag)
					a.settled[tag] = false
				}
			}
			a.held = 0
			all = false
		}
		if upto == 0 && len(single) == 0 {
			break
		}
		a.mu.Unlock()
		var err error
		if upto != 0 {
			err = a.ch.Ack(upto, true)
		}
		for _, tag := range single {
			if e := a.ch.Ack(tag, false); e != nil {
				err = e
			}
		}
		a.mu.Lock()
		if err != nil {
			a.err = err
		}
	}
	a.sending = false
	err := a.err
	a.mu.Unlock()
	return err
}
