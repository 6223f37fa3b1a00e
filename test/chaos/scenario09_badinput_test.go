//go:build linux

package chaos_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/test/chaos/internal/ledger"
	"github.com/amqpidem/amqpidem/test/chaos/internal/workload"
)

// Scenario 9a, bad input: keys (read from a header) empty, absent, 64 KB,
// 1 KB and one byte over, binary, with braces, of the wrong type; junk in
// amqpidem's own headers; bodies of 0 bytes, 16 MB and binary; a result
// over the limit. Each message is applied once, or dead-lettered once with
// a reason that says why; nothing is lost and no consumer panics.
func TestChaos09BadInput(t *testing.T) {
	e := newEnv(t, envOptions{})
	binary := make([]byte, 256)
	for i := range binary {
		binary[i] = byte(i)
	}
	type input struct {
		name    string
		key     any // the x-op header; nil: absent
		headers amqp.Table
		body    []byte
		expect  string
		reason  string // of the dead letter
	}
	key := func(s string) string { return e.name + "-" + s }
	inputs := []input{
		{name: "key-empty", key: "", expect: ledger.ExpectDeadLetter, reason: "missing key"},
		{name: "key-absent", expect: ledger.ExpectDeadLetter, reason: "missing key"},
		{name: "key-64k", key: strings.Repeat("k", 64<<10), expect: ledger.ExpectDeadLetter, reason: "invalid key"},
		{name: "key-1025", key: strings.Repeat("k", 1025), expect: ledger.ExpectDeadLetter, reason: "invalid key"},
		// The store takes 1024 bytes for the endpoint (the queue), a NUL byte and the key.
		{name: "key-longest", key: key(strings.Repeat("k", 1023-len(e.queue)-len(key("")))), expect: ledger.ExpectApply},
		{name: "key-longest+1", key: key(strings.Repeat("k", 1024-len(e.queue)-len(key("")))), expect: ledger.ExpectDeadLetter, reason: "invalid key"},
		{name: "key-binary", key: append([]byte(key("bin-")), binary...), expect: ledger.ExpectApply},
		{name: "key-braces", key: "{" + key("braces") + "}:{x}{", expect: ledger.ExpectApply},
		{name: "key-int", key: int64(42), expect: ledger.ExpectDeadLetter, reason: "missing key"},
		{name: "key-float", key: 4.2, expect: ledger.ExpectDeadLetter, reason: "missing key"},
		{name: "key-bool", key: true, expect: ledger.ExpectDeadLetter, reason: "missing key"},
		{name: "key-table", key: amqp.Table{"k": "v"}, expect: ledger.ExpectDeadLetter, reason: "missing key"},
		{name: "attempt-string", key: key("attempt-string"), headers: amqp.Table{amqpidem.HeaderAttempt: "three"}, expect: ledger.ExpectApply},
		{name: "attempt-negative", key: key("attempt-negative"), headers: amqp.Table{amqpidem.HeaderAttempt: int32(-5)}, expect: ledger.ExpectApply},
		// A header can bring a dead letter closer, never allow more runs: a
		// count above MaxAttempts is MaxAttempts, so the message is not run.
		{name: "attempt-huge", key: key("attempt-huge"), headers: amqp.Table{amqpidem.HeaderAttempt: int64(1) << 40}, expect: ledger.ExpectDeadLetter, reason: "attempts exhausted"},
		// The pending mark only brings a dead letter closer: a new key that
		// carries it is dead-lettered, not run.
		{name: "pending-junk", key: key("pending-junk"), headers: amqp.Table{amqpidem.HeaderDeadLetterPending: int64(1)}, expect: ledger.ExpectDeadLetter, reason: "dead letter pending"},
		{name: "x-death-junk", key: key("x-death-junk"), headers: amqp.Table{"x-death": "not a list"}, expect: ledger.ExpectApply},
		{name: "body-empty", key: key("body-empty"), body: []byte{}, expect: ledger.ExpectApply},
		{name: "body-16mb", key: key("body-16mb"), body: bytes.Repeat([]byte("0123456789abcdef"), 1<<20), expect: ledger.ExpectApply},
		{name: "body-binary", key: key("body-binary"), body: binary, expect: ledger.ExpectApply},
		{name: "result-over-limit", key: key("result-over-limit"), body: workload.Plan{ResultBytes: 70_000}.Body(),
			expect: ledger.ExpectBoth, reason: "result too large"},
	}
	var ops []ledger.Op
	var msgs []workload.Message
	reasons := map[string]string{}
	for _, in := range inputs {
		op := e.name + "-" + in.name // dead letters without a key are found by x-case
		switch k := in.key.(type) {
		case string:
			if in.expect != ledger.ExpectDeadLetter {
				op = ledger.OpID(k)
			}
		case []byte:
			op = ledger.OpID(string(k))
		}
		h := amqp.Table{"x-case": op}
		for k, v := range in.headers {
			h[k] = v
		}
		if in.key != nil {
			h["x-op"] = in.key
		}
		body := in.body
		if body == nil {
			body = workload.Plan{}.Body()
		}
		ops = append(ops, ledger.Op{ID: op, Expect: in.expect})
		msgs = append(msgs, workload.Message{Body: body, Headers: h})
		reasons[op] = in.reason
	}
	if err := e.led.AddOps(t.Context(), ops); err != nil {
		t.Fatal(err)
	}
	// Zero lease TTLs mean the documented defaults.
	c := e.consumer(e.name+"-c0", "-key-header", "x-op", "-lease", "0", "-store-lease", "0", "-unavailable-delay", "300ms")
	e.publishMessages(msgs)

	nApplied, nDead := 0, 0
	for _, o := range ops {
		if o.Expect != ledger.ExpectDeadLetter {
			nApplied++
		}
		if o.Expect != ledger.ExpectApply {
			nDead++
		}
	}
	e.settle(nApplied, pick(30*time.Second, 3*time.Minute), 2*time.Second)
	dlq := e.queue + ".dlq"
	e.waitFor("the dead letters", time.Minute, func() bool {
		d, _ := e.listQueues()
		return d[dlq][0] >= nDead
	}, nil)
	e.terminateAll()
	dls := e.takeAll(dlq, 10*time.Second)
	e.report("badinput", countByOp(dls), false)
	for _, dl := range dls {
		reason, _ := dl.D.Headers[amqpidem.HeaderReason].(string)
		errText, _ := dl.D.Headers[amqpidem.HeaderError].(string)
		if want := reasons[dl.Op]; reason != want || errText == "" {
			t.Errorf("dead letter %s: reason %q error %q; want reason %q and an error", dl.Op, reason, errText, want)
		}
		t.Logf("badinput: %s dead-lettered: %s: %s", dl.Op, reason, tail(errText, 160))
	}
	if out := c.output(); strings.Contains(out, "panic") {
		t.Errorf("consumer output mentions a panic:\n%s", tail(out, 4<<10))
	}
}

