//go:build linux

package chaos_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 13, rabbit-node-kill: a quorum queue on a three-node RabbitMQ
// cluster, three consumers each connected to a different node (and
// listing the others to fall back on), and mid-run the node hosting the
// queue's leader is killed (SIGKILL of its Erlang VM), left down for a
// while and restarted. The consumers on it reconnect to a live node; the
// others go on once a new leader is elected. The workload mixes quick
// operations (some in several copies), flaky ones that go through delayed
// requeues, and ones that fail for good and are dead-lettered, so that
// delayed requeues and dead letters are in flight at the kill; their
// delay queues and the dead-letter queue are quorum queues too.
//
// Nothing may be lost or applied twice, no operation may run after it
// completed, and every permanent failure must reach the dead-letter queue.
// A failed operation's delivery whose ack the kill lost comes back and is
// dead-lettered again as a "failed duplicate" (the default policy: an
// operator rather sees a dead letter twice than never): those are counted
// apart, as redundant, not as duplicated effects.
//
// Each scenario runs twice: with delay queues, and with
// Config.DelayInProcess. On RabbitMQ 3.10.8 the first strands copies in a
// quorum delay queue in some runs (its at-least-once dead-lettering does
// not resume after the leader moves): the operations they carry are
// counted as stranded and recovered by publishing them again; that is
// logged as the broker's defect on 3.10 and fails on any other version.
// In process there is no delay queue, and nothing may be stranded.
func TestChaos13RabbitNodeKill(t *testing.T) {
	clusterFault(t, "rabbit-node-kill", "killed", (*testenv.RabbitNode).Kill, (*testenv.RabbitNode).Start)
}

// Scenario 14, rabbit-partition: as scenario 13, but the node leading the
// queue is cut off from the two others (RabbitNode.Partition: its Erlang
// distribution refuses theirs) instead of killed, and healed. Its own
// clients can still reach it; with pause_minority it stops serving them,
// and they reconnect to the majority, where a new leader took over.
func TestChaos14RabbitPartition(t *testing.T) {
	clusterFault(t, "rabbit-partition", "cut off", (*testenv.RabbitNode).Partition, (*testenv.RabbitNode).Heal)
}

// clusterFault runs scenarios 13 and 14, once with delayed requeues in
// quorum delay queues (the default) and once with Config.DelayInProcess.
func clusterFault(t *testing.T, name, what string, fault, mend func(*testenv.RabbitNode)) {
	t.Run("delay-queues", func(t *testing.T) { clusterFaultRun(t, name, what, fault, mend, false) })
	t.Run("in-process", func(t *testing.T) { clusterFaultRun(t, name+"-inprocess", what, fault, mend, true) })
}

