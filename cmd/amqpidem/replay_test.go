package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"maps"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

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

// On a quorum dead-letter queue with a delivery limit, each replay that
// reads a dead letter without taking it counts as a delivery of it: a
// run of --key replays must not push the others past the limit (with
// x-delivery-limit 2, the third pass dropped them all).
func TestReplayKeyQuorumDeliveryLimit(t *testing.T) {
	r := newRigWith(t, 2, func(c *amqpidem.Config) {
		c.DeadLetterQueueArgs = amqp.Table{"x-queue-type": "quorum", "x-delivery-limit": int32(2)}
	})
	r.publish("q-1", "q-2", "q-3")
	r.waitOutcomes(amqpidem.DeadLettered, 3)
	r.broken.Store(false)
	r.mustCLI(0, "dlq", "replay", r.queue, "--key", "q-3", "--forget")
	r.waitOutcomes(amqpidem.Completed, 1)
	for pass := 0; pass < 4; pass++ {
		r.waitDLQLen(2)
		r.mustCLI(3, "dlq", "replay", r.queue, "--key", "no-such-key")
	}
	r.waitDLQLen(2)
	out := r.mustCLI(0, "dlq", "replay", r.queue, "--all", "--forget", "--yes")
	if !strings.Contains(out, "2 replayed") {
		t.Fatalf("replay --all after the --key passes:\n%s", out)
	}
	r.waitOutcomes(amqpidem.Completed, 2)
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range []string{"q-1", "q-2", "q-3"} {
		if r.runs[id] != 1 {
			t.Errorf("%s ran %d times after the fix, want 1", id, r.runs[id])
		}
	}
}

