package linearizable

import (
	"fmt"
	"hash/maphash"
	"math"
	"sort"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/amqpidem/amqpidem/lock"
)

// Params are what the model needs to know of a store's clock.
type Params struct {
	// Early is how much earlier, by the recorder's clock, the store may
	// end a lease than call+TTL of the call that set its deadline:
	// DeadlineSlack (the server's rounding down to its millisecond) plus
	// how far the store's clock may run ahead of the recorder's.
	Early time.Duration
	// Late is how much later than return+TTL of the call that set its
	// deadline the store may still answer InProgress for a lease: how far
	// its clock may run behind the recorder's, plus any margin the store
	// states (dynamostore's MaxClockSkew).
	Late time.Duration
	// Busy lets the store answer InProgress, with the fence and attempts
	// of the record as it is (0 and 0 for none), on a key that is not in
	// progress, whose lease may have expired, or whose fingerprint
	// conflicts, as long as the record is not completed or failed:
	// pgstore's Acquire does when another statement holds the key's
	// advisory lock (a concurrent Acquire), and the answer then says
	// "busy", not "a live lease". It weakens the
	// check: without it, an InProgress answer needs a lease that may
	// still be live.
	Busy bool
	// Held tells the leases held by a transaction (pgstore's TxHandler,
	// by their owner token) from the others; nil: none is. Such a lease
	// writes no record until its outcome: while it is held the key reads
	// as absent (Inspect and Forget find no record, a busy Acquire
	// answers fence 0 and attempts 0), its outcome is written as a first
	// attempt (attempts 1), and Cancel writes nothing (the key is absent
	// again) and answers nil whatever the record. It is taken only on a
	// key with no record. Extend does not renew it (the server ends its
	// session once its transaction sat idle for the TTL, and then Extend
	// answers ErrLeaseLost, as a call ending it may); it lasts as long as
	// its session is busy.
	Held func(owner string) bool
	// SessionsEnd: the run's faults end database sessions (backends
	// terminated, the server restarted), and with its session a lease
	// held by a transaction, which the key's next Acquire may then take
	// over before the lease's TTL. Its work, in that session, rolled
	// back with it.
	SessionsEnd bool
}

// held reports whether owner's lease is held by a transaction.
func (p Params) held(owner string) bool { return p.Held != nil && owner != "" && p.Held(owner) }

// state is one key's record as the model knows it. It is comparable, so
// that porcupine can compare states with ==.
type state struct {
	Exists bool
	St     byte // 'p', 'c', 'f', 'r', 'x' as the stores write it
	// Owner and Fence of the latest lease; OwnerKnown is false after an
	// Acquire whose answer was lost (its owner token is nobody's), and
	// FenceKnown false until an answer shows that lease's fence.
	Owner      string
	OwnerKnown bool
	Fence      int64
	FenceKnown bool
	// Floor is the highest fence known to have been handed out on the key
	// (across lost records too): every new lease's fence is above it.
	Floor    int64
	Attempts int
	FP       string
	Value    string
	// Earliest and Latest bound, by the recorder's clock in ns, when the
	// current lease (St 'p') may expire: no takeover can happen before
	// Earliest, and it must be expired after Latest (math.MaxInt64: never
	// known, after an answer that was lost).
	Earliest, Latest int64
	// Held: the current lease (St 'p') is held by a transaction
	// (Params.Held), and the key has no record.
	Held bool
}

var seed = maphash.MakeSeed()

// Model returns the porcupine model of one key's record, partitioned by
// key, for a store whose clock p describes. It is nondeterministic where
// an answer was lost: an ambiguous operation may or may not have taken
// effect.
func Model(p Params) porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: partitionByKey,
		Init:      func() []interface{} { return []interface{}{state{}} },
		Step: func(s, in, out interface{}) []interface{} {
			return step(p, s.(state), in.(Input), out.(Output))
		},
		Equal:             func(a, b interface{}) bool { return a.(state) == b.(state) },
		Hash:              func(a interface{}) uint64 { return maphash.Comparable(seed, a.(state)) },
		DescribeOperation: describeOp,
		DescribeState:     func(s interface{}) string { return describeState(s.(state)) },
	}
	return nm.ToModel()
}

