//go:build linux

package chaos_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 1, duplicate storm: unique operations, each published 1 to 4
// times and shuffled so that copies reach different consumer processes at
// once. With no fault injected every operation must run exactly once.
func TestChaos01DuplicateStorm(t *testing.T) {
	e := newEnv(t, envOptions{})
	consumerBinary(t)
	nOps, consumers := pick(1000, 10000), 4

	for i := range consumers {
		e.consumer(fmt.Sprintf("%s-c%d", e.name, i), "-in-progress-delay", "200ms", "-concurrency", "16")
	}
	ops := workload.Storm(e.name+"-op", nOps, 4, 5, e.rng)
	start := time.Now()
	msgs := e.publish(ops)
	e.settle(nOps, pick(4*time.Minute, 10*time.Minute), time.Second)
	took := time.Since(start)
	e.terminateAll()

	r := e.report("storm", nil, false)
	t.Logf("storm: %d messages of %d operations through %d consumer processes in %v (%.0f messages/s)",
		msgs, nOps, consumers, took.Round(time.Millisecond), float64(msgs)/took.Seconds())
	if r.Reexecuted != 0 {
		t.Errorf("storm: %d operations ran more than once with no fault injected:%s", r.Reexecuted,
			r.Failing(10, func(s ledgerStats) bool { return s.Executions > 1 }))
	}
	outcomes := map[string]int{}
	for _, ev := range e.events() {
		outcomes[ev.Outcome]++
	}
	if got, want := outcomes["completed"], nOps; got != want {
		t.Errorf("storm: completed events: got %d, want %d (outcomes %v)", got, want, outcomes)
	}
	t.Logf("storm: outcomes %v", outcomes)
}
