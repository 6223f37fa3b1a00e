//go:build linux

package chaos_test

import (
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 10, quorum queue with a delivery limit of 2: long operations
// published four times each keep their copies busy (another consumer holds
// the lease) for many rounds. Each busy round is a delayed requeue: a new
// message, acked original, so the broker's delivery count never reaches
// the limit and no copy is dropped.
func TestChaos10QuorumDeliveryLimit(t *testing.T) {
	const limit = 2
	e := newEnv(t, envOptions{queueArgs: amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(limit)}})
	nLong, nShort := pick(2, 5), pick(100, 500)
	flags := []string{"-quorum", "-delivery-limit", fmt.Sprint(limit), "-lease", "5s", "-in-progress-delay", "200ms", "-concurrency", "8"}
	for i := range 2 {
		e.consumer(fmt.Sprintf("%s-c%d", e.name, i), flags...)
	}
	long := make([]workload.Op, nLong)
	for i := range long {
		long[i] = workload.Op{ID: fmt.Sprintf("%s-long%d", e.name, i), Plan: workload.Plan{WorkMS: 6000}, Copies: 4}
	}
	e.publish(long)
	e.publish(workload.Storm(e.name+"-op", nShort, 3, 20, e.rng))
	e.settle(nLong+nShort, 3*time.Minute, 2*time.Second)
	e.terminateAll()
	r := e.report("quorum", nil, false)

	busy := map[string]int{}
	for _, ev := range e.events() {
		if ev.Outcome == "busy" {
			busy[ev.Op]++
		}
	}
	for _, o := range long {
		s := r.PerOp[o.ID]
		t.Logf("quorum: %s: %d executions, %d busy requeues of its copies", o.ID, s.Executions, busy[o.ID])
		if s.Executions != 1 {
			t.Errorf("%s ran %d times, want once", o.ID, s.Executions)
		}
		if busy[o.ID] <= limit {
			t.Errorf("%s: only %d busy requeues; the scenario needs more than the delivery limit %d", o.ID, busy[o.ID], limit)
		}
	}
}

// Scenario 10b, quorum queue and graceful shutdown: a handler interrupted
// by Consumer.Shutdown, and the messages prefetched behind it, go back to
// the queue. Nacked with requeue, a quorum queue would count each return
// against its delivery limit, as it counts a crash: with x-delivery-limit
// 1, two rolling restarts during one long handler dropped the message (and
// a prefetched one that never ran) before the fix. Returned as a copy and
// an ack, like a busy requeue, they are never counted.
func TestChaos10QuorumShutdownReturns(t *testing.T) {
	const limit = 1
	e := newEnv(t, envOptions{queueArgs: amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int64(limit)}})
	// One handler at a time, four more messages prefetched behind it.
	flags := []string{"-quorum", "-delivery-limit", fmt.Sprint(limit), "-lease", "5s", "-shutdown-timeout", "500ms",
		"-prefetch", "5", "-concurrency", "1"}
	// The first two executions outlive the shutdown grace; later ones are quick.
	op := workload.Op{ID: e.name + "-long", Plan: workload.Plan{WorkMS: 600_000, LongUntil: 3}}
	e.publish([]workload.Op{op})
	waiting := workload.Storm(e.name+"-op", 4, 1, 0, e.rng)
	e.publish(waiting)
	for i := range 2 {
		c := e.consumer(fmt.Sprintf("%s-c%d", e.name, i), flags...)
		// The long operation's own execution: its copy may come back
		// behind the prefetched ones, which then run first.
		e.waitFor(fmt.Sprintf("execution %d of the long operation", i+1), time.Minute, func() bool {
			return e.count(`SELECT count(*) FROM executions WHERE op_id = $1`, op.ID) >= i+1
		}, nil)
		if err := c.terminate(30 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
	e.consumer(e.name+"-c2", flags...)
	deadline := time.Now().Add(20 * time.Second)
	for e.applied() < 1+len(waiting) && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	d, _ := e.listQueues()
	t.Logf("quorum-shutdown: after 2 shutdowns: queue %v, applied %d", d, e.applied())
	e.terminateAll()
	r := e.report("quorum-shutdown", nil, false)
	for _, w := range waiting {
		if s := r.PerOp[w.ID]; s.Lost() {
			t.Logf("quorum-shutdown: %s, prefetched behind the long handler, was lost after %d executions", w.ID, s.Executions)
		}
	}
}
