package amqpidem

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// meetingStore makes the two copies of each key meet twice: at their
// Acquire (so that both read the same pending value) and at their first
// Amend (so that both try to take the claim from it at once). A copy
// waits up to 5 s for the other.
type meetingStore struct {
	lock.Store
	am lock.Amender

	mu    sync.Mutex
	meets map[string]*meeting // by call and key
}

// meeting is where the first of two callers waits for the second.
type meeting struct {
	arrived int
	both    chan struct{}
}

func newMeetingStore(s lock.Store) *meetingStore {
	return &meetingStore{Store: s, am: s.(lock.Amender), meets: map[string]*meeting{}}
}

// meet waits for the other caller of call on key, the first two times it
// is called; later calls go on at once.
func (s *meetingStore) meet(call, key string) {
	s.mu.Lock()
	m := s.meets[call+" "+key]
	if m == nil {
		m = &meeting{both: make(chan struct{})}
		s.meets[call+" "+key] = m
	}
	m.arrived++
	switch m.arrived {
	case 1:
		s.mu.Unlock()
		select {
		case <-m.both:
		case <-time.After(5 * time.Second):
		}
		return
	case 2:
		close(m.both)
	}
	s.mu.Unlock()
}

func (s *meetingStore) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	s.meet("acquire", req.Key)
	return s.Store.Acquire(ctx, req)
}

func (s *meetingStore) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	s.meet("amend", key)
	return s.am.Amend(ctx, key, fence, old, value)
}

// countingBroker counts the publishes of each MessageId to "next".
type countingBroker struct {
	fakeBroker
	mu sync.Mutex
	n  map[string]int
}

func (b *countingBroker) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	if key != "next" {
		return b.fakeBroker.publish(ctx, exchange, key, msg)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.n[msg.MessageId]++
	return nil
}

// TestOutboxClaimRace: two copies of each of 50 keys find the key's
// staged message pending, its claim passed, read the same value and take
// the claim from it at the same moment: of the two, one takes it and
// publishes; the other is told the record changed. The message is
// published once per key. (With a claim that was only the millisecond
// it ends, two copies in the same millisecond wrote the same bytes, and
// Amend answers nil to a writer whose bytes the record already holds:
// both published.)
func TestOutboxClaimRace(t *testing.T) {
	t.Run("memory", func(t *testing.T) { testClaimRace(t, mustMemory(t)) })
	t.Run("redis", func(t *testing.T) {
		s, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: testenv.Name(t)})
		if err != nil {
			t.Fatal(err)
		}
		testClaimRace(t, s)
	})
}

func testClaimRace(t *testing.T, store lock.Store) {
	const keys = 50
	ms := newMeetingStore(store)
	p := newProcessorOn(t, ms, Config{Logger: slog.New(slog.DiscardHandler)}, stager(1, nil))
	b := &countingBroker{n: map[string]int{}}
	for i := range keys {
		key := fmt.Sprint("k", i)
		res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", key), Fingerprint: fingerprint([]byte("x"))})
		if err != nil || res.Status != lock.Acquired {
			t.Fatal(res.Status, err)
		}
		enc, err := appendPublishing(nil, "", "next", amqp.Publishing{MessageId: key})
		if err != nil {
			t.Fatal(err)
		}
		// Stored by an execution that died before it published, its
		// claim passed.
		value := encodeValue("", nil, [][]byte{enc}, time.Now().Add(-time.Second).UnixMilli())
		if err := store.Complete(context.Background(), res.Lease, value); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	evs := make([]Event, 2*keys)
	for i := range 2 * keys {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, _ := delivery(fmt.Sprint("k", i/2), "x")
			evs[i] = p.process(context.Background(), b, d, nil)
		}()
	}
	wg.Wait()
	twice := 0
	for i := range keys {
		key := fmt.Sprint("k", i)
		switch n := b.n[key]; {
		case n > 1:
			twice++
		case n == 0:
			t.Errorf("%s: not published by either copy: %v %q, %v %q", key, evs[2*i].Outcome, evs[2*i].Reason, evs[2*i+1].Outcome, evs[2*i+1].Reason)
		}
	}
	if twice > 0 {
		t.Fatalf("%d of %d keys published by both copies, which both took the claim", twice, keys)
	}
	for i := range keys {
		a, b := evs[2*i], evs[2*i+1]
		if a.Outcome == Abandoned {
			a, b = b, a
		}
		if a.Outcome != Duplicate || a.Outbox.Republished != 1 || b.Outcome != Abandoned || b.Reason != "outbox changed" {
			t.Fatalf("k%d: copies %v %q %+v and %v %q %+v; want one published, the other told the record changed",
				i, a.Outcome, a.Reason, a.Outbox, b.Outcome, b.Reason, b.Outbox)
		}
	}
}

