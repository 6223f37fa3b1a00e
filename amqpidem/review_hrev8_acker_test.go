package amqpidem

import (
	"fmt"
	"math/rand"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Review h-rev8: a model-based check of the acker. A broker model
// (modelBroker) delivers tags 1..n in order, at most prefetch unsettled
// at a time when the prefetch count is known; workers settle each tag
// after a random delay (some long: a slow job at the frontier), with a
// random mix of acks, nacks and rejects. The test writes down what each
// tag's settle is (its intent) before it calls the acker, and the broker
// model checks every frame it is written against that:
//   - a multiple ack covers only tags the broker still has unacked whose
//     intent is an ack (never one not settled yet, nor one meant for a
//     nack or a reject: that would ack a message meant for requeue);
//   - a frame's own tag is one the broker has unacked (never twice);
//   - a nack or a reject is of a tag meant for it.
//
// And: every tag is settled at the broker exactly once, with its intent,
// without flush (an ack held forever would hold the broker's credit, and
// the dispatcher would wait for it: the test fails by its deadline);
// after flush nothing more is written, even once the timers would have
// fired; and the acker's bookkeeping keeps its invariants throughout
// (sentUpto never above next-1, next never above top+1, held tags unique
// and settled, no more held than heldMax after a write).

// Intents of a tag, before the acker is called.
const (
	intentNone int32 = iota
	intentAck
	intentNack
	intentReject
)

// modelBroker is one channel's deliveries as the broker sees them.
type modelBroker struct {
	mu       sync.Mutex
	cond     *sync.Cond
	n        uint64
	intent   []atomic.Int32 // by tag: what the test meant, set before the call
	meant    []atomic.Int64 // by tag: when (UnixNano) the intent was set
	settled  []int32        // by tag: how the broker settled it (an intent), intentNone while unacked
	lag      time.Duration  // the longest an ack took from its call to its frame
	lagTag   uint64
	unacked  int    // delivered and not settled
	low      uint64 // every tag below it is settled at the broker
	frames   int
	multi    int
	problems []string
	after    bool // flush returned: no frame may come any more
}

func newModelBroker(n int) *modelBroker {
	b := &modelBroker{n: uint64(n), intent: make([]atomic.Int32, n+1), meant: make([]atomic.Int64, n+1), settled: make([]int32, n+1), low: 1}
	b.cond = sync.NewCond(&b.mu)
	return b
}

func (b *modelBroker) problem(format string, args ...any) {
	if len(b.problems) < 20 {
		b.problems = append(b.problems, fmt.Sprintf(format, args...))
	}
}

// settleLocked settles tag at the broker as how, with b.mu held.
func (b *modelBroker) settleLocked(tag uint64, how int32) {
	b.settled[tag] = how
	if lag := time.Duration(time.Now().UnixNano() - b.meant[tag].Load()); how == intentAck && lag > b.lag {
		b.lag, b.lagTag = lag, tag
	}
	b.unacked--
	for b.low <= b.n && b.settled[b.low] != intentNone {
		b.low++
	}
	b.cond.Broadcast()
}

func (b *modelBroker) Ack(tag uint64, multiple bool) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.frames++
	if b.after {
		b.problem("ack %d %v written after flush returned", tag, multiple)
	}
	if tag == 0 || tag > b.n || b.settled[tag] != intentNone {
		b.problem("ack %d %v: tag not unacked", tag, multiple)
		return fmt.Errorf("unknown delivery tag %d", tag)
	}
	if !multiple {
		if in := b.intent[tag].Load(); in != intentAck {
			b.problem("single ack of tag %d whose intent is %d", tag, in)
		}
		b.settleLocked(tag, intentAck)
		return nil
	}
	b.multi++
	for t := b.low; t <= tag; t++ {
		if b.settled[t] != intentNone {
			continue
		}
		if in := b.intent[t].Load(); in != intentAck {
			b.problem("multiple ack %d covers tag %d, unacked at the broker, whose intent is %d (0 none yet, 2 nack, 3 reject)", tag, t, in)
		}
		b.settleLocked(t, intentAck)
	}
	return nil
}

func (b *modelBroker) nack(tag uint64, how int32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.frames++
	if tag == 0 || tag > b.n || b.settled[tag] != intentNone {
		b.problem("nack/reject %d: tag not unacked", tag)
		return fmt.Errorf("unknown delivery tag %d", tag)
	}
	if in := b.intent[tag].Load(); in != how {
		b.problem("nack/reject (%d) of tag %d whose intent is %d", how, tag, in)
	}
	b.settleLocked(tag, how)
	return nil
}