// clusterFaultRun is one run of clusterFault: fault hits the queue
// leader's node mid-run, mend ends it after 5 s at least.
func clusterFaultRun(t *testing.T, name, what string, fault, mend func(*testenv.RabbitNode), inProcess bool) {
	e := newEnv(t, envOptions{rabbitCluster: true, queueArgs: amqp.Table{"x-queue-type": "quorum"}})
	nOK, nFlaky, nPermanent := pick(1000, 4000), pick(60, 240), pick(20, 80)
	mk := func(kind string, n int, p workload.Plan) []workload.Op {
		ops := make([]workload.Op, n)
		for i := range ops {
			ops[i] = workload.Op{ID: fmt.Sprintf("%s-%s%d", e.name, kind, i), Plan: p}
		}
		return ops
	}
	ok := workload.Storm(e.name+"-op", nOK, 3, 100, e.rng)
	flaky := mk("flaky", nFlaky, workload.Plan{FailUntil: 3, WorkMS: 20})
	permanent := mk("permanent", nPermanent, workload.Plan{Permanent: true, WorkMS: 20})
	good := append(append([]workload.Op(nil), ok...), flaky...)
	e.addOps(ledger.ExpectApply, good)
	e.addOps(ledger.ExpectDeadLetter, permanent)

	// Published before the consumers start, so that the kill finds them
	// mid-run; a new publisher publishes the copies after it.
	e.publishCopies(append(append([]workload.Op(nil), good...), permanent...))
	// Asked before the consumers start: QueueLeader runs rabbitmqctl,
	// seconds of CPU on two cores, and while it ran the consumers once
	// applied 1001 of 1060 operations before the kill, leaving only
	// flaky ones in delay queues, which 3.10.8 may strand: no progress
	// during the fault, and a failed run.
	version := brokerVersion(t, e.amqp)
	leader := e.rabbit.QueueLeader(e.queue)
	// Each consumer's own node first, then the others in turn.
	nodes := e.rabbit.Nodes
	for i := range nodes {
		urls := make([]string, len(nodes))
		for j := range nodes {
			urls[j] = nodes[(i+j)%len(nodes)].AMQPURL
		}
		flags := []string{"-amqp", strings.Join(urls, ","), "-quorum", "-quorum-dlq",
			"-lease", "5s", "-max-attempts", "4", "-backoff", "300ms", "-in-progress-delay", "300ms",
			"-unavailable-delay", "300ms", "-concurrency", "4", "-heartbeat", "2s"}
		if inProcess {
			flags = append(flags, "-delay-in-process")
		}
		e.consumer(fmt.Sprintf("%s-c%d", e.name, i), flags...)
	}

	e.waitFor("a fifth of the operations applied", 3*time.Minute,
		func() bool { return e.applied() >= (nOK+nFlaky)/5 }, nil)
	appliedAtKill := e.applied()
	killedAt := time.Now()
	fault(leader)
	t.Logf("%s: %s %s, the leader of %s, with %d operations applied", name, what, leader.Name, e.queue, appliedAtKill)
	// The consumers go on through the two live nodes while it is down,
	// for 5 s at least.
	e.waitFor("progress during the fault", 2*time.Minute, func() bool {
		return time.Since(killedAt) >= 5*time.Second &&
			(e.applied() >= appliedAtKill+(nOK+nFlaky)/10 || e.applied() >= nOK+nFlaky)
	}, nil)
	appliedWhileDown := e.applied() - appliedAtKill
	downFor := time.Since(killedAt)
	mend(leader)

	// Until every good operation is applied, or nothing moves for 30 s
	// while the queue itself is empty: then the operations not applied
	// are stranded, their copies stuck in a delay queue.
	stranded, strandedCopies := e.waitApplied(nOK+nFlaky, 4*time.Minute, 30*time.Second)
	dlq := e.queue + ".dlq"
	dlqFilled := func() bool {
		d, _ := e.listQueues()
		return d[dlq][0] >= nPermanent
	}
	// Every good operation again, through a fresh connection (the first
	// one's node may have been the one killed): each copy is a duplicate
	// of completed work, acked without running, or, for a stranded
	// operation, its next attempt. When copies were stranded, the
	// permanent failures go again too: a dead letter whose publish the
	// fault refused is retried through a delay queue, and may be stranded
	// with the rest; its operation's record is failed, so its copy is
	// dead-lettered as a "failed duplicate".
	again := good
	if stranded == 0 {
		// Such a dead letter can be stranded alone: every good operation
		// applied, the dead-letter queue short, and its retry in a delay
		// queue (seen once in CI, 3.10.8, scenario 14).
		dlqDepth := func() int {
			d, _ := e.listQueues()
			return d[dlq][0]
		}
		missing, copies := e.waitProgress("dead letters", nPermanent, dlqDepth, 2*time.Minute, 30*time.Second)
		stranded, strandedCopies = missing, copies
	}
	if stranded > 0 {
		again = append(append([]workload.Op(nil), good...), permanent...)
	}
	_ = e.pub.Close()
	var err error
	e.pub, err = workload.Dial(e.rabbit.Nodes[1].AMQPURL, e.name+"-publisher2")
	if err != nil {
		t.Fatal(err)
	}
	e.publishCopies(again)
	leftCopies := 0 // copies of completed operations stuck in delay queues
	if stranded == 0 {
		// Every operation is applied, and the copies published again are
		// duplicates; copies a busy or failed-duplicate requeue sent
		// through a delay queue the fault broke stay there (seen in CI,
		// 3.10.8: 18 busy copies in the 250 ms queue): counted, and
		// judged below with the stranded operations.
		leftCopies = e.waitDrainedOrStuck(4*time.Minute, 2*time.Second, 30*time.Second)
	} else { // the stranded copies stay in their delay queues
		// A republished operation that fails again is retried through
		// the next delay queue, which the same fault may have broken
		// too (seen once at full size: every flaky operation stranded
		// in the 300 ms queue, then again in the 600 ms one). While that
		// is all that is missing, on the broker known to do it, publish
		// again: each round runs each stranded operation once more, and
		// a flaky one fails twice at most.
		for round := 1; ; round++ {
			missing, copies := e.waitApplied(nOK+nFlaky, 4*time.Minute, 30*time.Second)
			if missing == 0 || round > 2 || inProcess || !strings.HasPrefix(version, "3.10.") || copies < missing {
				break
			}
			t.Logf("%d operations stranded again (%d copies in delay queues); publishing them again", missing, copies)
			e.publishCopies(again)
		}
		e.waitFor("the dead letters", 2*time.Minute, dlqFilled, nil)
	}
	e.terminateAll()

	dls := e.takeAll(dlq, 10*time.Second)
	counted, redundant := firstDeadLetters(dls)
	// What was in flight at the fault, from the consumers' events: copies
	// waiting their delay (in a delay queue: requeued before the fault,
	// due after it; in process: the event comes at the end of the wait),
	// and dead letters already in the dead-letter queue.
	delayed, deadLetters := 0, 0
	for _, ev := range e.events() {
		wait := time.Duration(ev.DelayMS) * time.Millisecond
		start, end := ev.Time, ev.Time.Add(wait)
		if inProcess {
			start, end = ev.Time.Add(-wait), ev.Time
		}
		switch {
		case ev.Outcome == "dead_lettered" && ev.Time.Before(killedAt):
			deadLetters++
		case wait > 0 && start.Before(killedAt) && end.After(killedAt):
			delayed++
		}
	}
	r := e.report(name, counted, false)
	figures := fmt.Sprintf("%s ops=%d applied_at_fault=%d delayed_in_flight=%d dead_letters_in_flight=%d fault_for=%v applied_during_fault=%d reexecuted=%d redundant_dead_letters=%d stranded=%d stranded_copies=%d stuck_duplicate_copies=%d broker=%s",
		name, len(good)+len(permanent), appliedAtKill, delayed, deadLetters, downFor.Round(100*time.Millisecond), appliedWhileDown,
		r.Reexecuted, redundant, stranded, strandedCopies, leftCopies, version)
	e.figures(figures)
	if appliedAtKill >= nOK+nFlaky {
		t.Errorf("every operation was applied before the fault: it must come mid-run")
	}
	if stranded > 0 {
		msg := fmt.Sprintf("%d operations stranded: %d copies stayed in quorum delay queues after the fault, never dead-lettered back "+
			"to %s (until the operations were published again)", stranded, strandedCopies, e.queue)
		if !inProcess && strings.HasPrefix(version, "3.10.") && strandedCopies >= stranded {
			// Seen on Debian 12's 3.10.8 when the killed node led a
			// delay queue: the queue's at-least-once dead-lettering does
			// not resume on the new leader (see docs/scale.md). A broker defect, reported, not failed here;
			// anything else lost still fails in report.
			t.Logf("%s; RabbitMQ %s is known to strand them", msg, version)
		} else {
			t.Error(msg)
		}
	}
	if leftCopies > 0 {
		// Nothing is missing (report above checked every operation):
		// the copies are duplicates of completed work, which would be
		// acked without running if the broker ever delivered them.
		msg := fmt.Sprintf("%d copies of completed operations stayed in quorum delay queues after the fault, never dead-lettered back to %s",
			leftCopies, e.queue)
		if !inProcess && strings.HasPrefix(version, "3.10.") {
			t.Logf("%s; RabbitMQ %s is known to strand them", msg, version)
		} else {
			t.Error(msg)
		}
	}
	// The consumer on the faulty node lost its connection (killed with
	// the node, or closed by pause_minority) and came back through
	// another node, as the figures above show.
	if n := e.grepAll("connection lost; reconnecting"); n == 0 {
		t.Errorf("no consumer lost its connection while %s was %s: the fault did not reach the consumer on it", leader.Name, what)
	}
	if appliedWhileDown == 0 {
		t.Errorf("nothing was applied while %s was %s: the consumers did not go on through the majority", leader.Name, what)
	}
}

