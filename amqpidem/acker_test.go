package amqpidem

import (
	"fmt"
	"math/rand"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeChannel keeps the broker's view of one channel's unacked deliveries
// and refuses what RabbitMQ refuses: settling a tag that is not unacked.
type fakeChannel struct {
	mu       sync.Mutex
	unacked  map[uint64]bool
	acked    map[uint64]bool
	nacked   map[uint64]bool
	frames   []string
	problems []string
	// quick settles a single ack without walking unacked, for tests that
	// settle many tags. The others keep the walk: it makes a frame slow
	// to write, and TestAckerConcurrent's fold ratio depends on that.
	quick bool
}

func newFakeChannel(n int) *fakeChannel {
	f := &fakeChannel{unacked: map[uint64]bool{}, acked: map[uint64]bool{}, nacked: map[uint64]bool{}}
	for tag := uint64(1); tag <= uint64(n); tag++ {
		f.unacked[tag] = true
	}
	return f
}

func (f *fakeChannel) Ack(tag uint64, multiple bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.frames = append(f.frames, fmt.Sprintf("ack %d %v", tag, multiple))
	if !f.unacked[tag] {
		f.problems = append(f.problems, fmt.Sprintf("ack of tag %d that is not unacked", tag))
		return fmt.Errorf("unknown delivery tag %d", tag)
	}
	if f.quick && !multiple {
		delete(f.unacked, tag)
		f.acked[tag] = true
		return nil
	}
	for t := range f.unacked {
		if t == tag || multiple && t < tag {
			delete(f.unacked, t)
			f.acked[t] = true
		}
	}
	return nil
}

func (f *fakeChannel) Nack(tag uint64, multiple, requeue bool) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.frames = append(f.frames, fmt.Sprintf("nack %d", tag))
	if !f.unacked[tag] {
		f.problems = append(f.problems, fmt.Sprintf("nack of tag %d that is not unacked", tag))
	}
	delete(f.unacked, tag)
	f.nacked[tag] = true
	return nil
}

// left returns the unacked tags and the problems so far.
func (f *fakeChannel) left() (int, []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.unacked), append([]string(nil), f.problems...)
}

func (f *fakeChannel) Reject(tag uint64, requeue bool) error { return f.Nack(tag, false, requeue) }

func TestAckerFoldsInOrderAcks(t *testing.T) {
	f := newFakeChannel(3)
	a := newAcker(f, 0)
	_ = a.Ack(2, false) // held: 1 is not settled
	_ = a.Ack(3, false)
	if len(f.frames) != 0 {
		t.Fatalf("acks above the frontier were sent at once: %v", f.frames)
	}
	_ = a.Ack(1, false)
	waitFrames(t, f, 1)
	if got, want := fmt.Sprint(f.frames), "[ack 3 true]"; got != want {
		t.Fatalf("frames: got %v, want %v", got, want)
	}
	a.flush()
	if n, problems := f.left(); n != 0 || len(problems) != 0 {
		t.Fatalf("unacked %d, problems %v", n, problems)
	}
}

