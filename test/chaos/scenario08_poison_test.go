//go:build linux

package chaos_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 8a, poison messages: operations that fail twice and then
// succeed go through the retry tiers (delay queues) with their attempt
// count carried across each hop; operations that fail for good, or on every
// attempt, are dead-lettered exactly once, with the fault headers.
func TestChaos08Poison(t *testing.T) {
	e := newEnv(t, envOptions{})
	const maxAttempts = 4
	nOK, nFlaky, nPermanent, nExhausted := pick(50, 300), pick(10, 50), pick(5, 20), pick(5, 20)
	mk := func(kind string, n int, p workload.Plan) []workload.Op {
		ops := make([]workload.Op, n)
		for i := range ops {
			ops[i] = workload.Op{ID: fmt.Sprintf("%s-%s%d", e.name, kind, i), Plan: p}
		}
		return ops
	}
	ok := mk("ok", nOK, workload.Plan{})
	flaky := mk("flaky", nFlaky, workload.Plan{FailUntil: 3})
	permanent := mk("permanent", nPermanent, workload.Plan{Permanent: true})
	exhausted := mk("exhausted", nExhausted, workload.Plan{AlwaysFail: true})
	terminal := append(append([]workload.Op(nil), permanent...), exhausted...)
	good := append(append([]workload.Op(nil), ok...), flaky...)
	e.addOps(ledger.ExpectApply, good)
	e.addOps(ledger.ExpectDeadLetter, terminal)
	for i := range 2 {
		e.consumer(fmt.Sprintf("%s-c%d", e.name, i), "-max-attempts", fmt.Sprint(maxAttempts), "-backoff", "100ms",
			"-in-progress-delay", "300ms", "-unavailable-delay", "300ms")
	}
	e.publishCopies(append(good, terminal...))

	e.settle(nOK+nFlaky, 3*time.Minute, 2*time.Second)
	dlq := e.queue + ".dlq"
	e.waitFor("the dead letters", 2*time.Minute, func() bool {
		d, _ := e.listQueues()
		return d[dlq][0] >= nPermanent+nExhausted
	}, nil)
	e.terminateAll()
	dls := e.takeAll(dlq, 10*time.Second)
	e.report("poison", countByOp(dls), false)

	// Attempts survive every hop: 1, 2, 3, each copy's header one less.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	check := func(ops []workload.Op, want int) {
		for _, o := range ops {
			rows, err := e.led.Pool().Query(ctx, `SELECT attempt, coalesce(header_attempt, 0) FROM executions WHERE op_id = $1 ORDER BY seq`, o.ID)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for rows.Next() {
				var a, h int
				if err := rows.Scan(&a, &h); err != nil {
					t.Fatal(err)
				}
				got = append(got, fmt.Sprintf("%d/%d", a, h))
			}
			rows.Close()
			var exp []string
			for a := 1; a <= want; a++ {
				exp = append(exp, fmt.Sprintf("%d/%d", a, a-1))
			}
			if strings.Join(got, " ") != strings.Join(exp, " ") {
				t.Errorf("%s: executions attempt/header %v, want %v", o.ID, got, exp)
			}
		}
	}
	check(flaky, 3)
	check(permanent, 1)
	check(exhausted, maxAttempts)

	for _, dl := range dls {
		h := dl.D.Headers
		reason, _ := h[amqpidem.HeaderReason].(string)
		attempt, _ := h[amqpidem.HeaderAttempt].(int64)
		errText, _ := h[amqpidem.HeaderError].(string)
		consumer, _ := h[amqpidem.HeaderConsumer].(string)
		_, seen := h[amqpidem.HeaderFirstSeen].(time.Time)
		rk, _ := h[amqpidem.HeaderOriginalRoutingKey].(string)
		wantReason, wantAttempt := "permanent failure", int64(1)
		if strings.Contains(dl.Op, "exhausted") {
			wantReason, wantAttempt = "attempts exhausted", maxAttempts
		}
		if reason != wantReason || attempt != wantAttempt || !strings.Contains(errText, "chaos: ") ||
			!strings.HasPrefix(consumer, e.name) || !seen || rk != e.queue || dl.D.MessageId != dl.Op {
			t.Errorf("dead letter of %s: headers %v; want reason %q, attempt %d, the handler's error, the consumer, first-seen, routing key %q",
				dl.Op, h, wantReason, wantAttempt, e.queue)
		}
	}
}

