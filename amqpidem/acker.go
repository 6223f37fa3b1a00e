package amqpidem

import (
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ackHold bounds how long an ack above a gap may be held back waiting to be
// folded into a multiple ack, and ackHeldMax how many may be held.
// ackFlush is how long acks the frontier has passed wait for more to join
// them in one frame, unless ackBatch acks are held by then.
const (
	ackHold    = 20 * time.Millisecond
	ackHeldMax = 64
	ackFlush   = time.Millisecond
	ackBatch   = 32
)

// acker settles the deliveries of one channel, the one they came from,
// folding acks together: "ack every delivery up to tag t" is one frame for
// the broker to handle instead of one per message (a bare consumer runs
// about half again as fast that way here).
//
// Tags are settled in any order. Acks the frontier (the lowest unsettled
// tag) can pass go out as one multiple ack, ackFlush after the first of
// them or as soon as ackBatch acks are held, whichever comes first: acks
// that arrive in order fold too. An ack above the frontier is held, for at
// most ackHold and while fewer than ackHeldMax are held, in case the
// frontier catches up; then the held acks go out one by one. Nacks and
// rejects go out at once, and a tag counts as settled only after its frame
// is written, so a multiple ack never covers a tag that was to be
// requeued. A held ack lost with its connection is like any ack the broker
// never got: the message is delivered again. After a completed handler
// that redelivery is acked as a duplicate; after a requeue or a dead
// letter, the copy already published and the redelivered original both
// exist, and the store decides the original again.
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
	idle    *sync.Cond      // signalled when sending ends
	sendAll bool            // the writing goroutine is to send held acks too
	timer   *time.Timer     // flushes held acks after ackHold
	timerOn bool            // timer is armed
	due     *time.Timer     // sends what the frontier passed after ackFlush
	dueSet  bool            // due is armed
	err     error           // the last write error
	closed  bool
}

func newAcker(ch amqp.Acknowledger) *acker {
	a := &acker{ch: ch, next: 1, settled: make(map[uint64]bool)}
	a.idle = sync.NewCond(&a.mu)
	return a
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
	if tag != a.next {
		a.armTimer() // above a gap: held for at most ackHold
	}
	if a.held < ackBatch {
		a.armDue()
		err := a.err
		a.mu.Unlock()
		return err
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
// later acks are sent at once. It returns when nothing is being written.
// Call it before the channel closes.
func (a *acker) flush() {
	a.mu.Lock()
	a.closed = true
	if a.timer != nil {
		a.timer.Stop()
	}
	if a.due != nil {
		a.due.Stop()
	}
	for a.sending {
		a.idle.Wait()
	}
	_ = a.write(true) // unlocks
}

// armTimer makes sure held acks are all sent within ackHold, unless it is
// armed already.
func (a *acker) armTimer() {
	if a.timerOn || a.closed {
		return
	}
	a.timerOn = true
	if a.timer == nil {
		a.timer = time.AfterFunc(ackHold, func() {
			a.mu.Lock()
			a.timerOn = false
			_ = a.write(true) // unlocks
		})
		return
	}
	a.timer.Reset(ackHold)
}

// armDue makes sure what the frontier passes is sent within ackFlush.
func (a *acker) armDue() {
	if a.dueSet || a.closed {
		return
	}
	a.dueSet = true
	if a.due == nil {
		a.due = time.AfterFunc(ackFlush, func() {
			a.mu.Lock()
			a.dueSet = false
			_ = a.write(false) // unlocks
		})
		return
	}
	a.due.Reset(ackFlush)
}

// write sends what is due, with a.mu held on entry; it unlocks. all sends
// every held ack. Only one goroutine writes at a time; the others' acks are
// picked up by its next round.
func (a *acker) write(all bool) error {
	if a.sending {
		a.sendAll = a.sendAll || all
		err := a.err
		a.mu.Unlock()
		return err
	}
	a.sending = true
	for {
		all = all || a.sendAll
		a.sendAll = false
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
	if a.held > 0 {
		a.armTimer() // acks left above a gap
	}
	a.sending = false
	a.idle.Broadcast()
	err := a.err
	a.mu.Unlock()
	return err
}
