package amqpidemtest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/amqpidem/amqpidemtest"
	"github.com/amqpidem/amqpidem/lock"
)

var errFlaky = errors.New("flaky")

// handler completes "ok" messages (staging one message and replying),
// fails "flaky" ones retryably and "bad" ones for good, and counts runs.
func handler(runs map[string]int) amqpidem.HandlerFunc {
	return func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		runs[d.MessageId]++
		switch string(d.Body) {
		case "flaky":
			return nil, errFlaky
		case "bad":
			return nil, amqpidem.Permanent(errors.New("bad input"))
		}
		if err := amqpidem.Stage(ctx, "", "next", amqp.Publishing{Body: []byte("after " + d.MessageId)}); err != nil {
			return nil, err
		}
		return []byte("done " + d.MessageId), nil
	}
}

func TestKitOutcomes(t *testing.T) {
	runs := map[string]int{}
	k := amqpidemtest.New(t, amqpidem.Config{MaxAttempts: 3, Backoff: amqpidem.Steps(time.Second, 5*time.Second)}, handler(runs))

	// Completed: acked, its staged message published, its reply sent.
	r := k.Deliver(amqpidemtest.Message{ID: "a", Body: []byte("ok"), ReplyTo: "replies"})
	if r.Outcome != amqpidem.Completed || !r.Acked || r.Nacked || r.Requeued != nil || r.DeadLetter != nil {
		t.Fatalf("first: %+v", r)
	}
	if len(r.Published) != 1 || r.Published[0].RoutingKey != "next" || string(r.Published[0].Msg.Body) != "after a" {
		t.Fatalf("staged: %+v", r.Published)
	}
	if r.Reply == nil || string(r.Reply.Msg.Body) != "done a" {
		t.Fatalf("reply: %+v", r.Reply)
	}
	// A duplicate, and a redelivery: acked without running, the stored
	// reply sent again.
	for _, m := range []amqpidemtest.Message{{ID: "a", Body: []byte("ok"), ReplyTo: "replies"}, {ID: "a", Body: []byte("ok"), ReplyTo: "replies", Redelivered: true}} {
		r := k.Deliver(m)
		if r.Outcome != amqpidem.Duplicate || !r.Acked || r.Reply == nil || string(r.Reply.Msg.Body) != "done a" || len(r.Published) != 0 {
			t.Fatalf("copy %+v: %+v", m, r)
		}
	}
	if got, want := runs["a"], 1; got != want {
		t.Fatalf("runs of a: got %d, want %d", got, want)
	}

	// Retried with the backoff's steps, then dead-lettered at MaxAttempts.
	r = k.Deliver(amqpidemtest.Message{ID: "f", Body: []byte("flaky")})
	var delays []time.Duration
	for r.Outcome == amqpidem.Retried {
		delays = append(delays, r.Requeued.Delay)
		r = k.Redeliver(r)
	}
	if got, want := fmt.Sprint(delays), "[1s 5s]"; got != want {
		t.Fatalf("retry delays: got %s, want %s", got, want)
	}
	if r.Outcome != amqpidem.DeadLettered || r.Reason != "attempts exhausted" || r.Attempt != 3 || r.DeadLetter == nil || !r.Acked {
		t.Fatalf("last attempt: %+v", r)
	}
	if got := r.DeadLetter.Msg.Headers[amqpidem.HeaderReason]; got != "attempts exhausted" {
		t.Fatalf("dead letter's reason header: %v", got)
	}
	if !errors.Is(r.Err, errFlaky) || runs["f"] != 3 {
		t.Fatalf("err %v, runs %d", r.Err, runs["f"])
	}

	// A permanent failure: dead-lettered at once; a copy is dead-lettered
	// too, without running.
	r = k.Deliver(amqpidemtest.Message{ID: "b", Body: []byte("bad")})
	if r.Outcome != amqpidem.DeadLettered || r.Reason != "permanent failure" || r.DeadLetter.RoutingKey != amqpidemtest.DefaultQueue+".dlq" {
		t.Fatalf("bad: %+v", r)
	}
	if r := k.Deliver(amqpidemtest.Message{ID: "b", Body: []byte("bad")}); r.Outcome != amqpidem.DeadLettered || runs["b"] != 1 {
		t.Fatalf("copy of bad: %v, runs %d", r.Outcome, runs["b"])
	}
	// The record says so.
	res, err := k.Store().Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(amqpidemtest.DefaultQueue, "b")})
	if err != nil || res.Status != lock.Failed {
		t.Fatalf("b's record: %v %v", res.Status, err)
	}
}

// TestKitRefuse: a staged message the broker returns is tried with each
// copy and given up at MaxAttempts.
func TestKitRefuse(t *testing.T) {
	k := amqpidemtest.New(t, amqpidem.Config{MaxAttempts: 2}, handler(map[string]int{}))
	k.Refuse("next", amqpidem.ErrUnroutable)
	r := k.Deliver(amqpidemtest.Message{ID: "a", Body: []byte("ok")})
	if r.Outcome != amqpidem.Abandoned || r.Reason != "outbox returned" || r.Requeued == nil {
		t.Fatalf("first: %v %q", r.Outcome, r.Reason)
	}
	if r = k.Redeliver(r); r.Outcome != amqpidem.OutboxGivenUp || r.Outbox.Returned != 1 || !r.Acked {
		t.Fatalf("copy: %v %q %+v", r.Outcome, r.Reason, r.Outbox)
	}
}

// TestKitHeaderKey: a Config.Key reading a header, and a message without
// it dead-lettered.
func TestKitHeaderKey(t *testing.T) {
	k := amqpidemtest.New(t, amqpidem.Config{Key: amqpidem.Header("op")}, handler(map[string]int{}))
	if r := k.Deliver(amqpidemtest.Message{Headers: amqp.Table{"op": "x"}, Body: []byte("ok")}); r.Outcome != amqpidem.Completed || r.Key != "x" {
		t.Fatalf("with the header: %v %q", r.Outcome, r.Key)
	}
	if r := k.Deliver(amqpidemtest.Message{Body: []byte("ok")}); r.Outcome != amqpidem.DeadLettered || !errors.Is(r.Err, amqpidem.ErrNoKey) {
		t.Fatalf("without: %v %v", r.Outcome, r.Err)
	}
}