// Scenario 8b, a dead-letter target that does not exist: the dead-letter
// exchange is missing (the broker closes the channel), or exists with no
// queue bound (the publish is returned). The terminal messages go round
// the queue, marked pending, until the target appears; then each is
// dead-lettered once. None is lost meanwhile.
func TestChaos08MissingDeadLetterTarget(t *testing.T) {
	for _, declareExchange := range []bool{false, true} {
		name := "exchange-missing"
		if declareExchange {
			name = "unroutable"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, envOptions{})
			nPermanent, nOK := pick(5, 20), pick(20, 100)
			// The target queue's name ends in .dlq: the helpers count it
			// as a dead-letter queue, not one to drain.
			dlx, dlq := e.name+"-dlx", e.queue+".target.dlq"
			e.ownExchange(dlx)
			e.ownQueue(dlq)
			if declareExchange {
				if err := e.pub.Channel().ExchangeDeclare(dlx, "direct", true, false, false, false, nil); err != nil {
					t.Fatal(err)
				}
			}
			permanent := make([]workload.Op, nPermanent)
			for i := range permanent {
				permanent[i] = workload.Op{ID: fmt.Sprintf("%s-permanent%d", e.name, i), Plan: workload.Plan{Permanent: true}}
			}
			e.addOps(ledger.ExpectDeadLetter, permanent)
			e.publishCopies(permanent)
			ok := workload.Storm(e.name+"-op", nOK, 2, 10, e.rng)
			e.publish(ok)
			for i := range 2 {
				e.consumer(fmt.Sprintf("%s-c%d", e.name, i), "-dlx", dlx, "-unavailable-delay", "300ms",
					"-in-progress-delay", "300ms")
			}
			e.waitFor("the good operations", 2*time.Minute, func() bool { return e.applied() >= nOK }, nil)
			e.waitFor("the dead letters to be refused a few times", 2*time.Minute, func() bool {
				n := 0
				for _, ev := range e.events() {
					if ev.Outcome == "abandoned" && ev.Reason == "permanent failure" {
						n++
					}
				}
				return n >= 3*nPermanent
			}, nil)

			// The target appears.
			ch := e.pub.Channel()
			if err := ch.ExchangeDeclare(dlx, "direct", true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
				t.Fatal(err)
			}
			if err := ch.QueueBind(dlq, e.queue+".dlq", dlx, false, amqp.Table{}); err != nil {
				t.Fatal(err)
			}
			e.waitFor("every dead letter at the new target", 2*time.Minute, func() bool {
				d, _ := e.listQueues()
				return d[dlq][0] >= nPermanent
			}, nil)
			e.settle(nOK, 2*time.Minute, 2*time.Second)
			e.terminateAll()
			dls := e.takeAll(dlq, 10*time.Second)
			e.report("deadletter-"+name, countByOp(dls), false)
			for _, dl := range dls {
				if reason, _ := dl.D.Headers[amqpidem.HeaderReason].(string); reason != "permanent failure" {
					t.Errorf("dead letter of %s: reason %q, want %q", dl.Op, reason, "permanent failure")
				}
				if _, pending := dl.D.Headers[amqpidem.HeaderDeadLetterPending]; pending {
					t.Errorf("dead letter of %s still carries %s", dl.Op, amqpidem.HeaderDeadLetterPending)
				}
			}
		})
	}
}