// waitFrames waits until f has at least n frames.
func waitFrames(t *testing.T, f *fakeChannel, n int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		f.mu.Lock()
		got := len(f.frames)
		f.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d frames after 2s, want %d", got, n)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// waitUnacked waits until f has n unacked tags left, for at most 2s
// (ackHold is 20ms).
func waitUnacked(t *testing.T, f *fakeChannel, n int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		left, _ := f.left()
		if left == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d unacked after 2s (ackHold %v), want %d", left, ackHold, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// Acks that come in order fold as well: one frame for a run of them, sent
// within ackFlush, or at once when ackBatch are held.
func TestAckerBatchesInOrderAcks(t *testing.T) {
	f := newFakeChannel(ackBatch + 10)
	a := newAcker(f, 0)
	for tag := uint64(1); tag <= 10; tag++ {
		_ = a.Ack(tag, false)
	}
	// One frame, or two if this goroutine was held up past ackFlush
	// in the middle of the loop.
	waitFrames(t, f, 1)
	time.Sleep(2 * ackFlush) // room for a wrong second frame
	f.mu.Lock()
	if n, last := len(f.frames), f.frames[len(f.frames)-1]; n > 2 || last != "ack 10 true" {
		t.Fatalf("frames for 10 in-order acks: %v, want [ack 10 true]", f.frames)
	}
	f.mu.Unlock()
	for tag := uint64(11); tag < 11+ackBatch; tag++ {
		_ = a.Ack(tag, false)
	}
	// At once, without waiting for the timer (which may also have fired
	// in between on a slow machine, adding a frame).
	f.mu.Lock()
	last := f.frames[len(f.frames)-1]
	f.mu.Unlock()
	if want := fmt.Sprintf("ack %d true", 10+ackBatch); last != want {
		t.Fatalf("after %d more acks: last frame %q, want %q at once", ackBatch, last, want)
	}
	a.flush()
	if n, problems := f.left(); n != 0 || len(problems) != 0 {
		t.Fatalf("unacked %d, problems %v", n, problems)
	}
}

// With a small prefetch count, a batch is half of it: the acks go out
// while the broker still has credit, rather than after ackFlush with all
// the consumer's deliveries acked and none coming.
func TestAckerBatchFollowsPrefetch(t *testing.T) {
	const prefetch = 8
	f := newFakeChannel(prefetch)
	a := newAcker(f, prefetch)
	for tag := uint64(1); tag <= prefetch/2; tag++ {
		_ = a.Ack(tag, false)
	}
	f.mu.Lock()
	frames := append([]string(nil), f.frames...)
	f.mu.Unlock()
	if want := fmt.Sprintf("ack %d true", prefetch/2); len(frames) == 0 || frames[len(frames)-1] != want {
		t.Fatalf("after %d in-order acks with prefetch %d: frames %v, want %q at once", prefetch/2, prefetch, frames, want)
	}
	a.flush()
	if n, problems := f.left(); n != prefetch/2 || len(problems) != 0 {
		t.Fatalf("unacked %d (want the %d never acked), problems %v", n, prefetch/2, problems)
	}
}

func TestAckerNeverCoversANack(t *testing.T) {
	f := newFakeChannel(3)
	a := newAcker(f, 0)
	_ = a.Ack(3, false)
	_ = a.Nack(2, false, true)
	_ = a.Ack(1, false)
	a.flush()
	if !f.nacked[2] || f.acked[2] || len(f.problems) != 0 {
		t.Fatalf("tag 2 must be nacked, never acked: frames %v problems %v", f.frames, f.problems)
	}
	if len(f.unacked) != 0 {
		t.Fatalf("unacked left: %v", f.unacked)
	}
}

func TestAckerDoesNotHoldForever(t *testing.T) {
	f := newFakeChannel(5)
	a := newAcker(f, 0)
	for tag := uint64(2); tag <= 5; tag++ {
		_ = a.Ack(tag, false) // 1 is a long job
	}
	waitUnacked(t, f, 1) // the held acks went out after ackHold
	_ = a.Ack(1, false)
	a.flush()
	if len(f.unacked) != 0 || len(f.problems) != 0 {
		t.Fatalf("unacked %v problems %v frames %v", f.unacked, f.problems, f.frames)
	}
}

// An ack above a gap that comes while in-order acks are held (so more than
// one ack is held) is still sent within ackHold: a slow message must not
// keep the quick ones after it unacked until it ends.
func TestAckerHoldsAboveAGapForAckHoldOnly(t *testing.T) {
	f := newFakeChannel(5)
	a := newAcker(f, 0)
	_ = a.Ack(1, false) // in order: held up to ackFlush
	_ = a.Ack(3, false) // 2 is a long job
	waitFrames(t, f, 1) // 1 went out after ackFlush
	_ = a.Ack(4, false)
	_ = a.Ack(5, false)
	waitUnacked(t, f, 1) // the acks above the gap went out after ackHold
	_ = a.Ack(2, false)
	a.flush()
	if n, problems := f.left(); n != 0 || len(problems) != 0 {
		t.Fatalf("unacked %d, problems %v", n, problems)
	}
}

func TestAckerBoundsHeldAcks(t *testing.T) {
	f := newFakeChannel(ackHeldMax + 2)
	a := newAcker(f, 0)
	for tag := uint64(2); tag <= ackHeldMax+2; tag++ {
		_ = a.Ack(tag, false)
	}
	f.mu.Lock()
	n := len(f.unacked)
	f.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d acks held: got %d unacked, want only the frontier", ackHeldMax+1, n)
	}
	a.flush()
}

// A long job at the frontier with a small prefetch count: the acks of the
// quick messages after it go out once half the prefetch is held, at once,
// not after ackHold, so that the broker has credit to deliver more.
func TestAckerHeldAcksLeaveCredit(t *testing.T) {
	const prefetch = 8
	f := newFakeChannel(prefetch)
	a := newAcker(f, prefetch)
	for tag := uint64(2); tag <= prefetch/2+2; tag++ {
		_ = a.Ack(tag, false) // 1 is a long job
	}
	f.mu.Lock()
	n := len(f.unacked)
	f.mu.Unlock()
	if want := prefetch - (prefetch/2 + 1); n != want {
		t.Fatalf("%d acks above the gap with prefetch %d: %d unacked at once, want %d (the frontier and the tags never acked)",
			prefetch/2+1, prefetch, n, want)
	}
	a.flush()
}

// Many goroutines settle tags out of order: every tag is settled once and
// nacks are never covered by an ack. When the disorder is local, as with
// handlers finishing around the same time, the acks fold into far fewer
// frames; fully shuffled, they still all get through.
//
// For the fold count the acker holds acks above the frontier for as long
// and as many as it takes: with ackHold and ackHeldMax, a goroutine that
// the scheduler leaves holding the frontier tag for 20 ms (or while 64
// others are settled) turned the held acks into single frames, and 4 runs
// in 40 crossed the bound on an idle machine (2,589-3,383 frames). Those
// two limits have tests of their own.
func TestAckerConcurrent(t *testing.T) {
	for _, window := range []int{32, 5000} {
		t.Run(fmt.Sprint("shuffled within ", window), func(t *testing.T) {
			const n = 5000
			f := newFakeChannel(n)
			a := newAcker(f, 0)
			if window == 32 {
				a.hold, a.heldMax = time.Hour, n
			}
			tags := make([]uint64, 0, n)
			for start := 0; start < n; start += window {
				for _, i := range rand.Perm(min(window, n-start)) {
					tags = append(tags, uint64(start+i+1))
				}
			}
			var wg sync.WaitGroup
			work := make(chan uint64)
			for range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for tag := range work {
						if tag%97 == 0 {
							_ = a.Nack(tag, false, true)
						} else {
							_ = a.Ack(tag, false)
						}
					}
				}()
			}
			for _, tag := range tags {
				work <- tag
			}
			close(work)
			wg.Wait()
			a.flush()
			if len(f.unacked) != 0 || len(f.problems) != 0 {
				t.Fatalf("unacked %d problems %v", len(f.unacked), f.problems)
			}
			for tag := range f.nacked {
				if f.acked[tag] || tag%97 != 0 {
					t.Fatalf("tag %d both nacked and acked, or nacked by mistake", tag)
				}
			}
			t.Logf("%d tags settled with %d frames", n, len(f.frames))
			if window == 32 && len(f.frames) > n/2 {
				t.Fatalf("%d frames for %d tags shuffled within %d: acks not folded", len(f.frames), n, window)
			}
		})
	}
}

