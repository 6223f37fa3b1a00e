package pgstore

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/lock"
)

// TestHrev11HeldGuardTakersCloseStress: the members of lease batches are
// put in Store.held (25e7048: each guard armed under the map's mutex, once
// its members are in), with TTLs of 1-3 ms, while takers take them out and
// put them back, or end them, as amqpidem's calls do, some batches busy
// (a split's other part running: the guard re-arms a copy in the member's
// place), and Close runs part way through. Whoever ends a member (its
// guard, its taker, Close), it is ended exactly once: each batch's member
// count comes down to 0, never below, and nothing of a batch is left in
// Store.held (a member a guard missed would wait there for ever). One
// member in four has no taker (a lost end: what the guard is for), and
// one put in four is held up for 4 ms between its look at Store.closed
// and its put (heldStoreHook: a goroutine descheduled), longer than the
// TTLs.
func TestHrev11HeldGuardTakersCloseStress(t *testing.T) {
	withStoreHook(t, func() {
		if rand.IntN(4) == 0 {
			time.Sleep(4 * time.Millisecond)
		}
	})
	for round := range 3 {
		s := testStore(t, pgenv.Pool(t, 2))
		const batches, members = 40, 4
		var bs []*heldBatch
		var wg sync.WaitGroup
		for i := range batches {
			b := &heldBatch{s: s, ttl: 5 * time.Millisecond, locked: map[string]bool{}, members: members}
			if i%3 == 0 {
				b.running.Store(true) // busy for a while: re-arms
			}
			bs = append(bs, b)
			ttl := time.Duration(1+i%3) * time.Millisecond
			ls := make([]lock.Lease, members)
			hs := make([]*heldTx, members)
			for j := range ls {
				key := fmt.Sprintf("s%d-%d-%d", round, i, j)
				ls[j] = lock.Lease{Key: key, Owner: heldOwner(uint32(i)), Fence: 1, TTL: ttl, Retention: time.Hour}
				hs[j] = &heldTx{batch: b, key: []byte(key), fp: []byte("fp")}
			}
			s.putHeldBatch(append([]lock.Lease(nil), ls...), append([]*heldTx(nil), hs...))
			for j := range ls {
				if j == 0 {
					continue // nobody ends it but its guard, or Close
				}
				wg.Add(1)
				go func() { // a taker: takes, puts back a few times, then ends
					defer wg.Done()
					for try := 0; ; try++ {
						time.Sleep(time.Duration(rand.IntN(1500)) * time.Microsecond)
						m := s.takeHeld(ls[j].Owner)
						if m == nil || m.batch == nil {
							if m != nil {
								s.putHeld(ls[j], m) // what is left, for the outcome
							}
							return // ended by its guard, or by Close
						}
						if try >= 3 {
							s.endHeldConn(m)
							return
						}
						s.putHeldBatch([]lock.Lease{ls[j]}, []*heldTx{m})
					}
				}()
			}
			if i == batches/2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					time.Sleep(time.Millisecond)
					s.Close()
				}()
			}
		}
		time.Sleep(20 * time.Millisecond)
		for _, b := range bs {
			b.running.Store(false)
		}
		wg.Wait()
		deadline := time.Now().Add(3 * time.Second)
		left := func() (n int) {
			s.held.Range(func(_ string, h *heldTx) bool {
				if h.batch != nil {
					n++
				}
				return true
			})
			return n
		}
		for left() > 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n := left(); n > 0 {
			t.Errorf("round %d: %d batch members still wait in Store.held 3s after their takers and Close", round, n)
		}
		for i, b := range bs {
			b.mu.Lock()
			if b.members != 0 {
				t.Errorf("round %d: batch %d has %d members not ended (want 0; below 0: one ended twice)", round, i, b.members)
			}
			b.mu.Unlock()
		}
	}
}