// Scenario 9b, misconfiguration: invalid durations and counts are refused
// at start with an error naming the field; the process exits 2, without a
// panic.
func TestChaos09Misconfiguration(t *testing.T) {
	e := newEnv(t, envOptions{})
	for _, tc := range []struct {
		flags []string
		want  string
	}{
		{[]string{"-lease", "-1s"}, "Config.LeaseTTL"},
		{[]string{"-lease", "5ms"}, "Config.LeaseTTL"},
		{[]string{"-store-lease", "-1s"}, "Config.LeaseTTL"},
		{[]string{"-retention", "-1h"}, "Config.Retention"},
		{[]string{"-max-attempts", "-1"}, "Config.MaxAttempts"},
		{[]string{"-in-progress-delay", "-1s"}, "Config.InProgressDelay"},
		{[]string{"-prefetch", "-1"}, "ConsumerConfig.Prefetch"},
		{[]string{"-concurrency", "-1"}, "ConsumerConfig.Concurrency"},
	} {
		p := e.consumer(e.name+"-bad", tc.flags...)
		code, exited := p.exitedWith(30 * time.Second)
		out := p.output()
		if !exited || code != 2 || !strings.Contains(out, tc.want) || strings.Contains(out, "panic") {
			t.Errorf("consumer %v: exited %v with %d, output %q; want exit 2 naming %s", tc.flags, exited, code, tail(out, 400), tc.want)
			continue
		}
		t.Logf("misconfiguration %v: %s", tc.flags, firstLine(out, tc.want))
	}
}

// Scenario 9c, an eviction policy other than noeviction: the store's check
// warns at start (an evicted record is a duplicate execution waiting to
// happen), and processing goes on.
func TestChaos09EvictionPolicy(t *testing.T) {
	e := newEnv(t, envOptions{redisArgs: []string{"--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"}})
	n := pick(50, 200)
	c := e.consumer(e.name + "-c0")
	e.publish(workload.Storm(e.name+"-op", n, 2, 5, e.rng))
	e.settle(n, 2*time.Minute, 2*time.Second)
	e.terminateAll()
	e.report("eviction-policy", nil, false)
	if out := c.output(); !strings.Contains(out, "maxmemory-policy is not noeviction") {
		t.Errorf("no warning about the eviction policy in the consumer's log:\n%s", tail(out, 2<<10))
	} else {
		t.Logf("eviction-policy: the consumer warned: %s", firstLine(out, "maxmemory-policy"))
	}
}

// firstLine returns the first line of s containing sub.
func firstLine(s, sub string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			return l
		}
	}
	return ""
}