// waitDLQLen waits until the dead-letter queue holds n messages: messages
// a closed channel gives back to a quorum queue are counted a moment
// later.
func (r *rig) waitDLQLen(n int) {
	r.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := r.dlqLen()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("the dead-letter queue holds %d messages, want %d", got, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A wrong --prefix finds no record: replay --all --forget must not take
// that as "expired, replay it" for dead letters whose consumer recorded a
// failure (it reported "3 replayed" and exit 0, and the consumer, finding
// the failed records, dead-lettered them again as failed duplicates).
func TestReplayWrongPrefix(t *testing.T) {
	r := newRig(t, 2)
	r.publish("w-1", "w-2", "w-3")
	r.waitOutcomes(amqpidem.DeadLettered, 3)
	r.broken.Store(false)
	wrong := append([]string{}, r.flags...)
	wrong[len(wrong)-1] = r.prefix + "-wrong"
	run := func(args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(bin, append(args, wrong...)...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatal(err)
		}
		return stdout.String(), stderr.String(), cmd.ProcessState.ExitCode()
	}
	out, errOut, code := run("dlq", "replay", r.queue, "--all", "--forget", "--yes")
	if code != 4 || !strings.Contains(out, "0 replayed") || !strings.Contains(out, "--prefix") {
		t.Fatalf("replay --all --forget under a wrong prefix: exit %d\n%s\n%s", code, out, errOut)
	}
	// Without --forget it replays (an expired record is not an error),
	// but warns.
	out, errOut, _ = run("dlq", "replay", r.queue, "--all", "--dry-run")
	if !strings.Contains(out, "3 would replay") || !strings.Contains(errOut, "no record found") {
		t.Fatalf("replay --all --dry-run under a wrong prefix:\n%s\n%s", out, errOut)
	}
	r.waitDLQLen(3)
	// Told the records are gone for good, it replays them.
	out, errOut, code = run("dlq", "replay", r.queue, "--all", "--forget", "--yes", "--allow-missing-record", "--dry-run")
	if code != 0 || !strings.Contains(out, "3 would replay") {
		t.Fatalf("replay --allow-missing-record: exit %d\n%s\n%s", code, out, errOut)
	}
	// Under the right prefix, the failed records are forgotten and run;
	// the first dead letter's record forgotten already (by a replay
	// killed after forgetting it, say) is held back until the second
	// one's is found, then replayed in its place.
	r.waitDLQLen(3)
	var list []struct{ Key string }
	if err := json.Unmarshal([]byte(r.mustCLI(0, "dlq", "list", r.queue, "--json")), &list); err != nil || len(list) != 3 {
		t.Fatalf("dlq list: %v %+v", err, list)
	}
	r.mustCLI(0, "forget", list[0].Key, "--queue", r.queue)
	r.waitDLQLen(3)
	out = r.mustCLI(0, "dlq", "replay", r.queue, "--all", "--forget", "--yes", "--json")
	var done []struct {
		Index  int
		Key    string
		Action string
	}
	if err := json.Unmarshal([]byte(out), &done); err != nil || len(done) != 3 {
		t.Fatalf("replay under the right prefix: %v\n%s", err, out)
	}
	for i, d := range done {
		if d.Action != "replayed" || d.Index != i+1 || d.Key != list[i].Key {
			t.Fatalf("replay under the right prefix: %+v, want %+v replayed in order", done, list)
		}
	}
	r.waitOutcomes(amqpidem.Completed, 3)
}

// dlq list --json cut by --limit says so: each entry carries the queue's
// total (the top level stays an array, for the scripts that read it), and
// stderr names the cut.
func TestListJSONLimitTotal(t *testing.T) {
	r := newRig(t, 2)
	r.publish("l-1", "l-2", "l-3")
	r.waitOutcomes(amqpidem.DeadLettered, 3)
	out, errOut, code := r.cli("dlq", "list", r.queue, "--json", "--limit", "2")
	var list []struct {
		Key   string
		Total int
	}
	if err := json.Unmarshal([]byte(out), &list); code != 0 || err != nil {
		t.Fatalf("dlq list --json --limit 2: exit %d, %v\n%s\n%s", code, err, out, errOut)
	}
	if len(list) != 2 || list[0].Total != 3 || list[1].Total != 3 || !strings.Contains(errOut, "the first 2 of 3 dead letters") {
		t.Fatalf("dlq list --json --limit 2: %+v, stderr %q; want 2 entries of a total of 3, and the cut on stderr", list, errOut)
	}
	r.waitDLQLen(3)
	out = r.mustCLI(0, "dlq", "list", r.queue, "--json")
	if err := json.Unmarshal([]byte(out), &list); err != nil || len(list) != 3 || list[2].Total != 3 {
		t.Fatalf("dlq list --json: %v %+v", err, list)
	}
}

// A dead letter whose headers are just under frame_max is replayed (its
// copy goes without x-amqpidem-replayed-at, which would take it over: the
// broker would close the connection), and one the broker refuses by
// closing the channel (its original exchange is gone) is left while the
// replay goes on with the others. Scenario 21 found both stopping the
// run (exit 1), every later dead letter stuck.
func TestReplayGoesOnPastRefusedCopies(t *testing.T) {
	r := newRig(t, 2)
	ch, err := r.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	dlq := r.queue + ".dlq"
	if _, err := ch.QueueDeclare(dlq, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	big := amqp.Publishing{MessageId: "big", Body: []byte("x"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{
		amqpidem.HeaderOriginalExchange: "", amqpidem.HeaderOriginalRoutingKey: r.queue, "pad": ""}}
	frameMax := r.conn.Config.FrameSize
	big.Headers["pad"] = strings.Repeat("p", frameMax-amqpidem.HeaderFrameSize(&big)-16) // 16 bytes under
	if n := amqpidem.HeaderFrameSize(&big); n > frameMax || n < frameMax-16 {
		t.Fatalf("the big letter's header frame is %d bytes, want just under %d", n, frameMax)
	}
	noExchange := amqp.Publishing{MessageId: "lost-exchange", Body: []byte("y"), Headers: amqp.Table{
		amqpidem.HeaderOriginalExchange: r.queue + ".deleted", amqpidem.HeaderOriginalRoutingKey: "rk"}}
	for _, m := range []amqp.Publishing{big, noExchange} {
		if err := ch.Publish("", dlq, false, false, m); err != nil {
			t.Fatal(err)
		}
	}
	r.publish("pay-20") // dead-lettered behind them
	r.waitOutcomes(amqpidem.DeadLettered, 1)
	r.broken.Store(false)

	out, errOut, code := r.cli("dlq", "replay", r.queue, "--all", "--forget", "--yes", "--to-original-exchange", "--trust-headers")
	if code != 4 || !strings.Contains(out, "404") || !strings.Contains(out, "2 replayed") || !strings.Contains(out, "1 left") {
		t.Fatalf("replay: exit %d, want 4 with big and pay-20 replayed, lost-exchange left\n%s%s", code, out, errOut)
	}
	r.waitOutcomes(amqpidem.Completed, 2)
	if n := r.dlqLen(); n != 1 {
		t.Errorf("%d dead letters left, want the refused one", n)
	}
}