// firstDeadLetters counts, per operation, the dead letters that report its
// failure, and apart from them the redundant ones: copies of an already
// failed operation dead-lettered again from its record, without running.
// Those are the "failed duplicate" ones (a delivery whose ack the fault
// lost), and those whose error is the record's stored text, the reason
// and a colon first (a copy whose first dead letter's confirm the fault
// lost, requeued marked pending and dead-lettered again with the reason
// the record gives; a handler's own error never starts so). An operation
// with only redundant dead letters counts once: its first dead letter was
// never confirmed. Two dead letters from two executions still count as a
// duplicate.
func firstDeadLetters(dls []deadLetter) (counted map[string]int, redundant int) {
	first, again := map[string]int{}, map[string]int{}
	for _, d := range dls {
		reason, _ := d.D.Headers[amqpidem.HeaderReason].(string)
		text, _ := d.D.Headers[amqpidem.HeaderError].(string)
		if reason == "failed duplicate" || strings.HasPrefix(text, reason+": ") {
			again[d.Op]++
		} else {
			first[d.Op]++
		}
	}
	counted = first
	for op, n := range again {
		if first[op] == 0 {
			counted[op] = 1
			n--
		}
		redundant += n
	}
	return counted, redundant
}

// waitApplied waits until want operations are applied, or until none has
// been for stall while the work queue holds no message: then it returns
// how many expected operations are not applied, and how many copies wait
// in the delay queues. It fails the test after timeout.
func (e *env) waitApplied(want int, timeout, stall time.Duration) (missing, delayed int) {
	e.t.Helper()
	return e.waitProgress("operations applied", want, e.applied, timeout, stall)
}