func (b *modelBroker) Nack(tag uint64, multiple, requeue bool) error {
	if multiple {
		b.mu.Lock()
		b.problem("multiple nack %d", tag)
		b.mu.Unlock()
	}
	return b.nack(tag, intentNack)
}

func (b *modelBroker) Reject(tag uint64, requeue bool) error { return b.nack(tag, intentReject) }

// checkAckerInvariants checks a's bookkeeping, under its lock.
func checkAckerInvariants(a *acker) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.next == 0 || a.next > a.top+1:
		return fmt.Sprintf("next %d, top %d: want 1 <= next <= top+1", a.next, a.top)
	case a.sentUpto > a.next-1:
		return fmt.Sprintf("sentUpto %d above next-1 (%d): next-1-sentUpto wraps", a.sentUpto, a.next-1)
	case a.next <= a.top && !a.isUnsettled(a.next):
		return fmt.Sprintf("next %d is settled (top %d)", a.next, a.top)
	}
	for t := range a.unsettled {
		if t < a.next || t >= a.top {
			return fmt.Sprintf("unsettled tag %d outside [next %d, top %d)", t, a.next, a.top)
		}
	}
	seen := make(map[uint64]bool, len(a.held))
	for _, t := range a.held {
		if seen[t] {
			return fmt.Sprintf("tag %d held twice", t)
		}
		seen[t] = true
		if t == 0 || t > a.top || a.isUnsettled(t) {
			return fmt.Sprintf("held tag %d not settled (next %d, top %d)", t, a.next, a.top)
		}
		if t < a.heldLow {
			return fmt.Sprintf("held tag %d below heldLow %d", t, a.heldLow)
		}
	}
	if !a.sending && len(a.held) > a.heldMax {
		return fmt.Sprintf("%d held after a write, heldMax %d", len(a.held), a.heldMax)
	}
	return ""
}

// longJob is how long one job of each run takes; lagSlack how much
// longer than the hold and the flush delay an ack may take to be written
// on a loaded machine.
const (
	longJob  = 1500 * time.Millisecond
	lagSlack = time.Second // still below longJob: an ack held for the long job fails
)