func partitionByKey(history []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	for _, op := range history {
		k := op.Input.(Input).Key
		if _, ok := byKey[k]; !ok {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], op)
	}
	sort.Strings(keys)
	parts := make([][]porcupine.Operation, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, byKey[k])
	}
	return parts
}

func ambiguous(e ErrKind) bool { return e == ErrAmbiguous || e == ErrOther }

// one returns a single next state when ok, else none.
func one(ok bool, s state) []interface{} {
	if !ok {
		return nil
	}
	return []interface{}{s}
}

// step returns the states s can move to by the operation in answering
// out; none if the answer is impossible in s.
func step(p Params, s state, in Input, out Output) []interface{} {
	switch in.Kind {
	case KindAcquire:
		return stepAcquire(p, s, in, out)
	case KindExtend:
		held := s.Exists && s.OwnerKnown && s.Owner == in.Owner && s.Fence == in.Fence && s.St == 'p'
		ext := s
		if s.Held {
			// Not renewed: the session's idle timeout ends it, or not.
			if out.Err == ErrLost && held {
				return one(out.Return >= s.Earliest, s)
			}
			if out.Err == ErrNone || ambiguous(out.Err) {
				return one(held || ambiguous(out.Err), s)
			}
		}
		ext.Earliest = max(s.Earliest, in.Call+int64(in.TTL)-int64(p.Early))
		switch {
		case ambiguous(out.Err):
			if held {
				ext.Latest = math.MaxInt64
				return []interface{}{s, ext}
			}
			return []interface{}{s}
		case out.Err == ErrNone:
			if s.Latest != math.MaxInt64 {
				ext.Latest = max(s.Latest, out.Return+int64(in.TTL))
			}
			return one(held, ext)
		case out.Err == ErrLost:
			return one(!held, s)
		}
		return nil
	case KindComplete, KindFail, KindRelease, KindCancel:
		target := map[Kind]byte{KindComplete: 'c', KindFail: 'f', KindRelease: 'r', KindCancel: 'x'}[in.Kind]
		held := s.Exists && s.OwnerKnown && s.Owner == in.Owner && s.Fence == in.Fence
		apply := held && s.St == 'p'
		next := s
		if apply {
			next.St, next.Earliest, next.Latest, next.Held = target, 0, 0, false
			switch target {
			case 'c', 'f':
				next.Value = in.Value
			case 'x':
				next.Attempts = max(s.Attempts-1, 0)
			}
			if s.Held {
				// The outcome is the record's first attempt; a
				// cancelled one leaves none.
				next.Attempts = 1
				if target == 'x' {
					next = state{Floor: s.Floor}
				}
			}
		}
		if target == 'x' && p.held(in.Owner) && !ambiguous(out.Err) {
			// A held lease's Cancel answers nil whatever the record.
			if out.Err != ErrNone {
				return nil
			}
			if apply {
				return []interface{}{next}
			}
			return []interface{}{s}
		}
		if out.Err == ErrLost && apply && s.Held {
			// Past its TTL its session may have ended, and the lease
			// with it, no takeover needed.
			return one(out.Return >= s.Earliest, s)
		}
		switch {
		case ambiguous(out.Err):
			if apply {
				return []interface{}{s, next}
			}
			return []interface{}{s}
		case out.Err == ErrNone:
			// A retry of this same call that finds its own write: nil.
			return one(apply || (held && s.St == target), next)
		case out.Err == ErrLost:
			return one(!apply && !(held && s.St == target), s)
		}
		return nil
	case KindAmend:
		match := s.Exists && s.St == 'c' && s.FenceKnown && s.Fence == in.Fence
		next := s
		next.Value = in.Value
		switch {
		case ambiguous(out.Err):
			if match && s.Value == in.Old {
				return []interface{}{s, next}
			}
			return []interface{}{s}
		case out.Err == ErrNone:
			return one(match && (s.Value == in.Old || s.Value == in.Value), next)
		case out.Err == ErrChanged:
			return one(!(match && (s.Value == in.Old || s.Value == in.Value)), s)
		}
		return nil
	case KindInspect:
		switch {
		case ambiguous(out.Err):
			return []interface{}{s}
		case out.Err == ErrNotFound:
			return one(!s.Exists || s.Held, s)
		case out.Err != ErrNone || !s.Exists || s.Held || out.State.Letter() != s.St || out.Attempts != s.Attempts:
			return nil
		case s.OwnerKnown && out.Owner != s.Owner:
			return nil
		case (s.St == 'c' || s.St == 'f') && out.Value != s.Value:
			return nil
		}
		next, ok := learnFence(s, out.Fence)
		return one(ok, next)
	case KindForget:
		match := s.Exists && !s.Held && s.St == in.State.Letter() && (!s.FenceKnown || s.Fence == in.Fence)
		gone := state{Floor: max(s.Floor, in.Fence)}
		switch {
		case ambiguous(out.Err):
			if match {
				return []interface{}{s, gone}
			}
			return []interface{}{s}
		case out.Err == ErrNone:
			if !match {
				return nil
			}
			if _, ok := learnFence(s, in.Fence); !ok {
				return nil
			}
			return []interface{}{gone}
		case out.Err == ErrNotFound:
			return one(!s.Exists || s.Held, s)
		case out.Err == ErrChanged:
			// With the fence unknown, the store may have refused it
			// for another fence.
			return one(s.Exists && !s.Held && (!match || !s.FenceKnown), s)
		}
		return nil
	}
	return nil
}

