//go:build linux

package chaos_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// cliBin is the operators' CLI, run by scenario 21 as an operator would.
var cliBin = &program{pkg: "github.com/amqpidem/amqpidem/cmd/amqpidem"}

// frameMax is RabbitMQ's default frame_max, which the shared broker keeps:
// a message's content header frame (its properties, headers mostly) must
// fit in it.
const frameMax = 131072

// hostileDepth is how deep scenario 21 nests its tables: the x-deep
// header's innermost table is at this depth, the headers table at 0.
const hostileDepth = 32

// hostile is one message of scenario 21's attacker.
type hostile struct {
	name    string
	id      string // MessageId: the key of A's consumers
	headers amqp.Table
	plan    workload.Plan
	// pad fills the headers with string headers until the content header
	// frame is frameMax-pad bytes (0: no padding).
	pad int
	// dlq: published straight into A's dead-letter queue.
	dlq bool
}

// Scenario 21, a hostile publisher (issue 36): consumers that sign their
// copies (Config.SigningKey) on queue A, and another endpoint B whose
// failed records an attacker would like forgotten. Normal traffic on A,
// a fifth of it failing for good until the handler is fixed, is mixed with
// messages near the frame limit, forged amqpidem headers, the longest
// MessageIds AMQP allows, deep tables and escape sequences, some of them
// published straight into A's dead-letter queue. The handler is then
// fixed, and the operator runs `amqpidem dlq replay A --all --forget
// --yes --to-original-exchange`, then the same without
// --to-original-exchange for the dead letters left. Every normal
// operation must take effect exactly once, B's failed records must stay
// failed, no message may loop, the victim queue the forged headers name
// must stay empty, and dlq list must print no control byte.
func TestChaos21HostilePublisher(t *testing.T) {
	e := newEnv(t, envOptions{})
	const maxAttempts = 3
	cli := cliBin.build(t)
	qA, qB := e.queue, e.queue+".b"
	dlqA, dlqB := qA+".dlq", qB+".dlq"
	victim := "victim." + e.name // not under e.queue: nobody consumes it
	e.ownQueue(victim)
	if _, err := e.pub.Channel().QueueDeclare(victim, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}

	// The consumers' key, in a file (a flag's value would be in ps).
	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		t.Fatal(err)
	}
	signingKey := hex.EncodeToString(secret)
	keyFile := filepath.Join(e.dir, "signing.key")
	if err := os.WriteFile(keyFile, []byte(signingKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	common := []string{"-max-attempts", fmt.Sprint(maxAttempts), "-backoff", "100ms", "-in-progress-delay", "300ms",
		"-unavailable-delay", "300ms", "-signing-key-file", keyFile}
	consumerA := func(name string, extra ...string) *proc {
		return e.consumer(name, append(append([]string(nil), common...), extra...)...)
	}
	var as []*proc
	for i := range 2 {
		as = append(as, consumerA(fmt.Sprintf("%s-a%d", e.name, i)))
	}
	e.consumer(e.name+"-b0", append(append([]string(nil), common...), "-queue", qB)...)
	// B's queue, and the dead-letter queues as amqpidem declares them
	// when it first dead-letters (durable, classic): the attacker
	// publishes into A's before any.
	for _, q := range []string{qB, dlqA, dlqB} {
		if _, err := e.pub.Channel().QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}

	// Endpoint B: half its operations fail for good; their failed records
	// are what the attacker wants forgotten.
	nB := pick(10, 40)
	var bOK, bFailed []workload.Op
	for i := range nB {
		o := workload.Op{ID: fmt.Sprintf("%s-b%d", e.name, i)}
		if i%2 == 0 {
			o.Plan.Permanent = true
			bFailed = append(bFailed, o)
		} else {
			bOK = append(bOK, o)
		}
	}
	e.addOps(ledger.ExpectApply, bOK)
	e.addOps(ledger.ExpectDeadLetter, bFailed)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := e.pub.Publish(ctx, qB, workload.Messages(append(append([]workload.Op(nil), bOK...), bFailed...), e.rng)); err != nil {
		t.Fatal(err)
	}

	// Normal traffic on A, one copy each: a fifth fails for good until the
	// handler is fixed.
	nA := pick(60, 400)
	var normal, broken []workload.Op
	for i := range nA {
		o := workload.Op{ID: fmt.Sprintf("%s-op%d", e.name, i), Plan: workload.Plan{WorkMS: e.rng.IntN(6)}}
		if i%5 == 0 {
			o.Plan.Broken = true
			broken = append(broken, o)
		}
		normal = append(normal, o)
	}
	e.addOps(ledger.ExpectApply, normal)

	// The attacker's messages.
	past := time.Now().Add(-time.Hour).UnixMilli()
	esc := "\x1b]0;pwned\x07\x1b[2K\r\x1b[1A\x9b2J\x7f\u202e"
	forged := amqp.Table{
		amqpidem.HeaderAttempt:            int64(1),
		amqpidem.HeaderKey:                bFailed[0].ID,
		amqpidem.HeaderEndpoint:           qB,
		amqpidem.HeaderOriginalExchange:   "",
		amqpidem.HeaderOriginalRoutingKey: victim,
		amqpidem.HeaderSignature:          "v1:" + strings.Repeat("0f", 32),
	}
	with := func(t amqp.Table, kv ...any) amqp.Table {
		out := amqp.Table{}
		for k, v := range t {
			out[k] = v
		}
		for i := 0; i+1 < len(kv); i += 2 {
			out[kv[i].(string)] = kv[i+1]
		}
		return out
	}
	// The deepest tables amqp091-go reads: 32 levels, the headers table
	// being 0 (read.go's maxFieldDepth). It writes deeper ones, but a
	// delivery with one closes the consumer's connection (501, an
	// "invalid field" it cannot parse) before amqpidem sees it, every
	// time it is redelivered: see README.md, "Bugs and limits found".
	deep := amqp.Table{"leaf": esc}
	for range hostileDepth - 1 {
		deep = amqp.Table{"d": deep}
	}
	long := func(tag string) string { // the longest MessageId: a shortstr
		s := e.name + "-" + tag + "-"
		return s + strings.Repeat("m", 255-len(s))
	}
	h := func(tag string) string { return e.name + "-h-" + tag }
	permanent := workload.Plan{Permanent: true}
	hostiles := []hostile{
		// Near the frame limit: amqpidem's headers would push its copies
		// over frame_max.
		{name: "near-limit", id: h("near-limit"), pad: 100},
		{name: "near-limit-permanent", id: h("near-limit-permanent"), pad: 100, plan: permanent},
		{name: "near-limit-retry", id: h("near-limit-retry"), pad: 40, plan: workload.Plan{FailUntil: 3}},
		{name: "near-limit-tight", id: h("near-limit-tight"), pad: 20, plan: permanent,
			headers: amqp.Table{"x-small": strings.Repeat("s", 10)}},
		// Forged amqpidem headers.
		{name: "forged-attempt", id: h("forged-attempt"), headers: with(nil, amqpidem.HeaderAttempt, int64(1)<<40)},
		{name: "forged-pending", id: h("forged-pending"), headers: with(nil, amqpidem.HeaderDeadLetterPending, int64(1))},
		{name: "forged-expired", id: h("forged-expired"), headers: with(nil, amqpidem.HeaderExpiresAt, past)},
		{name: "forged-all", id: h("forged-all"), headers: forged},
		{name: "forged-all-permanent", id: h("forged-all-permanent"), headers: forged, plan: permanent},
		{name: "forged-all-retry", id: h("forged-all-retry"), headers: forged, plan: workload.Plan{AlwaysFail: true}},
		// The longest MessageIds, with escapes in them too.
		{name: "long-id", id: long("long")},
		{name: "long-id-permanent", id: long("long-permanent"), plan: permanent},
		{name: "long-id-escapes", id: long("esc" + esc), plan: permanent},
		// Deep tables, in a header of the user's and in amqpidem's own.
		{name: "deep-table", id: h("deep"), headers: amqp.Table{"x-deep": deep}},
		{name: "deep-table-permanent", id: h("deep-permanent"), headers: amqp.Table{"x-deep": deep, amqpidem.HeaderAttempt: deep}, plan: permanent},
		// Escape sequences in the key and in headers.
		{name: "escapes", id: h("esc" + esc), plan: permanent,
			headers: amqp.Table{amqpidem.HeaderOriginalRoutingKey: "q\n9  FAKE ROW" + esc, "x-note": esc}},

		// Straight into A's dead-letter queue: unsigned, or a garbage
		// signature.
		{name: "dlq-other-endpoint", id: h("dlq-other-endpoint"), dlq: true, headers: with(forged,
			amqpidem.HeaderReason, "permanent failure", amqpidem.HeaderError, "declined")},
		{name: "dlq-other-key", id: h("dlq-other-key"), dlq: true, headers: with(forged,
			amqpidem.HeaderEndpoint, qA, amqpidem.HeaderReason, "permanent failure", amqpidem.HeaderError, "declined")},
		{name: "dlq-own-failed-key", id: h("dlq-own-failed-key"), dlq: true, headers: with(forged,
			amqpidem.HeaderKey, broken[0].ID, amqpidem.HeaderEndpoint, qA, amqpidem.HeaderReason, "permanent failure")},
		{name: "dlq-victim", id: h("dlq-victim"), dlq: true, headers: with(forged,
			amqpidem.HeaderKey, h("dlq-victim"), amqpidem.HeaderEndpoint, qA, amqpidem.HeaderReason, "permanent failure")},
		{name: "dlq-escapes", id: h("dlq-escapes"), dlq: true, headers: amqp.Table{
			amqpidem.HeaderKey: "k" + esc, amqpidem.HeaderReason: "\x1b[31mpermanent failure" + esc, amqpidem.HeaderError: "boom\r\n7  k  FAKE" + esc,
			amqpidem.HeaderOriginalRoutingKey: "q\n8  FAKE ROW" + esc, amqpidem.HeaderOriginalExchange: esc, amqpidem.HeaderConsumer: esc}},
		{name: "dlq-near-limit", id: h("dlq-near-limit"), dlq: true, pad: 16, headers: amqp.Table{
			amqpidem.HeaderKey: h("dlq-near-limit"), amqpidem.HeaderReason: "permanent failure"}},
	}
	hostileOps := map[string]string{} // op id: name
	var hops []ledger.Op
	for _, hm := range hostiles {
		op := ledger.OpID(hm.id)
		hostileOps[op] = hm.name
		hops = append(hops, ledger.Op{ID: op, Expect: ledger.ExpectAny})
	}
	if err := e.led.AddOps(ctx, hops); err != nil {
		t.Fatal(err)
	}

	// AMQP's limit on a MessageId: a shortstr, 255 bytes. One more is
	// refused by the client before anything is sent.
	if err := publishRaw(e.amqp, e.name+"-attacker-256", "", qA, amqp.Publishing{MessageId: long("x") + "m", Body: []byte("{}")}); err == nil ||
		!strings.Contains(err.Error(), "255") {
		t.Errorf("a MessageId of 256 bytes: %v; want the client to refuse a shortstr over 255 bytes", err)
	}

	// The attacker publishes first into the dead-letter queue (its
	// messages come first there), then to A, mixed with the normal
	// traffic.
	att, err := amqp.DialConfig(e.amqp, amqp.Config{Properties: amqp.Table{"connection_name": e.name + "-attacker"}})
	if err != nil {
		t.Fatal(err)
	}
	defer att.Close()
	for _, hm := range hostiles {
		if hm.dlq {
			publishHostile(t, att, dlqA, hm)
		}
	}
	msgs := workload.Messages(normal, e.rng)
	step := max(len(msgs)/(len(hostiles)+1), 1)
	next := 0
	for i, hm := range hostiles {
		if hm.dlq {
			continue
		}
		end := min(next+step, len(msgs))
		if err := e.pub.Publish(ctx, qA, msgs[next:end]); err != nil {
			t.Fatal(err)
		}
		next = end
		publishHostile(t, att, qA, hostiles[i])
	}
	if err := e.pub.Publish(ctx, qA, msgs[next:]); err != nil {
		t.Fatal(err)
	}
	nDLQHostile := 0
	for _, hm := range hostiles {
		if hm.dlq {
			nDLQHostile++
		}
	}

	// Phase 1: everything settles; the broken operations are
	// dead-lettered, signed.
	normalIDs := make([]string, len(normal))
	for i, o := range normal {
		normalIDs[i] = o.ID
	}
	appliedOf := func(ids []string) int {
		return e.count(`SELECT count(*) FROM applied WHERE op_id = ANY($1)`, ids)
	}
	e.waitFor("the normal operations that do not fail", 3*time.Minute, func() bool {
		return appliedOf(normalIDs) >= len(normal)-len(broken)
	}, func() string { return fmt.Sprintf("(applied %d)", appliedOf(normalIDs)) })
	e.waitDrained(3*time.Minute, 2*time.Second)
	e.waitFor("the dead letters of the broken operations", time.Minute, func() bool {
		d, _ := e.listQueues()
		return d[dlqA][0] >= len(broken)+nDLQHostile && d[dlqB][0] >= len(bFailed)
	}, nil)
	bBefore := e.records(qB, bFailed)

	// What the operator sees first: dlq list, which must print no raw
	// control byte.
	runCLI := func(args ...string) (string, int) {
		t.Helper()
		all := append([]string{"--redis", "redis://" + e.redis.Addr + "/0", "--prefix", e.name, "--amqp", e.amqp}, args...)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, cli, all...)
		cmd.Env = append(os.Environ(), "AMQPIDEM_SIGNING_KEY="+signingKey)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatalf("amqpidem %s: %v", strings.Join(args, " "), err)
		}
		t.Logf("amqpidem %s: exit %d\n%s%s", strings.Join(args, " "), code, tail(stdout.String(), 6<<10), tail(stderr.String(), 2<<10))
		return stdout.String() + stderr.String(), code
	}
	controlBytes := 0
	checkText := func(what, out string) {
		if b := rawControl(out); b != "" {
			controlBytes++
			t.Errorf("%s printed a raw control byte (%s):\n%q", what, b, tail(out, 2<<10))
		}
	}
	list, code := runCLI("dlq", "list", qA, "--limit", "10000")
	checkText("dlq list", list)
	if code != 0 || !strings.Contains(list, "FAKE") || !strings.Contains(list, `\x1b`) {
		t.Errorf("dlq list: exit %d, want 0 and the escapes shown escaped", code)
	}

	// The deploy that fixes the handler, then the operator's replays.
	for _, p := range as {
		if err := p.terminate(45 * time.Second); err != nil {
			t.Error(err)
		}
	}
	for i := range 2 {
		consumerA(fmt.Sprintf("%s-fixed%d", e.name, i), "-fixed")
	}
	// Each replay ends with 4: the attacker's dead letters are left. A 1
	// means it stopped early, leaving every dead letter behind the one it
	// stopped at.
	var replayedAt []time.Time
	replay := func(extra ...string) int {
		replayedAt = append(replayedAt, time.Now())
		args := append([]string{"dlq", "replay", qA, "--all", "--forget", "--yes"}, extra...)
		out, code := runCLI(args...)
		checkText(strings.Join(args, " "), out)
		if code != 0 && code != 4 {
			t.Errorf("amqpidem %s: exit %d: it stopped early", strings.Join(args, " "), code)
		}
		return code
	}
	// First to the original exchanges (each letter's, if signed), then the
	// rest to the queue.
	code1 := replay("--to-original-exchange")
	// Not fatal: the line below says what was lost.
	for deadline := time.Now().Add(time.Minute); appliedOf(normalIDs) < len(normal) && time.Now().Before(deadline); {
		time.Sleep(200 * time.Millisecond)
	}
	e.waitDrained(3*time.Minute, 2*time.Second)
	code2 := replay()
	e.waitDrained(3*time.Minute, 2*time.Second)
	list2, _ := runCLI("dlq", "list", qA, "--limit", "10000")
	checkText("dlq list after the replays", list2)
	e.terminateAll()

	// B's failed records: still failed, the same records.
	bAfter := e.records(qB, bFailed)
	touched := 0
	for k, before := range bBefore {
		after := bAfter[k]
		if before.State != lock.StateFailed || after.State != before.State || after.Fence != before.Fence {
			touched++
			t.Errorf("B's record of %s: %q fence %d before the replays, %q fence %d after; want failed, untouched",
				k, before.State, before.Fence, after.State, after.Fence)
		}
	}
	// The victim queue: nothing reached it.
	forgedTargets := queueDepth(t, e.amqp, victim)

	// Dead letters: A's signed ones count for their key; the attacker's
	// own (unsigned) are left out, they are no operation's.
	dlsA := e.takeAll(dlqA, 5*time.Second)
	dlsB := e.takeAll(dlqB, 5*time.Second)
	counted := countByOp(dlsB)
	unsignedLeft := 0
	for _, dl := range dlsA {
		if amqpidem.VerifySignature([]byte(signingKey), dl.D.Headers, dl.D.Body) != nil {
			unsignedLeft++
			continue
		}
		counted[ledger.OpID(dl.D.MessageId)]++
	}

	// Settles per operation (one copy each, so per message) and phase
	// (before the first replay, between the two, after the second: a
	// replay starts a message's count again), from the consumers' events.
	type opPhase struct {
		op    string
		phase int
	}
	settles := map[opPhase]int{}
	for _, ev := range e.events() {
		ph := 0
		for _, at := range replayedAt {
			if ev.Time.After(at) {
				ph++
			}
		}
		settles[opPhase{ev.Op, ph}]++
	}
	looping, most := 0, 0
	for k, n := range settles {
		most = max(most, n)
		if n > maxAttempts+2 {
			looping++
			t.Errorf("%s (%s) settled %d times in phase %d, more than MaxAttempts+2 = %d", k.op, hostileOps[k.op], n, k.phase, maxAttempts+2)
		}
	}
	r := e.reportWith("hostile-publisher", fmt.Sprintf(" normal=%d broken=%d hostile=%d hostile_dlq=%d other_endpoint_records=%d other_endpoint_records_touched=%d looping=%d max_settles=%d forged_targets_used=%d unsigned_left=%d control_bytes=%d replay_exits=%d,%d",
		len(normal), len(broken), len(hostiles)-nDLQHostile, nDLQHostile, len(bBefore), touched, looping, most, forgedTargets, unsignedLeft, controlBytes, code1, code2),
		counted, false)
	if forgedTargets != 0 {
		t.Errorf("%d messages reached the victim queue %s, which only forged headers name", forgedTargets, victim)
	}
	for _, o := range normal {
		if s := r.PerOp[o.ID]; s.Applied != 1 {
			t.Errorf("normal operation %s applied %d times", o.ID, s.Applied)
		}
	}
	for _, o := range bFailed {
		if s := r.PerOp[o.ID]; s.Executions != 1 || s.Applied != 0 {
			t.Errorf("B's failed operation %s: %d executions, applied %d; want it never run again", o.ID, s.Executions, s.Applied)
		}
	}
}