// runAckerModel runs one randomized session of n tags; seed makes it
// repeatable (but for the scheduler).
func runAckerModel(t *testing.T, seed int64, n int) {
	rng := rand.New(rand.NewSource(seed))
	prefetch := []int{0, 1, 2, 8, 20, 64, 200}[rng.Intn(7)]
	batch := rng.Intn(2) == 0
	b := newModelBroker(n)
	a := newAcker(b, prefetch)
	a.hold = time.Duration(1+rng.Intn(8)) * time.Millisecond
	if batch {
		a.holdBatches()
	}
	workers := 1 + rng.Intn(12)
	nackRate := rng.Intn(4) // in 16
	slowRate := rng.Intn(3) // in 64
	desc := fmt.Sprintf("seed %d: n %d prefetch %d batch %v hold %v workers %d nack %d/16 slow %d/64",
		seed, n, prefetch, batch, a.hold, workers, nackRate, slowRate)

	// Each tag's intent and delay, drawn up front (rng is not shared).
	type job struct {
		tag   uint64
		how   int32
		delay time.Duration
	}
	jobs := make([]job, n+1)
	for tag := 1; tag <= n; tag++ {
		j := job{tag: uint64(tag), how: intentAck}
		switch r := rng.Intn(16); {
		case r < nackRate/2+nackRate%2:
			j.how = intentNack
		case r < nackRate:
			j.how = intentReject
		}
		if rng.Intn(64) < slowRate {
			j.delay = time.Duration(5+rng.Intn(30)) * time.Millisecond
		} else {
			j.delay = time.Duration(rng.Intn(300)) * time.Microsecond
		}
		jobs[tag] = j
	}
	// One long job, at the frontier for a while: the acks above it must
	// not wait for it (ackHold at most, then at once).
	long := 1 + rng.Intn(n-1)
	jobs[long].delay = longJob

	stop := make(chan struct{})
	var bad atomic.Pointer[string]
	var checks sync.WaitGroup
	checks.Add(1)
	go func() { // the invariants, now and then
		defer checks.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Microsecond):
			}
			if s := checkAckerInvariants(a); s != "" && bad.Load() == nil {
				bad.Store(&s)
			}
		}
	}()

	work := make(chan job)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range work {
				time.Sleep(j.delay)
				b.meant[j.tag].Store(time.Now().UnixNano())
				b.intent[j.tag].Store(j.how)
				switch j.how {
				case intentAck:
					_ = a.Ack(j.tag, false)
				case intentNack:
					_ = a.Nack(j.tag, false, j.tag%2 == 0)
				case intentReject:
					_ = a.Reject(j.tag, j.tag%2 == 0)
				}
			}
		}()
	}
	// The dispatcher: tags in order, at most prefetch unsettled at the
	// broker. A held ack that is never written holds credit forever.
	stuck := false // under b.mu
	giveUp := time.AfterFunc(20*time.Second, func() {
		b.mu.Lock()
		stuck = true
		b.cond.Broadcast()
		b.mu.Unlock()
	})
	defer giveUp.Stop()
	// Deliveries: a pending list handed to idle workers in order; a slow
	// job blocks only its own worker.
	pending := make(chan job, n)
	go func() {
		defer close(work)
		for j := range pending {
			work <- j
		}
	}()
	for tag := 1; tag <= n; tag++ {
		b.mu.Lock()
		for prefetch > 0 && b.unacked >= prefetch && !stuck {
			b.cond.Wait()
		}
		if stuck {
			b.mu.Unlock()
			break
		}
		b.unacked++
		b.mu.Unlock()
		pending <- jobs[tag]
	}
	close(pending)
	wg.Wait()
	// Every settle called: each tag reaches the broker without flush,
	// within the hold (and the flush delay), give or take a slow machine.
	b.mu.Lock()
	for b.low <= b.n && !stuck {
		b.cond.Wait()
	}
	low, unacked, gaveUp := b.low, b.unacked, stuck
	b.mu.Unlock()
	close(stop)
	checks.Wait()
	if gaveUp {
		a.flush()
		t.Fatalf("%s: after 20s, tag %d still unsettled at the broker (%d unacked), every settle called or credit held: an ack stranded; problems %v",
			desc, low, unacked, b.problems)
	}
	if s := checkAckerInvariants(a); s != "" && bad.Load() == nil {
		bad.Store(&s)
	}
	a.flush()
	b.mu.Lock()
	b.after = true
	frames := b.frames
	b.mu.Unlock()
	time.Sleep(3 * a.hold)
	b.mu.Lock()
	defer b.mu.Unlock()
	if p := bad.Load(); p != nil {
		t.Fatalf("%s: acker invariant broken: %s", desc, *p)
	}
	if len(b.problems) > 0 {
		t.Fatalf("%s: %d frames, problems: %v", desc, b.frames, b.problems)
	}
	if b.frames != frames {
		t.Fatalf("%s: %d frames after flush returned", desc, b.frames-frames)
	}
	for tag := 1; tag <= n; tag++ {
		if b.settled[tag] != jobs[tag].how {
			t.Fatalf("%s: tag %d settled %d at the broker, want %d", desc, tag, b.settled[tag], jobs[tag].how)
		}
	}
	if size := a.size(); size != 0 {
		t.Fatalf("%s: every tag settled and flushed, the acker remembers %d tags", desc, size)
	}
	// Each ack reaches the broker within the hold and the flush delay,
	// give or take a loaded machine: far less than the long job.
	if bound := a.hold + ackFlush + lagSlack; b.lag > bound {
		t.Fatalf("%s: the ack of tag %d took %v to be written (long job: tag %d, %v), want at most %v",
			desc, b.lagTag, b.lag, long, longJob, bound)
	}
	t.Logf("%s: %d frames (%d multiple) for %d tags, the longest ack %v", desc, b.frames, b.multi, n, b.lag)
}

// TestReviewHrev8AckerModel runs the model for many random sessions. Set
// HREV8_ACKER_RUNS for more; HREV8_ACKER_SEED to repeat one.
func TestReviewHrev8AckerModel(t *testing.T) {
	runs := 24
	if s := os.Getenv("HREV8_ACKER_RUNS"); s != "" {
		runs, _ = strconv.Atoi(s)
	}
	base := time.Now().UnixNano()
	if s := os.Getenv("HREV8_ACKER_SEED"); s != "" {
		base, _ = strconv.ParseInt(s, 10, 64)
		runs = 1
	}
	for i := range runs {
		seed := base + int64(i)
		t.Run(strconv.FormatInt(seed, 10), func(t *testing.T) {
			t.Parallel()
			runAckerModel(t, seed, 1500)
		})
	}
}