// learnFence checks an answer's fence against the record's: equal when
// the model knows it, else above every fence handed out before, which it
// then becomes.
func learnFence(s state, fence int64) (state, bool) {
	if s.FenceKnown {
		return s, fence == s.Fence
	}
	if fence <= s.Floor {
		return s, false
	}
	s.Fence, s.FenceKnown, s.Floor = fence, true, fence
	return s, true
}

func stepAcquire(p Params, s state, in Input, out Output) []interface{} {
	// What a granted lease makes of the record, its fence and owner
	// aside.
	// A lease held by a transaction leaves no record.
	none := !s.Exists || s.Held
	granted := s
	granted.St = 'p'
	granted.Earliest = in.Call + int64(in.TTL) - int64(p.Early)
	if none {
		granted = state{Exists: true, St: 'p', Floor: s.Floor, FP: in.Fingerprint, Earliest: granted.Earliest}
	}
	granted.Attempts++
	conflict := !none && in.Fingerprint != "" && s.FP != "" && in.Fingerprint != s.FP
	free := !s.Exists || s.St == 'r' || s.St == 'x'
	if ambiguous(out.Err) {
		if conflict || !(free || s.St == 'p') {
			return []interface{}{s}
		}
		// It may have taken the key, at any time from its call on.
		lost := granted
		lost.Owner, lost.OwnerKnown, lost.Fence, lost.FenceKnown = "", false, 0, false
		lost.Latest = math.MaxInt64
		return []interface{}{s, lost}
	}
	if out.Err != ErrNone {
		return nil
	}
	final := s.Exists && (s.St == 'c' || s.St == 'f')
	switch {
	case out.Status == lock.InProgress && p.Busy && !final:
		// Busy: the record as it is, whatever its lease and fingerprint.
		if none {
			return one(out.Fence == 0 && out.Attempts == 0, s)
		}
		if out.Attempts != s.Attempts {
			return nil
		}
		next, ok := learnFence(s, out.Fence)
		return one(ok, next)
	case conflict:
		if out.Status != lock.Conflict || out.Attempts != s.Attempts {
			return nil
		}
		next, ok := learnFence(s, out.Fence)
		return one(ok, next)
	case s.Exists && (s.St == 'c' || s.St == 'f'):
		want := map[byte]lock.Status{'c': lock.Completed, 'f': lock.Failed}[s.St]
		if out.Status != want || out.Value != s.Value || out.Attempts != s.Attempts {
			return nil
		}
		next, ok := learnFence(s, out.Fence)
		return one(ok, next)
	case out.Status == lock.InProgress:
		// Only a live lease, or one that may still be live by the store's
		// clock, answers InProgress.
		if !s.Exists || s.St != 'p' || out.Attempts != s.Attempts {
			return nil
		}
		if s.Latest != math.MaxInt64 && in.Call > s.Latest+int64(p.Late) {
			return nil
		}
		next, ok := learnFence(s, out.Fence)
		return one(ok, next)
	case out.Status == lock.Acquired:
		// A lease in progress is taken over only once it may have
		// expired.
		if s.Exists && s.St == 'p' && out.Return < s.Earliest {
			return nil
		}
		if out.Attempts != granted.Attempts || out.Fence <= s.Floor || (s.FenceKnown && out.Fence <= s.Fence) {
			return nil
		}
		granted.Owner, granted.OwnerKnown, granted.Fence, granted.FenceKnown = out.Owner, true, out.Fence, true
		granted.Floor = out.Fence
		granted.Latest = out.Return + int64(in.TTL)
		if p.held(out.Owner) {
			// Only on a key with no record; it lasts while its session
			// is busy.
			if !none {
				return nil
			}
			granted.Held, granted.Latest = true, math.MaxInt64
			if p.SessionsEnd {
				granted.Earliest = in.Call
			}
		}
		return []interface{}{granted}
	}
	return nil
}