// records reads the store's records of ops under endpoint, keyed by op id
// (the zero Record for one that does not exist).
func (e *env) records(endpoint string, ops []workload.Op) map[string]lock.Record {
	e.t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr})
	defer rdb.Close()
	st, err := lock.NewRedisStore(rdb, lock.Config{Prefix: e.name})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out := map[string]lock.Record{}
	for _, o := range ops {
		rec, err := st.Inspect(ctx, amqpidem.StoreKey(endpoint, o.ID))
		if err != nil && !errors.Is(err, lock.ErrNotFound) { // none: the zero Record
			e.t.Errorf("the record of %s under %s: %v", o.ID, endpoint, err)
		}
		out[o.ID] = rec
	}
	return out
}

// publishHostile publishes hm to queue through the default exchange on a
// confirm-mode channel of conn, with its headers padded as it says.
func publishHostile(t *testing.T, conn *amqp.Connection, queue string, hm hostile) {
	t.Helper()
	p := hm.plan
	p.Op = hm.id
	msg := amqp.Publishing{MessageId: hm.id, DeliveryMode: amqp.Persistent, Headers: amqp.Table{}, Body: p.Body()}
	for k, v := range hm.headers {
		msg.Headers[k] = v
	}
	if hm.pad > 0 {
		padHeaders(&msg, frameMax-hm.pad)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("attacker: channel: %v", err)
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, msg)
	if err != nil {
		t.Fatalf("attacker: publish %s: %v", hm.name, err)
	}
	if ok, err := dc.WaitContext(ctx); !ok || err != nil {
		t.Fatalf("attacker: %s not confirmed: %v", hm.name, err)
	}
}

