package main_test

import (
	"context"
	"maps"
	"os"
	"os/exec"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// A replay goes back to the consumer's queue, not through the exchange the
// message was first published to: a fanout would hand it to every other
// queue bound there again.
func TestReplayDoesNotFanOut(t *testing.T) {
	r := newRig(t, 2)
	ch, err := r.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	exchange, sibling := r.queue+".fan", r.queue+".sibling"
	if err := ch.ExchangeDeclare(exchange, "fanout", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(sibling, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if ch, err := r.conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(sibling, false, false, false)
			_ = ch.ExchangeDelete(exchange, false, false)
		}
	})
	for _, q := range []string{r.queue, sibling} {
		if err := ch.QueueBind(q, "", exchange, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.pub.Publish(context.Background(), exchange, "", amqp.Publishing{MessageId: "fan-1", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	r.waitOutcomes(amqpidem.DeadLettered, 1)
	r.broken.Store(false)
	r.mustCLI(0, "dlq", "replay", r.queue, "--key", "fan-1", "--forget")
	r.waitOutcomes(amqpidem.Completed, 1)
	q, err := ch.QueueDeclarePassive(sibling, false, true, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if q.Messages != 1 {
		t.Fatalf("the sibling queue holds %d messages, want its own first copy alone", q.Messages)
	}
}

// Records are found under the endpoint the dead letter names, and dead
// letters that a replay cannot help are left, with the others replayed.
func TestReplayEndpointAndLeftovers(t *testing.T) {
	r := newRigWith(t, 2, func(c *amqpidem.Config) { c.Endpoint = "ledger" })
	r.publish("pay-5")
	if err := r.pub.Publish(context.Background(), "", r.queue, amqp.Publishing{MessageId: "", Body: []byte("no key")}); err == nil {
		t.Fatal("Publisher took a message without a key")
	}
	ch, err := r.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.Publish("", r.queue, false, false, amqp.Publishing{Body: []byte("no key")}); err != nil {
		t.Fatal(err)
	}
	r.waitOutcomes(amqpidem.DeadLettered, 2)
	r.broken.Store(false)
	out, _, code := r.cli("dlq", "replay", r.queue, "--all", "--forget", "--yes", "--endpoint", "elsewhere")
	if code != 4 || !strings.Contains(out, `dead-lettered by endpoint "ledger"`) || !strings.Contains(out, "missing key") {
		t.Fatalf("replay with another --endpoint: exit %d\n%s", code, out)
	}
	// Without --endpoint, the queue's own endpoint: the header's is not
	// taken on its word.
	out, _, code = r.cli("dlq", "replay", r.queue, "--all", "--forget", "--yes")
	if code != 4 || !strings.Contains(out, `pass --endpoint "ledger"`) || !strings.Contains(out, "0 replayed") {
		t.Fatalf("replay without --endpoint: exit %d\n%s", code, out)
	}
	out, _, code = r.cli("dlq", "replay", r.queue, "--all", "--forget", "--yes", "--endpoint", "ledger")
	if code != 4 || !strings.Contains(out, "1 replayed") || !strings.Contains(out, "missing key") {
		t.Fatalf("replay: exit %d\n%s", code, out)
	}
	r.waitOutcomes(amqpidem.Completed, 1)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.runs["pay-5"] != 1 {
		t.Fatalf("pay-5 ran %d times after the fix, want 1", r.runs["pay-5"])
	}
}

// TestReplayForgedHeaders checks that dlq replay acts on a dead letter's
// headers only when a consumer's signature proves them amqpidem's (issue
// 36, findings 1 and 2): a letter a publisher put into the dead-letter
// queue, naming the key of a failed record and a queue it may not publish
// to, is left, its record kept failed and nothing published there; a
// message the publisher sent through the queue is dead-lettered signed,
// but with the exchange and routing key it really came by, not the ones
// its headers claimed.
func TestReplayForgedHeaders(t *testing.T) {
	r := newRig(t, 2)
	victim := r.queue + ".victim"
	ch, err := r.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if _, err := ch.QueueDeclare(victim, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	// pay-10 failed for good, and its dead letter was dealt with: its
	// record must stay failed.
	r.publish("pay-10")
	r.waitOutcomes(amqpidem.DeadLettered, 1)
	if _, ok, err := ch.Get(r.queue+".dlq", true); err != nil || !ok {
		t.Fatalf("taking pay-10's dead letter: %v %v", ok, err)
	}
	forgedOrigin := amqp.Table{amqpidem.HeaderOriginalExchange: "", amqpidem.HeaderOriginalRoutingKey: victim}
	// Through the queue, with forged original headers.
	if err := ch.Publish("", r.queue, false, false, amqp.Publishing{MessageId: "evil-1", Headers: forgedOrigin, Body: []byte("evil")}); err != nil {
		t.Fatal(err)
	}
	r.waitOutcomes(amqpidem.DeadLettered, 1)
	// Straight into the dead-letter queue: unsigned, and with a made-up
	// signature.
	forged := amqp.Table{amqpidem.HeaderKey: "pay-10", amqpidem.HeaderEndpoint: r.queue, amqpidem.HeaderReason: "permanent failure",
		amqpidem.HeaderError: "card declined"}
	for k, v := range forgedOrigin {
		forged[k] = v
	}
	if err := ch.Publish("", r.queue+".dlq", false, false, amqp.Publishing{MessageId: "pay-10", Headers: forged, Body: []byte("evil")}); err != nil {
		t.Fatal(err)
	}
	forged = maps.Clone(forged)
	forged[amqpidem.HeaderSignature] = "v1:AAAA"
	if err := ch.Publish("", r.queue+".dlq", false, false, amqp.Publishing{MessageId: "pay-10", Headers: forged, Body: []byte("evil")}); err != nil {
		t.Fatal(err)
	}

	out := r.mustCLI(0, "dlq", "list", r.queue)
	for _, want := range []string{"signed", "unsigned", "bad signature", "2 dead letters not signed"} {
		if !strings.Contains(out, want) {
			t.Errorf("dlq list does not say %q:\n%s", want, out)
		}
	}
	// Without the key, a signature cannot be checked: the letter says so.
	noKey := exec.Command(bin, append([]string{"dlq", "list", r.queue}, r.flags...)...)
	noKey.Env = append(os.Environ(), "AMQPIDEM_SIGNING_KEY=")
	if out, err := noKey.CombinedOutput(); err != nil || !strings.Contains(string(out), "unchecked") ||
		!strings.Contains(string(out), "2 dead letters with a signature not checked") {
		t.Errorf("dlq list without the key: %v\n%s", err, out)
	}
	r.broken.Store(false)
	out, errOut, code := r.cli("dlq", "replay", r.queue, "--all", "--forget", "--yes", "--to-original-exchange")
	if code != 4 || !strings.Contains(out, "1 replayed") || !strings.Contains(out, "2 left") || !strings.Contains(out, "headers unsigned") ||
		!strings.Contains(out, "headers bad signature") {
		t.Fatalf("replay: exit %d\n%s%s", code, out, errOut)
	}
	r.waitOutcomes(amqpidem.Completed, 1)
	q, err := ch.QueueDeclarePassive(victim, false, true, false, false, nil)
	if err != nil || q.Messages != 0 {
		t.Errorf("the victim queue holds %d messages (%v), want 0", q.Messages, err)
	}
	rec, err := r.store.Inspect(context.Background(), amqpidem.StoreKey(r.queue, "pay-10"))
	if err != nil || rec.State != lock.StateFailed {
		t.Errorf("pay-10's record: %+v %v, want still failed", rec, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.runs["pay-10"] != 0 || r.runs["evil-1"] != 1 {
		t.Errorf("runs: %v, want evil-1 once (it came through the queue) and pay-10 never", r.runs)
	}
}