func short(owner string) string {
	if len(owner) > 6 {
		return owner[:6]
	}
	return owner
}

func describeOp(input, output interface{}) string {
	in, out := input.(Input), output.(Output)
	var call string
	switch in.Kind {
	case KindAcquire:
		call = fmt.Sprintf("acquire(ttl=%v fp=%q)", in.TTL, in.Fingerprint)
	case KindAmend:
		call = fmt.Sprintf("amend(fence=%d %q→%q)", in.Fence, in.Old, in.Value)
	case KindInspect:
		call = "inspect()"
	case KindForget:
		call = fmt.Sprintf("forget(%s fence=%d)", in.State, in.Fence)
	default:
		call = fmt.Sprintf("%s(owner=%s fence=%d %q)", in.Kind, short(in.Owner), in.Fence, in.Value)
	}
	var res string
	switch {
	case out.Err != ErrNone:
		res = string(out.Err) + ": " + out.Error
	case in.Kind == KindAcquire:
		res = fmt.Sprintf("%v owner=%s fence=%d attempts=%d %q", out.Status, short(out.Owner), out.Fence, out.Attempts, out.Value)
	case in.Kind == KindInspect:
		res = fmt.Sprintf("%s owner=%s fence=%d attempts=%d %q", out.State, short(out.Owner), out.Fence, out.Attempts, out.Value)
	default:
		res = "ok"
	}
	return call + " → " + res
}

func describeState(s state) string {
	if !s.Exists {
		return fmt.Sprintf("absent (floor %d)", s.Floor)
	}
	owner, fence := "?", "?"
	if s.OwnerKnown {
		owner = short(s.Owner)
	}
	if s.FenceKnown {
		fence = fmt.Sprint(s.Fence)
	}
	d := fmt.Sprintf("%s owner=%s fence=%s floor=%d attempts=%d fp=%q", lock.StateOf(s.St), owner, fence, s.Floor, s.Attempts, s.FP)
	if s.Held {
		d = "held by a transaction, no record: " + d
	}
	switch s.St {
	case 'p':
		latest := "never"
		if s.Latest != math.MaxInt64 {
			latest = time.Duration(s.Latest).String()
		}
		d += fmt.Sprintf(" expires in [%v, %s]", time.Duration(s.Earliest), latest)
	case 'c', 'f':
		d += fmt.Sprintf(" value=%q", s.Value)
	}
	return d
}