// publishRaw publishes one message on a connection of its own.
func publishRaw(url, name, exchange, key string, msg amqp.Publishing) error {
	conn, err := amqp.DialConfig(url, amqp.Config{Properties: amqp.Table{"connection_name": name}})
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return ch.PublishWithContext(ctx, exchange, key, false, false, msg)
}

// padHeaders adds string headers to msg until its content header frame
// is exactly size bytes: amqp091-go's encoding of the properties it has
// (MessageId, DeliveryMode, string and byte headers: padding a message
// with other header types is not supported), behind the frame's 8 bytes
// and the 14 of class, weight, body size and flags. The pads are 1000
// bytes, the last one what is left; a headers table of many mid-sized
// headers, unlike one big one, cannot be made to fit by dropping one.
func padHeaders(msg *amqp.Publishing, size int) {
	n := 8 + 14 + 1 + 1 + len(msg.MessageId) + 4
	entry := func(k string, v int) int { return 1 + len(k) + 1 + 4 + v }
	for k, v := range msg.Headers {
		switch v := v.(type) {
		case string:
			n += entry(k, len(v))
		case []byte:
			n += entry(k, len(v))
		default:
			panic(fmt.Sprintf("padHeaders: header %s is a %T", k, v))
		}
	}
	for i := 0; ; i++ {
		k := fmt.Sprintf("x-pad-%04d", i)
		left := size - n - entry(k, 0)
		if left < 0 {
			panic("padHeaders: no room for a pad")
		}
		v := min(left, 1000)
		if left-v > 0 && left-v < entry(k, 0)+1 {
			v = left // no room for another pad after this one
		}
		msg.Headers[k] = strings.Repeat("p", v)
		n += entry(k, v)
		if n == size {
			return
		}
	}
}

// queueDepth is how many messages queue holds.
func queueDepth(t *testing.T, url, queue string) int {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("queue %s: %v", queue, err)
	}
	return q.Messages
}

// rawControl describes the first byte of s a terminal would act on: a C0
// control other than newline, DEL, a C1 control, a bidirectional
// formatting character or a byte that is not UTF-8; "" when there is none.
func rawControl(s string) string {
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			return fmt.Sprintf("byte %#x at %d", s[i], i)
		case r < 0x20 && r != '\n', r >= 0x7f && r <= 0x9f, r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069:
			return fmt.Sprintf("%U at %d", r, i)
		}
		i += size
	}
	return ""
}