// A slow delivery pins the frontier while the ones after it are settled, as
// a 10-minute job does at 5k msg/s: the acker remembers the tags not
// settled yet and the held acks, not every tag settled above the slow one.
func TestAckerForgetsTagsSettledAboveASlowOne(t *testing.T) {
	const n = 200_000
	slow := []uint64{1, n / 3, 2 * n / 3}
	isSlow := func(tag uint64) bool { return tag == slow[0] || tag == slow[1] || tag == slow[2] }
	f := newFakeChannel(n)
	f.quick = true
	a := newAcker(f, 0)
	// Settled out of order within windows of 32, as handlers finishing
	// around the same time are, and delivered as the broker does: no more
	// than prefetch unacked. The acker remembers the unsettled tags (3+31
	// at most), their gaps entries (twice as many, plus gapSlack) and the
	// held acks (unacked at the broker: prefetch at most). Far from n.
	const prefetch = 1024
	bound := prefetch + 3*(len(slow)+32) + gapSlack
	for start := 1; start <= n; start += 32 {
		waitBroker(t, f, func(unacked int) bool { return (start-1)-(n-unacked)+32 <= prefetch })
		for _, i := range rand.Perm(min(32, n-start+1)) {
			tag := uint64(start + i)
			switch {
			case isSlow(tag):
			case tag%97 == 0:
				_ = a.Nack(tag, false, true)
			default:
				_ = a.Ack(tag, false)
			}
		}
		if size := a.size(); size > bound {
			t.Fatalf("after tags 1 to %d: the acker remembers %d tags, want at most %d", start+31, size, bound)
		}
	}
	waitUnacked(t, f, len(slow)) // the held acks went out after ackHold
	if size, want := a.size(), len(slow)+2*len(slow)+gapSlack; size > want {
		t.Fatalf("held acks sent, %d unsettled: the acker remembers %d tags, want at most %d", len(slow), size, want)
	}
	// The slow ones end: one acked above a gap, one requeued, then the
	// frontier.
	_ = a.Ack(slow[2], false)
	_ = a.Nack(slow[1], false, true)
	_ = a.Ack(slow[0], false)
	a.flush()
	if left, problems := f.left(); left != 0 || len(problems) != 0 {
		t.Fatalf("unacked %d, problems %v", left, problems)
	}
	for tag := range f.nacked {
		if f.acked[tag] || tag%97 != 0 && tag != slow[1] {
			t.Fatalf("tag %d both nacked and acked, or nacked by mistake", tag)
		}
	}
	if size := a.size(); size != 0 {
		t.Fatalf("every tag settled and sent: the acker remembers %d tags, want 0", size)
	}
}

