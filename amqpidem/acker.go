package amqpidem

import (
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ackHold bounds how long an ack above a gap may be held back waiting to be
// folded into a multiple ack, and ackHeldMax how many may be held (at
// most half the prefetch count, so that a long job at the frontier leaves
// the broker credit for the quick messages after it; a batch consumer's
// acker holds up to the prefetch count, see holdBatches). ackFlush is how
// long acks the frontier has passed wait for more to join them in one
// frame, unless the frontier has passed a batch of tags since the last
// multiple ack: half the prefetch count, at most ackBatch, so that acks go
// out while the broker still has credit to deliver more.
//
// Bigger batches (64 rather than 32 at a prefetch of 128, 2 ms rather
// than 1) cut ack frames on quorum queues, where the broker's cost is per
// frame (issue 26).
const (
	ackHold    = 20 * time.Millisecond
	ackHeldMax = 64
	ackFlush   = 2 * time.Millisecond
	ackBatch   = 64
)

// gapSlack is how many settled tags gaps may keep, beyond as many as it has
// unsettled ones, before it is compacted.
const gapSlack = 64

// maxSkip bounds how far above every tag settled so far a tag may be: the
// tags in between are all delivered and unsettled, and a prefetch count (a
// 16-bit number) keeps the broker from sending more than 65535 of them.
// A tag beyond it is not from this channel's deliveries, and is not
// recorded (which would take a gap entry per tag skipped).
const maxSkip = 1 << 16

// acker settles the deliveries of one channel, the one they came from,
// folding acks together: "ack every delivery up to tag t" is one frame for
// the broker to handle instead of one per message (a bare consumer runs
// about half again as fast that way here).
//
// Tags are settled in any order. Acks the frontier (the lowest unsettled
// tag) can pass go out as one multiple ack, ackFlush after the first of
// them or as soon as the frontier passed a batch of tags since the last
// multiple ack, whichever comes first: acks that arrive in order fold too.
// An ack above the frontier is held, for at most ackHold and while no more
// than heldMax are held, in case the frontier catches up; then the held
// acks go out one by one. A frontier that ackHold passed without moving is
// stuck (a long job, a long batch): acks above it go out one by one at
// once, not held again for ackHold, until it moves. Nacks and
// rejects go out at once, and a tag counts as settled only after its frame
// is written (or failed to be, after which no frame of the channel reaches
// the broker: see sent), so a multiple ack never covers a tag that was to
// be requeued. A held ack lost with its connection is like any ack the broker
// never got: the message is delivered again. After a completed handler
// that redelivery is acked as a duplicate; after a requeue or a dead
// letter, the copy already published and the redelivered original both
// exist, and the store decides the original again.
//
// The acker remembers the unsettled tags rather than the settled ones. The
// broker numbers a channel's deliveries 1, 2, 3... and hands them out in
// that order, so when tag t is settled every tag below it has been
// delivered: each tag up to top, the highest settled so far, is either
// settled or in unsettled. Settling a tag above top puts the tags skipped
// over in unsettled, and in gaps, which lists them lowest first; settling
// one of them takes it out of unsettled. The frontier, next, is the lowest
// tag in unsettled, or top+1: when it is settled, it moves to the first
// entry of gaps still unsettled, dropping the settled ones before it.
// Settled tags elsewhere in gaps are dropped when they make up most of it.
// Each tag enters and leaves gaps once, so an ack costs O(1) amortized
// however far above the frontier it is; a tag settled above the frontier
// is forgotten once its frame is written, so memory is bounded by the
// deliveries not settled yet (the prefetch count at most) and the held acks
// (held), not by how many tags went by above a slow delivery.
//
// An ack of a tag already settled, of tag 0 or of one more than maxSkip
// above every tag settled so far is written at once, as it would be
// without the acker, and the broker refuses it.
//
// acker is safe for concurrent use. It implements amqp.Acknowledger so
// that processing code acks a delivery as usual.
type acker struct {
	ch   amqp.Acknowledger // the channel the deliveries came from
	dead <-chan struct{}   // closed when that channel died; nil: never known

	batch    int           // tags the frontier passed whose acks go out at once, without waiting ackFlush
	heldMax  int           // acks above the frontier held at most
	hold     time.Duration // how long acks above the frontier are held at most: ackHold
	prefetch int           // the consumer's prefetch count; 0: not known

	mu        sync.Mutex          // guards the fields below
	next      uint64              // the frontier: the lowest tag not settled
	top       uint64              // highest tag settled; every tag up to it was delivered
	unsettled map[uint64]struct{} // tags below top not settled yet
	gaps      []uint64            // from head on, the tags of unsettled lowest first, and settled ones not dropped yet
	head      int                 // where gaps starts; the entries before it are dropped
	held      []uint64            // acked tags whose frame is not written yet, in arrival order
	heldLow   uint64              // lowest tag in held, when held is not empty
	out       []uint64            // held acks being written one by one; used by the writer only
	sending   bool                // a goroutine is writing acks; others leave theirs to it
	idle      *sync.Cond          // signalled when sending ends
	sendAll   bool                // the writing goroutine is to send held acks too
	sentUpto  uint64              // the frontier, less one, when the held acks it passed were last written
	timer     *time.Timer         // flushes held acks after ackHold
	timerOn   bool                // timer is armed
	holdFrom  uint64              // the frontier when timer was armed
	stuck     uint64              // a frontier ackHold passed without its moving; 0: none
	due       *time.Timer         // sends what the frontier passed after ackFlush
	dueSet    bool                // due is armed
	err       error               // the last write error
	closed    bool                // flush was called: acks are written at once
}

// newAcker returns an acker for the deliveries of ch, whose consumer has
// prefetch unacknowledged deliveries at most (0: not known; the limits
// are then ackBatch and ackHeldMax).
func newAcker(ch amqp.Acknowledger, prefetch int) *acker {
	a := &acker{ch: ch, next: 1, unsettled: make(map[uint64]struct{}), batch: ackBatch, heldMax: ackHeldMax, hold: ackHold, prefetch: prefetch}
	if prefetch > 0 {
		a.batch = max(1, min(ackBatch, prefetch/2))
		a.heldMax = max(1, min(ackHeldMax, prefetch/2))
	}
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
	if a.closed || !a.settle(tag) {
		a.mu.Unlock()
		return a.ch.Ack(tag, false)
	}
	if len(a.held) == 0 || tag < a.heldLow {
		a.heldLow = tag
	}
	a.held = append(a.held, tag)
	if tag > a.next {
		if a.next == a.stuck {
			return a.write(true) // unlocks
		}
		a.armTimer() // above a gap: held for at most ackHold
	}
	if a.next-1-a.sentUpto < uint64(a.batch) && len(a.held) <= a.heldMax {
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

// sent records a tag whose frame was written (or failed to be). A frame
// that failed counts as settled too, so that the frontier moves on: a
// multiple ack then covering the tag cannot reach the broker, since
// amqp091-go fails every frame after one failed on a channel (closed:
// ErrClosed) or its connection (a write error is kept by its
// bufio.Writer and shuts the connection down; amqpidem refuses automatic
// recovery, which would reopen the channel), and the broker requeues
// what a closed channel left unsettled
// (TestHobs2AckerFailedNackNotCoveredByMultipleAck).
func (a *acker) sent(tag uint64, err error) error {
	a.mu.Lock()
	if !a.closed {
		a.settle(tag)
	}
	_ = a.write(false) // unlocks; the frontier may have moved
	return err
}

// holdBatches makes a holds acks above the frontier up to the prefetch
// count rather than half of it, for a batch consumer: its deliveries
// settle a batch at a time, and when a batch settles before an earlier
// one, or the members of one batch in another order than their tags, the
// acks above the frontier are of deliveries whose batch is over, waiting
// for a batch that is running too. Held, they fold into one multiple ack
// when it settles; sent once half the prefetch is held, most went one by
// one (issue 39). A long batch at the frontier holds them for ackHold, at
// most, once: its frontier is then stuck, and acks above it go out at
// once. Calls after the first do nothing more; without a known prefetch
// count it does nothing.
func (a *acker) holdBatches() {
	a.mu.Lock()
	a.heldMax = max(a.heldMax, a.prefetch)
	a.mu.Unlock()
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

// armTimer makes sure held acks are all sent within a.hold (ackHold),
// unless it is armed already.
func (a *acker) armTimer() {
	if a.timerOn || a.closed {
		return
	}
	a.timerOn = true
	a.holdFrom = a.next
	if a.timer == nil {
		a.timer = time.AfterFunc(a.hold, func() {
			a.mu.Lock()
			a.timerOn = false
			if a.next == a.holdFrom && len(a.held) > 0 {
				a.stuck = a.next
			}
			_ = a.write(true) // unlocks
		})
		return
	}
	a.timer.Reset(a.hold)
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
		// The highest held ack the frontier passed is acked with
		// multiple, covering all held below it; the tags in between were
		// settled already, and the broker skips those.
		var upto uint64
		a.sentUpto = a.next - 1 // what it passed is written below, or was
		if next := a.next; len(a.held) > 0 && a.heldLow < next {
			kept := a.held[:0]
			for _, tag := range a.held {
				if tag < next {
					upto = max(upto, tag)
					continue
				}
				if len(kept) == 0 || tag < a.heldLow {
					a.heldLow = tag
				}
				kept = append(kept, tag)
			}
			a.held = kept
		}
		single := a.out[:0]
		if all || len(a.held) > a.heldMax {
			single = append(single, a.held...)
			a.held = a.held[:0]
			all = false
		}
		a.out = single
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
	if len(a.held) > 0 {
		a.armTimer() // acks left above a gap
	}
	a.sending = false
	a.idle.Broadcast()
	err := a.err
	a.mu.Unlock()
	return err
}

// settle records tag as settled, with a.mu held, and reports whether it was
// not settled yet (false for a tag beyond maxSkip, not recorded). Every tag below a newly seen one has been delivered, so
// those not settled yet become gaps.
func (a *acker) settle(tag uint64) bool {
	if tag > a.top+maxSkip {
		return false // not a delivery of this channel
	}
	if tag > a.top {
		for t := a.top + 1; t < tag; t++ {
			a.unsettled[t] = struct{}{}
			a.gaps = append(a.gaps, t)
		}
		a.top = tag
		if a.next == tag {
			a.next = tag + 1
		}
		return true
	}
	n := len(a.unsettled)
	delete(a.unsettled, tag)
	if len(a.unsettled) == n {
		return false // settled already, or tag 0
	}
	if tag == a.next {
		a.advance()
	}
	if len(a.gaps) > 2*len(a.unsettled)+gapSlack {
		// Most of gaps is settled: drop those, a pass that the
		// settles since the last one pay for.
		live := a.gaps[:0]
		for _, t := range a.gaps[a.head:] {
			if a.isUnsettled(t) {
				live = append(live, t)
			}
		}
		a.gaps, a.head = live, 0
	}
	return true
}

// advance moves the frontier to the lowest tag not settled, with a.mu
// held, after the frontier was settled: the settled tags at the head of
// gaps are dropped on the way.
func (a *acker) advance() {
	for ; a.head < len(a.gaps); a.head++ {
		if t := a.gaps[a.head]; a.isUnsettled(t) {
			a.next = t
			return
		}
	}
	a.gaps, a.head = a.gaps[:0], 0
	a.next = a.top + 1
}

// isUnsettled reports whether tag is one of a.unsettled, with a.mu held.
func (a *acker) isUnsettled(tag uint64) bool {
	_, ok := a.unsettled[tag]
	return ok
}

// size returns how many tags the acker remembers: the unsettled ones, the
// entries of gaps and the held acks. Tests check that it stays bounded.
func (a *acker) size() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.unsettled) + len(a.gaps) + len(a.held)
}