// The claim's two forms: a plain one is the ms it ends; a tagged one,
// a copy's, reads the same to this release, differs from every other
// claim this process takes, and reads as long passed to a release before
// tags (a negative time), which then takes the claim over.
func TestClaimForms(t *testing.T) {
	until := time.Date(2026, 11, 27, 9, 0, 0, 123e6, time.UTC).UnixMilli()
	if got := claimUntil(uint64(until)); got != until {
		t.Fatalf("plain claim: got %d, want %d", got, until)
	}
	if got := claimUntil(0); got != 0 {
		t.Fatalf("no claim: got %d, want 0", got)
	}
	seen := map[uint64]bool{}
	for range 1000 {
		c := newClaim(until)
		if got := claimUntil(c); got != until {
			t.Fatalf("tagged claim %x: until %d, want %d", c, got, until)
		}
		if seen[c] {
			t.Fatalf("tagged claim %x taken twice", c)
		}
		seen[c] = true
		// What a release before tags reads: int64 of the 8 bytes.
		if old := int64(c); time.UnixMilli(old).Sub(time.Now()) > 0 {
			t.Fatalf("a release before tags reads tagged claim %x as %d, not passed", c, old)
		}
	}
	if late := time.Date(2248, 1, 1, 0, 0, 0, 0, time.UTC).UnixMilli(); claimUntil(newClaim(late)) != late {
		t.Fatalf("a claim until 2248 does not fit")
	}
	// A value with a tagged claim splits as one with a plain claim does.
	enc, _ := appendPublishing(nil, "", "next", amqp.Publishing{MessageId: "m"})
	v := encodeValue("reply", []byte("r"), [][]byte{enc}, until)
	plain, err := splitValue(v)
	if err != nil {
		t.Fatal(err)
	}
	binary.BigEndian.PutUint64(v[plain.claimAt:], newClaim(until+1))
	tagged, err := splitValue(v)
	if err != nil || tagged.claimUntil != until+1 || string(tagged.result) != "r" || len(tagged.outbox) != 1 {
		t.Fatalf("value with a tagged claim: %+v %v", tagged, err)
	}
}

// ClaimOutbox takes a tagged claim an operator's tool holds, OutboxClaim
// reads either form back, and a zero until gives the claim up; nothing
// but the claim changes.
func TestClaimOutbox(t *testing.T) {
	enc, _ := appendPublishing(nil, "", "next", amqp.Publishing{MessageId: "m"})
	until := time.Now().Add(time.Minute).UnixMilli()
	v := encodeValue("", []byte("r"), [][]byte{enc}, until)
	if got, err := OutboxClaim(v); err != nil || got.UnixMilli() != until {
		t.Fatalf("plain claim: got %v %v, want %v", got, err, time.UnixMilli(until))
	}
	later := time.UnixMilli(until + 5000)
	a, err := ClaimOutbox(v, later)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := ClaimOutbox(v, later)
	if string(a) == string(b) {
		t.Fatalf("two claims of one value at one ms wrote the same bytes: both would win the compare-and-set")
	}
	if got, err := OutboxClaim(a); err != nil || !got.Equal(later) {
		t.Fatalf("tagged claim: got %v %v, want %v", got, err, later)
	}
	free, err := ClaimOutbox(a, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := OutboxClaim(free); err != nil || !got.IsZero() {
		t.Fatalf("given up: got %v %v, want the zero Time", got, err)
	}
	if s, _ := splitValue(free); string(s.result) != "r" || len(s.outbox) != 1 || s.outbox[0].state != OutboxPending {
		t.Fatalf("the rest of the value changed: %+v", s)
	}
	if _, err := ClaimOutbox(encodeValue("", []byte("r"), nil, 0), later); err == nil {
		t.Fatal("ClaimOutbox of a value without staged messages: no error")
	}
	if got, err := OutboxClaim([]byte("not amqpidem's")); err != nil || !got.IsZero() {
		t.Fatalf("a value without an outbox: %v %v", got, err)
	}
}
