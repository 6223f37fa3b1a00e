//go:build linux

package chaos_test

import (
	"errors"
	"fmt"
	"sync"
	"time"
)

// supervisor keeps a fixed set of consumer processes running: a slot whose
// process died (a crash window, a kill -9) gets a new process under the
// same name, as a process manager would restart it.
type supervisor struct {
	e      *env
	prefix string // slots are named <prefix>-c0 …
	flags  []string
	start  func(name string, flags ...string) (*proc, error)

	mu       sync.Mutex
	slots    []*proc
	restarts int
	errs     []error

	stop chan struct{}
	done chan struct{}
}

// supervise starts n consumers named <env>-c0 … and restarts them when
// they die, until the supervisor is stopped.
func (e *env) supervise(n int, flags ...string) *supervisor {
	e.t.Helper()
	return e.superviseAs(e.name, n, flags...)
}

// superviseAs is supervise with the consumers named <prefix>-c0 …, for a
// scenario that supervises several groups.
func (e *env) superviseAs(prefix string, n int, flags ...string) *supervisor {
	e.t.Helper()
	consumerBinary(e.t)
	return e.superviseWith(prefix, e.startConsumer, n, flags...)
}

// superviseWith is superviseAs for processes that start starts (a
// consumer's or a relay's), with the binary already built.
func (e *env) superviseWith(prefix string, start func(name string, flags ...string) (*proc, error), n int, flags ...string) *supervisor {
	e.t.Helper()
	s := &supervisor{e: e, prefix: prefix, flags: flags, start: start, stop: make(chan struct{}), done: make(chan struct{})}
	for i := range n {
		p, err := start(s.slotName(i), flags...)
		if err != nil {
			e.t.Fatal(err)
		}
		s.slots = append(s.slots, p)
	}
	go s.loop()
	e.t.Cleanup(func() { s.halt() })
	return s
}

func (s *supervisor) slotName(i int) string { return fmt.Sprintf("%s-c%d", s.prefix, i) }

func (s *supervisor) loop() {
	defer close(s.done)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
		for i := range s.slots {
			s.mu.Lock()
			p := s.slots[i]
			s.mu.Unlock()
			if p.alive() {
				continue
			}
			np, err := s.start(s.slotName(i), s.flags...)
			s.mu.Lock()
			if err != nil {
				s.errs = append(s.errs, err)
			} else {
				s.slots[i] = np
				s.restarts++
			}
			s.mu.Unlock()
		}
	}
}

// live returns the slots' current processes that are running.
func (s *supervisor) live() []*proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*proc
	for _, p := range s.slots {
		if p.alive() {
			out = append(out, p)
		}
	}
	return out
}

// halt stops restarting processes (they keep running) and returns how many
// restarts there were and the errors starting them. Idempotent.
func (s *supervisor) halt() (restarts int, err error) {
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.restarts, errors.Join(s.errs...)
}