// waitProgress waits until count() reaches want, as waitApplied does for
// the operations applied: when nothing moves for stall while the queue
// itself is empty, it returns how many are missing and the messages left
// in the other queues (delay queues), and it fails the test after timeout.
func (e *env) waitProgress(what string, want int, count func() int, timeout, stall time.Duration) (missing, delayed int) {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	last, since := -1, time.Now()
	for {
		n := count()
		if n >= want {
			return 0, 0
		}
		if n != last {
			last, since = n, time.Now()
		}
		if time.Since(since) >= stall {
			depths, err := e.listQueues()
			if err == nil && depths[e.queue] == [2]int{} {
				for q, d := range depths {
					if q != e.queue && !strings.HasSuffix(q, ".dlq") {
						delayed += d[0] // messages, unacknowledged ones included
					}
				}
				out, _ := e.ctl("list_queues", "-q", "name", "type", "leader", "messages", "messages_ready", "messages_unacknowledged")
				e.t.Logf("no progress for %v with %d of %d %s, the queue empty; the queues:\n%s", stall, n, want, what, out)
				return want - n, delayed
			}
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("timed out after %v waiting for %d %s (%d)", timeout, want, what, n)
		}
		time.Sleep(time.Second)
	}
}

// waitDrainedOrStuck is waitDrained, unless the copies left in delay
// queues stop moving: when the queue is empty and the delay queues' depths
// have not changed for stall, it returns how many copies they hold (a
// delay queue whose dead-lettering the fault broke). It fails the test
// after timeout, and returns 0 once every queue but the dead-letter queue
// has been empty for quiet.
func (e *env) waitDrainedOrStuck(timeout, quiet, stall time.Duration) int {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	var last map[string][2]int
	var emptySince, sameSince time.Time
	for {
		depths, err := e.listQueues()
		if err != nil {
			e.t.Logf("list queues: %v", err)
		} else {
			copies, same := 0, last != nil
			for q, d := range depths {
				if strings.HasSuffix(q, ".dlq") || !strings.HasPrefix(q, e.queue) {
					continue
				}
				if q != e.queue {
					copies += d[0]
				}
				if last[q] != d {
					same = false
				}
			}
			switch {
			case copies == 0 && depths[e.queue] == [2]int{}:
				if emptySince.IsZero() {
					emptySince = time.Now()
				}
				if time.Since(emptySince) >= quiet {
					return 0
				}
			case !same || depths[e.queue] != [2]int{}:
				emptySince, sameSince = time.Time{}, time.Now()
			case time.Since(sameSince) >= stall:
				out, _ := e.ctl("list_queues", "-q", "name", "type", "leader", "messages", "messages_ready", "messages_unacknowledged")
				e.t.Logf("no progress for %v with the queue empty and %d copies in delay queues; the queues:\n%s", stall, copies, out)
				return copies
			}
			last = depths
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("timed out after %v waiting for the queues to drain (queues: %v)", timeout, last)
		}
		time.Sleep(time.Second)
	}
}

func brokerVersion(t *testing.T, url string) string {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	v, _ := conn.Properties["version"].(string)
	return v
}
