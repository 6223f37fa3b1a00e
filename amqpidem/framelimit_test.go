package amqpidem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// nearLimitHeader is a header value that brings a message's content
// header frame to about 100 bytes under RabbitMQ's default frame_max
// (131072): the message itself is accepted, but a copy with amqpidem's
// headers added (150-300 bytes) would not be.
// headersDropped is amqpidem.HeaderHeadersDropped, spelled out so that
// this test also builds, and fails, on the code before it.
const headersDropped = "x-amqpidem-headers-dropped"

func nearLimitHeader(messageID string) string {
	// frame: 8 bytes of framing, 14 of class/weight/size/flags;
	// properties: delivery mode (1), message id (1+len), headers table
	// (4, then key "big": 1+3, value: 1+4+n).
	const frameMax, under = 131072, 100
	n := frameMax - 8 - 14 - 1 - (1 + len(messageID)) - 4 - (1 + 3) - (1 + 4) - under
	return strings.Repeat("h", n)
}

// A message whose headers are near the frame limit is dead-lettered once,
// body intact and its oversized header dropped (HeaderHeadersDropped says
// so), whether it failed for good or after its retries (each held for its
// delay and nacked back, headers intact, since a requeued copy cannot
// fit): a copy with amqpidem's headers would exceed frame_max, the broker
// closed the publishing channel, and the message looped every
// UnavailableDelay forever (issue 36, finding 3). Messages after it are
// settled normally.
func TestNearFrameLimitDeadLettered(t *testing.T) {
	e := newEnv(t, nil)
	var ran runs
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Config: amqpidem.Config{Observer: rec, UnavailableDelay: 200 * time.Millisecond, MaxAttempts: 3,
			Backoff: amqpidem.Exponential(200*time.Millisecond, time.Second)},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		ran.add(d.MessageId)
		switch d.MessageId {
		case "big-permanent":
			return nil, amqpidem.Permanent(errors.New("refused for good"))
		case "big-retry":
			return nil, errors.New("try again later")
		}
		return nil, nil
	}))

	for _, id := range []string{"big-permanent", "big-retry"} {
		e.publish(amqp.Publishing{MessageId: id, Body: []byte("body of " + id),
			Headers: amqp.Table{"big": nearLimitHeader(id)}})
	}
	e.publish(amqp.Publishing{MessageId: "small", Body: []byte("x")})

	rec.waitFor(t, 10*time.Second, "both near-limit messages dead-lettered, the small one completed", func(evs []amqpidem.Event) bool {
		return count(evs, "big-permanent", amqpidem.DeadLettered) == 1 &&
			count(evs, "big-retry", amqpidem.DeadLettered) == 1 &&
			count(evs, "small", amqpidem.Completed) == 1
	})
	got := map[string]amqp.Delivery{}
	for len(got) < 2 {
		m, ok := e.get(e.queue+".dlq", 5*time.Second)
		if !ok {
			t.Fatalf("dead-letter queue holds %v, want big-permanent and big-retry", keys(got))
		}
		got[m.MessageId] = m
	}
	for id, m := range got {
		if want := "body of " + id; string(m.Body) != want {
			t.Errorf("%s: dead letter's body %q, want %q", id, m.Body, want)
		}
		if _, ok := m.Headers["big"]; ok {
			t.Errorf("%s: dead letter kept the oversized header", id)
		}
		if s, _ := m.Headers[headersDropped].(string); !strings.Contains(s, "big") {
			t.Errorf("%s: %s = %q, want it to name the dropped header", id, headersDropped, s)
		}
		if m.Headers[amqpidem.HeaderKey] != id || m.Headers[amqpidem.HeaderReason] == nil {
			t.Errorf("%s: dead letter lacks its fault headers: %v", id, m.Headers)
		}
	}
	if m, ok := e.get(e.queue, 500*time.Millisecond); ok {
		t.Errorf("work queue still holds %s", m.MessageId)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, ev := range rec.events {
		if ev.Key != "big-retry" && ev.Key != "big-permanent" {
			continue
		}
		switch {
		case ev.Outcome == amqpidem.DeadLettered:
			if ev.Err == nil || !strings.Contains(ev.Err.Error(), "frame_max") {
				t.Errorf("%s dead-lettered without saying headers were dropped: %q %v", ev.Key, ev.Reason, ev.Err)
			}
		case ev.Key == "big-retry" && ev.Outcome == amqpidem.Abandoned && strings.HasSuffix(ev.Reason, "; copy too large, nacked"):
			// Held for its delay and nacked back: retried, headers intact.
		default:
			t.Errorf("%s %s (%q: %v): a copy that cannot fit must not go round", ev.Key, ev.Outcome, ev.Reason, ev.Err)
		}
	}
	if n := ran.get("big-retry"); n != 3 {
		t.Errorf("big-retry ran %d times, want MaxAttempts (3): retried with its headers, then dead-lettered", n)
	}
	if n := ran.get("big-permanent"); n != 1 {
		t.Errorf("big-permanent ran %d times, want 1", n)
	}
}