// waitBroker waits until ok(the number of unacked tags in f), for at most
// 2s (ackHold is 20ms).
func waitBroker(t *testing.T, f *fakeChannel, ok func(unacked int) bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		f.mu.Lock()
		unacked := len(f.unacked)
		f.mu.Unlock()
		if ok(unacked) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d unacked after 2s (ackHold %v)", unacked, ackHold)
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// An ack of a tag settled already is written at once, as without the
// acker: it is not folded into a multiple ack, and the broker's refusal is
// returned.
func TestAckerWritesAnAckOfASettledTagAtOnce(t *testing.T) {
	f := newFakeChannel(2)
	a := newAcker(f, 0)
	_ = a.Nack(1, false, true)
	if err := a.Ack(1, false); err == nil {
		t.Fatalf("ack of a nacked tag: no error; frames %v", f.frames)
	}
	if got, want := fmt.Sprint(f.frames), "[nack 1 ack 1 false]"; got != want {
		t.Fatalf("frames: got %v, want %v", got, want)
	}
	_ = a.Ack(2, false)
	a.flush()
	if left, problems := f.left(); left != 0 || len(problems) != 1 {
		t.Fatalf("unacked %d, problems %v, want only the ack of tag 1", left, problems)
	}
}

// A tag far above every tag settled so far cannot be a delivery of this
// channel: its ack is written at once, and the acker does not record the
// tags skipped over.
func TestAckerWritesAnAckFarAboveAtOnce(t *testing.T) {
	f := newFakeChannel(1)
	a := newAcker(f, 0)
	const far = 1 << 40
	if err := a.Ack(far, false); err == nil {
		t.Fatalf("ack of tag %d: no error; frames %v", uint64(far), f.frames)
	}
	if size := a.size(); size != 0 {
		t.Fatalf("after an ack of tag %d the acker remembers %d tags, want 0", uint64(far), size)
	}
	_ = a.Ack(1, false)
	a.flush()
	if got, want := fmt.Sprint(f.frames), fmt.Sprintf("[ack %d false ack 1 true]", uint64(far)); got != want {
		t.Fatalf("frames: got %v, want %v", got, want)
	}
}

// The pattern of a batch consumer (prefetch twice the batch size, two
// batches at once): the second batch settles before the first, and each
// batch's acks come in another order than their tags. Every ack is
// folded into a multiple ack: none goes out alone (issue 39: with at
// most 64 held, about 0.5 ack frames per message went out, most of them
// single acks).
func TestAckerFoldsBatchesSettledOutOfOrder(t *testing.T) {
	const size, prefetch, rounds = 100, 200, 5
	f := newFakeChannel(rounds * prefetch)
	f.quick = true
	a := newAcker(f, prefetch)
	a.hold = time.Hour // the count bound alone, not a slow goroutine
	a.holdBatches()
	shuffled := func(from uint64) []uint64 {
		tags := make([]uint64, 0, size)
		for _, i := range rand.Perm(size) {
			tags = append(tags, from+uint64(i))
		}
		return tags
	}
	for r := range uint64(rounds) {
		base := r * prefetch
		for _, tag := range append(shuffled(base+size+1), shuffled(base+1)...) {
			_ = a.Ack(tag, false)
		}
	}
	a.flush()
	n, problems := f.left()
	if n != 0 || len(problems) != 0 {
		t.Fatalf("unacked %d, problems %v", n, problems)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	single := 0
	for _, fr := range f.frames {
		if strings.HasSuffix(fr, " false") {
			single++
		}
	}
	t.Logf("%d tags in batches of %d settled out of order: %d frames, %d single", rounds*prefetch, size, len(f.frames), single)
	// A multiple ack once the frontier has passed ackBatch tags: at most
	// about prefetch/ackBatch frames per round.
	if single != 0 || len(f.frames) > rounds*(prefetch/ackBatch+1) {
		t.Fatalf("%d frames, %d of them single acks, for %d tags: want none single, at most %d", len(f.frames), single,
			rounds*prefetch, rounds*(prefetch/ackBatch+1))
	}
}

// A long batch at the frontier does not stop the rest: the acks of the
// batch after it are held for ackHold (a.hold) once, then go out one by
// one, and so do those of later batches at once, not after another
// ackHold each, until the frontier moves; then they fold again.
func TestAckerStuckFrontierHeldOnce(t *testing.T) {
	const size, prefetch = 10, 20
	f := newFakeChannel(5 * size)
	a := newAcker(f, prefetch)
	a.hold = 200 * time.Millisecond
	a.holdBatches()
	for tag := uint64(size + 1); tag <= 2*size; tag++ {
		_ = a.Ack(tag, false) // 1..size: the long batch
	}
	if n, _ := f.left(); n != 5*size {
		t.Fatalf("%d unacked right after the second batch, want its acks held (%d)", n, 5*size)
	}
	waitUnacked(t, f, 5*size-size) // after a.hold, one by one
	for tag := uint64(2*size + 1); tag <= 3*size; tag++ {
		_ = a.Ack(tag, false)
	}
	if n, _ := f.left(); n != 5*size-2*size {
		t.Fatalf("%d unacked right after the third batch, want its acks sent at once (%d)", n, 5*size-2*size)
	}
	for tag := uint64(1); tag <= size; tag++ {
		_ = a.Ack(tag, false) // the long batch ends: the frontier moves
	}
	f.mu.Lock()
	before := len(f.frames)
	f.mu.Unlock()
	for tag := uint64(4 * size); tag > 3*size; tag-- {
		_ = a.Ack(tag, false) // above the new frontier, 3*size+1: held again
	}
	waitUnacked(t, f, size)
	a.flush()
	f.mu.Lock()
	defer f.mu.Unlock()
	if got := f.frames[before:]; len(got) != 1 || got[0] != fmt.Sprintf("ack %d true", 4*size) {
		t.Fatalf("frames once the frontier moved: %v, want [ack %d true]", got, 4*size)
	}
	if len(f.problems) != 0 {
		t.Fatalf("problems %v", f.problems)
	}
}
