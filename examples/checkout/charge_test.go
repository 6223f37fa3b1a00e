package main

import (
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/amqpidem/amqpidemtest"
)

// The handler and its retry policy, tested with the kit: no broker, no
// Redis. A 429 waits what the API asked, a timeout backs off by attempt
// until it is dead-lettered, a declined card and a panic (recovered by
// the middleware) are dead-lettered at once.
func TestCharge(t *testing.T) {
	k := amqpidemtest.New(t, config("payments"), handler(slog.New(slog.DiscardHandler)))

	r := k.Deliver(amqpidemtest.Message{ID: "p1", Body: []byte("ok"), ReplyTo: "replies"})
	if r.Outcome != amqpidem.Completed || !r.Acked || string(r.Reply.Msg.Body) != "receipt p1" {
		t.Fatalf("ok: %v %q %v", r.Outcome, r.Reason, r.Err)
	}
	if r := k.Deliver(amqpidemtest.Message{ID: "p1", Body: []byte("ok")}); r.Outcome != amqpidem.Duplicate || !r.Acked {
		t.Fatalf("copy: %v", r.Outcome)
	}

	// A 429 waits what the API said, whatever RetryDelay says.
	if r := k.Deliver(amqpidemtest.Message{ID: "p2", Body: []byte("429")}); r.Outcome != amqpidem.Retried || r.Requeued.Delay != rateLimitWait {
		t.Fatalf("429: %v %+v", r.Outcome, r.Requeued)
	}

	// Timeouts back off by attempt, then are dead-lettered.
	r = k.Deliver(amqpidemtest.Message{ID: "p3", Body: []byte("timeout")})
	var delays []time.Duration
	for r.Outcome == amqpidem.Retried {
		delays = append(delays, r.Requeued.Delay)
		r = k.Redeliver(r)
	}
	if len(delays) != 3 || delays[0] != 10*time.Second || delays[2] != 30*time.Second {
		t.Fatalf("timeout delays: %v", delays)
	}
	if r.Outcome != amqpidem.DeadLettered || r.Reason != "attempts exhausted" || r.DeadLetter == nil {
		t.Fatalf("timeout, last: %v %q", r.Outcome, r.Reason)
	}

	// Declined, and a panic the middleware recovered: dead-lettered at once.
	for _, body := range []string{"declined", "panic"} {
		r := k.Deliver(amqpidemtest.Message{ID: body, Body: []byte(body)})
		if r.Outcome != amqpidem.DeadLettered || r.Reason != "permanent failure" || r.Attempt != 1 {
			t.Fatalf("%s: %v %q %v", body, r.Outcome, r.Reason, r.Err)
		}
	}
	if r := k.Deliver(amqpidemtest.Message{ID: "declined-2", Body: []byte("declined")}); !errors.Is(r.Err, errDeclined) {
		t.Fatalf("declined: %v", r.Err)
	}
}
