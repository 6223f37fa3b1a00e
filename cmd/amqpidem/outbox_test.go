package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// stagingRig is a queue whose amqpidem consumer's handler stages three
// messages per delivery: one to the queue audit, which exists, and two to
// the queue shipping, which does not until the test declares it, so that the
// broker returns them and the consumer gives them up (MaxAttempts 2). For
// a key beginning "x-", the second goes to an exchange that does not exist.
type stagingRig struct {
	t        *testing.T
	queue    string
	audit    string
	shipping string
	nope     string   // an exchange that does not exist
	flags    []string // point the binary at the store
	store    lock.Store
	conn     *amqp.Connection
	ch       *amqp.Channel
	events   chan amqpidem.Event
	logs     *testenv.SyncBuffer
}

// newStagingRig runs the consumer on store, which flags name to the binary.
func newStagingRig(t *testing.T, store lock.Store, flags []string) *stagingRig {
	t.Helper()
	url := testenv.AMQPURL(t)
	r := &stagingRig{t: t, queue: testenv.Name(t), store: store, events: make(chan amqpidem.Event, 1000), logs: &testenv.SyncBuffer{}}
	r.audit, r.shipping, r.nope = r.queue+".audit", r.queue+".shipping", r.queue+".nope"
	r.flags = append(flags, "--amqp", url)
	var err error
	if r.conn, err = amqp.Dial(url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.conn.Close() })
	if r.ch, err = r.conn.Channel(); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{r.queue, r.audit} {
		if _, err := r.ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	testenv.DeleteQueues(t, url, r.queue, r.queue+".dlq", r.queue+".delay.50", r.audit, r.shipping)
	cfg := amqpidem.Config{Queue: r.queue, MaxAttempts: 2, UnavailableDelay: 50 * time.Millisecond,
		Logger:   slog.New(slog.NewTextHandler(r.logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { r.events <- e })}
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{URL: url, Concurrency: 2, Prefetch: 4, Config: cfg},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			id := d.MessageId
			type staged struct {
				exchange, key string
				msg           amqp.Publishing
			}
			msgs := []staged{
				{"", r.audit, amqp.Publishing{MessageId: "audit-" + id, Body: []byte("audited " + id)}},
				{"", r.shipping, amqp.Publishing{MessageId: "paid-" + id, ContentType: "application/json", CorrelationId: id,
					Headers: amqp.Table{"tenant": "acme"}, Body: []byte(`{"paid":"` + id + `"}`)}},
				{"", r.shipping, amqp.Publishing{Body: []byte("receipt " + id)}}, // MessageId derived by Stage
			}
			if strings.HasPrefix(id, "x-") {
				msgs = slices.Insert(msgs, 1, staged{r.nope, "k", amqp.Publishing{MessageId: "nope-" + id, Body: []byte("x")}})
			}
			for _, m := range msgs {
				if err := amqpidem.Stage(ctx, m.exchange, m.key, m.msg); err != nil {
					return nil, err
				}
			}
			return []byte(`{"receipt":"rcpt-` + id + `"}`), nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	return r
}

// pay publishes a message of key id and waits until the consumer gave up
// the staged messages that no queue takes, returned of them.
func (r *stagingRig) pay(id string, returned int) {
	r.t.Helper()
	if err := r.ch.Publish("", r.queue, false, false, amqp.Publishing{MessageId: id, Body: []byte("pay " + id)}); err != nil {
		r.t.Fatal(err)
	}
	deadline := time.After(60 * time.Second)
	for {
		select {
		case e := <-r.events:
			if e.Key == id && e.Outbox.Returned > 0 {
				if e.Outbox.Returned != returned {
					r.t.Fatalf("%s: %d staged messages given up, want %d", id, e.Outbox.Returned, returned)
				}
				return
			}
		case <-deadline:
			r.t.Fatalf("%s: its staged messages were not given up in 60s", id)
		}
	}
}

// cli runs the binary with args and the rig's flags; it fails the test
// unless it exits with code, and returns stdout and stderr.
func (r *stagingRig) cli(code int, args ...string) (string, string) {
	r.t.Helper()
	stdout, stderr, got := r.run(args...)
	r.t.Logf("$ amqpidem %s\n%s%s(exit %d)", strings.Join(args, " "), stdout, stderr, got)
	if got != code {
		r.t.Fatalf("amqpidem %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), got, code, stdout, stderr)
	}
	return stdout, stderr
}

// run runs the binary with args and the rig's flags; it returns stdout,
// stderr and the exit code.
func (r *stagingRig) run(args ...string) (string, string, int) {
	r.t.Helper()
	cmd := exec.Command(bin, append(args, r.flags...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	got := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		got = ee.ExitCode()
	case err != nil:
		r.t.Fatal(err)
	}
	return stdout.String(), stderr.String(), got
}

// record is inspect --json's output, the fields these tests read.
type record struct {
	State  string
	Result string
	Outbox []struct {
		Index         int
		State         string
		Tries         int
		Exchange      string
		RoutingKey    string `json:"routing_key"`
		MessageID     string `json:"message_id"`
		ContentType   string `json:"content_type"`
		CorrelationID string `json:"correlation_id"`
		Headers       []string
		BodyBytes     int `json:"body_bytes"`
	}
}

func (r *stagingRig) inspect(id string) record {
	r.t.Helper()
	out, _ := r.cli(0, "inspect", id, "--queue", r.queue, "--json")
	var rec record
	if err := json.Unmarshal([]byte(out), &rec); err != nil {
		r.t.Fatalf("inspect --json: %v\n%s", err, out)
	}
	return rec
}

// states is the states of rec's staged messages, in order.
func states(rec record) string {
	var s []string
	for _, m := range rec.Outbox {
		s = append(s, m.State)
	}
	return strings.Join(s, ",")
}

// get takes the messages waiting in queue.
func (r *stagingRig) get(queue string) []amqp.Delivery {
	r.t.Helper()
	var got []amqp.Delivery
	for {
		d, ok, err := r.ch.Get(queue, true)
		if err != nil {
			r.t.Fatal(err)
		}
		if !ok {
			return got
		}
		got = append(got, d)
	}
}

// redriveRoundTrip is the life of a record whose staged messages the broker
// returned: inspect shows them, redrive leaves them while their queue is
// missing, publishes them once it exists, exactly as stored, and marks
// them; then there is nothing left to do.
func redriveRoundTrip(t *testing.T, r *stagingRig) {
	r.pay("pay-7", 2)
	if !strings.Contains(r.logs.String(), "staged message given up") {
		t.Fatalf("no warning logged:\n%s", r.logs.String())
	}

	rec := r.inspect("pay-7")
	if got, want := rec.State, "completed"; got != want {
		t.Fatalf("state: got %v, want %v", got, want)
	}
	if got, want := rec.Result, `{"receipt":"rcpt-pay-7"}`; got != want {
		t.Fatalf("result: got %v, want %v (the result alone, without the staged messages)", got, want)
	}
	if got, want := states(rec), "published,returned,returned"; got != want {
		t.Fatalf("staged states: got %v, want %v", got, want)
	}
	m := rec.Outbox[1]
	if m.Index != 1 || m.Tries != 2 || m.Exchange != "" || m.RoutingKey != r.shipping || m.MessageID != "paid-pay-7" ||
		m.ContentType != "application/json" || m.CorrelationID != "pay-7" || strings.Join(m.Headers, ",") != "tenant" || m.BodyBytes != 16 {
		t.Fatalf("staged message 1: %+v", m)
	}
	derived := rec.Outbox[2].MessageID
	if !strings.HasPrefix(derived, "amqpidem-") {
		t.Fatalf("staged message 2: MessageId %q, want one Stage derived", derived)
	}
	text, _ := r.cli(0, "inspect", "pay-7", "--queue", r.queue)
	for _, want := range []string{`result +\{"receipt":"rcpt-pay-7"\} \(24 bytes\)`, `outbox +3 staged messages: 1 published, 0 pending, 2 returned`,
		`INDEX +STATE +TRIES +EXCHANGE +ROUTING KEY +MESSAGE ID +BYTES`, `0 +published +0 +- +` + r.audit + ` +audit-pay-7 +13`,
		`1 +returned +2 +- +` + r.shipping + ` +paid-pay-7 +16`, `2 +returned +2 +- +` + r.shipping + ` +` + derived + ` +13`} {
		if !regexp.MustCompile(`(?m)^` + want + `$`).MatchString(text) {
			t.Fatalf("inspect has no line %s:\n%s", want, text)
		}
	}
	if got := r.get(r.audit); len(got) != 1 || got[0].MessageId != "audit-pay-7" {
		t.Fatalf("audit queue: %d messages, want audit-pay-7 alone", len(got))
	}

	// Forgetting the record would drop the returned messages.
	_, errOut := r.cli(4, "forget", "pay-7", "--queue", r.queue)
	if !strings.Contains(errOut, "2 staged messages not published yet") {
		t.Fatalf("forget:\n%s", errOut)
	}

	out, _ := r.cli(0, "outbox", "redrive", "pay-7", "--queue", r.queue, "--dry-run")
	if !strings.Contains(out, "key pay-7 of "+r.queue+": 0 redriven, 2 would redrive, 0 left") || !strings.Contains(out, "paid-pay-7") {
		t.Fatalf("redrive --dry-run:\n%s", out)
	}
	// Not a terminal (the binary's stdin is /dev/null): without --yes,
	// nothing published, nothing marked.
	_, errOut = r.cli(2, "outbox", "redrive", "pay-7", "--queue", r.queue)
	if !strings.Contains(errOut, "add --yes") {
		t.Fatalf("redrive without --yes:\n%s", errOut)
	}
	if rec := r.inspect("pay-7"); states(rec) != "published,returned,returned" || rec.Outbox[1].Tries != 2 {
		t.Fatalf("after a redrive without --yes: %+v", rec.Outbox)
	}
	// The queue is still missing: returned again, left, not marked.
	out, errOut = r.cli(4, "outbox", "redrive", "pay-7", "--queue", r.queue, "--yes")
	if !strings.Contains(out, "0 redriven, 0 would redrive, 2 left") || !strings.Contains(out, "returned again (unroutable: 312 NO_ROUTE)") ||
		!strings.Contains(errOut, "2 staged messages of key \"pay-7\" left unpublished") {
		t.Fatalf("redrive to a missing queue:\n%s\n%s", out, errOut)
	}
	if rec := r.inspect("pay-7"); states(rec) != "published,returned,returned" || rec.Outbox[1].Tries != 2 {
		t.Fatalf("after a redrive returned again: %+v", rec.Outbox)
	}

	if _, err := r.ch.QueueDeclare(r.shipping, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	out, _ = r.cli(0, "outbox", "redrive", "pay-7", "--queue", r.queue, "--yes", "--json")
	var did []struct {
		Index     int
		Action    string
		MessageID string `json:"message_id"`
	}
	if err := json.Unmarshal([]byte(out), &did); err != nil {
		t.Fatalf("redrive --json: %v\n%s", err, out)
	}
	if len(did) != 2 || did[0].Index != 1 || did[1].Index != 2 || did[0].Action != "redriven" || did[1].Action != "redriven" ||
		did[0].MessageID != "paid-pay-7" || did[1].MessageID != derived {
		t.Fatalf("redrive --json: %+v", did)
	}
	got := r.get(r.shipping)
	if len(got) != 2 {
		t.Fatalf("%s got %d messages, want 2", r.shipping, len(got))
	}
	if d := got[0]; d.MessageId != "paid-pay-7" || d.ContentType != "application/json" || d.CorrelationId != "pay-7" ||
		d.Headers["tenant"] != "acme" || len(d.Headers) != 1 || string(d.Body) != `{"paid":"pay-7"}` || d.DeliveryMode != amqp.Persistent {
		t.Fatalf("first redriven message is not as staged: %+v", d)
	}
	if d := got[1]; d.MessageId != derived || string(d.Body) != "receipt pay-7" {
		t.Fatalf("second redriven message: id %q body %q, want %q", d.MessageId, d.Body, derived)
	}
	rec = r.inspect("pay-7")
	if got, want := states(rec), "published,published,published"; got != want {
		t.Fatalf("after redrive: got %v, want %v", got, want)
	}
	if got, want := rec.Result, `{"receipt":"rcpt-pay-7"}`; got != want {
		t.Fatalf("result after redrive: got %v, want %v", got, want)
	}

	// Nothing left: a second redrive does nothing (3), a published message
	// is published again only with --force.
	_, errOut = r.cli(3, "outbox", "redrive", "pay-7", "--queue", r.queue)
	if !strings.Contains(errOut, "nothing to redrive: 3 staged messages: 3 published, 0 pending, 0 returned") {
		t.Fatalf("second redrive:\n%s", errOut)
	}
	out, _ = r.cli(4, "outbox", "redrive", "pay-7", "--queue", r.queue, "--index", "1")
	if !strings.Contains(out, "published already; --force publishes it again") {
		t.Fatalf("redrive --index 1:\n%s", out)
	}
	out, _ = r.cli(0, "outbox", "redrive", "pay-7", "--queue", r.queue, "--index", "1", "--force")
	if !strings.Contains(out, "1 redriven") {
		t.Fatalf("redrive --index 1 --force:\n%s", out)
	}
	if got := r.get(r.shipping); len(got) != 1 || got[0].MessageId != "paid-pay-7" {
		t.Fatalf("after --force, %s got %d messages, want paid-pay-7 again", r.shipping, len(got))
	}
	r.cli(3, "outbox", "redrive", "pay-7", "--queue", r.queue, "--index", "3")
	r.cli(2, "outbox", "redrive", "pay-7", "--queue", r.queue, "--index", "-1")
	r.cli(2, "outbox", "redrive", "pay-7")                     // no --queue
	r.cli(0, "forget", "pay-7", "--queue", r.queue)            // every message published now
	r.cli(3, "outbox", "redrive", "pay-7", "--queue", r.queue) // no record

	// A record in progress: its consumer publishes what it staged.
	ctx := context.Background()
	res, err := r.store.Acquire(ctx, lock.Request{Key: amqpidem.StoreKey(r.queue, "pay-8"), TTL: time.Minute})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	_, errOut = r.cli(4, "outbox", "redrive", "pay-8", "--queue", r.queue, "--yes")
	if !strings.Contains(errOut, "the record is in_progress, not completed") {
		t.Fatalf("redrive of a record in progress:\n%s", errOut)
	}
	// A completed record without staged messages.
	if err := r.store.Complete(ctx, res.Lease, []byte("done")); err != nil {
		t.Fatal(err)
	}
	_, errOut = r.cli(3, "outbox", "redrive", "pay-8", "--queue", r.queue)
	if !strings.Contains(errOut, "its handler staged no messages") {
		t.Fatalf("redrive of a record without staged messages:\n%s", errOut)
	}
	if text, _ := r.cli(0, "inspect", "pay-8", "--queue", r.queue); regexp.MustCompile(`(?m)^outbox|INDEX`).MatchString(text) {
		t.Fatalf("inspect of a record without staged messages shows an outbox:\n%s", text)
	}
}

func TestOutboxRedrive(t *testing.T) {
	prefix := "cli-" + testenv.Name(t)
	rdb := testenv.RedisClient(t)
	testenv.DeleteKeys(t, rdb, prefix+":*")
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	r := newStagingRig(t, store, []string{"--redis", "redis://" + testenv.RedisAddr(t) + "/0", "--prefix", prefix})
	redriveRoundTrip(t, r)
}

func TestOutboxRedrivePostgres(t *testing.T) {
	store, cfg := pgStore(t, 8)
	r := newStagingRig(t, store, []string{"--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema})
	redriveRoundTrip(t, r)
}

// A message staged to an exchange that does not exist is left, said so,
// and the messages after it are published on a new channel.
func TestOutboxRedriveMissingExchange(t *testing.T) {
	prefix := "cli-" + testenv.Name(t)
	rdb := testenv.RedisClient(t)
	testenv.DeleteKeys(t, rdb, prefix+":*")
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	r := newStagingRig(t, store, []string{"--redis", "redis://" + testenv.RedisAddr(t) + "/0", "--prefix", prefix})
	r.pay("x-1", 3)
	if got, want := states(r.inspect("x-1")), "published,returned,returned,returned"; got != want {
		t.Fatalf("staged states: got %v, want %v", got, want)
	}
	if _, err := r.ch.QueueDeclare(r.shipping, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	out, _ := r.cli(4, "outbox", "redrive", "x-1", "--queue", r.queue, "--yes")
	if !strings.Contains(out, "2 redriven, 0 would redrive, 1 left") || !strings.Contains(out, `exchange "`+r.nope+`" does not exist`) {
		t.Fatalf("redrive:\n%s", out)
	}
	if got, want := states(r.inspect("x-1")), "published,returned,published,published"; got != want {
		t.Fatalf("after redrive: got %v, want %v", got, want)
	}
	if got := r.get(r.shipping); len(got) != 2 {
		t.Fatalf("%s got %d messages, want 2", r.shipping, len(got))
	}
	ch, err := r.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if err := ch.ExchangeDeclare(r.nope, "direct", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(r.audit, "k", r.nope, false, nil); err != nil {
		t.Fatal(err)
	}
	out, _ = r.cli(0, "outbox", "redrive", "x-1", "--queue", r.queue, "--yes")
	if !strings.Contains(out, "1 redriven, 0 would redrive, 0 left") {
		t.Fatalf("redrive once the exchange exists:\n%s", out)
	}
	if got := r.get(r.audit); len(got) != 2 || got[1].MessageId != "nope-x-1" {
		t.Fatalf("%s got %d messages, want audit-x-1 and nope-x-1", r.audit, len(got))
	}
}

// Two outbox redrives of one key started together publish its returned
// messages once: one takes the claim on them, as a copy of their message
// would, and publishes; the other publishes nothing and says why, with a
// non-zero exit code.
func TestOutboxRedriveConcurrent(t *testing.T) {
	prefix := "cli-" + testenv.Name(t)
	rdb := testenv.RedisClient(t)
	testenv.DeleteKeys(t, rdb, prefix+":*")
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	r := newStagingRig(t, store, []string{"--redis", "redis://" + testenv.RedisAddr(t) + "/0", "--prefix", prefix})
	keys := []string{"pay-c1", "pay-c2", "pay-c3"}
	for _, k := range keys {
		r.pay(k, 2)
	}
	if _, err := r.ch.QueueDeclare(r.shipping, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		type result struct {
			out, errOut string
			code        int
		}
		results := make(chan result, 2)
		start := make(chan struct{})
		for range 2 {
			go func() {
				<-start
				out, errOut, code := r.run("outbox", "redrive", k, "--queue", r.queue, "--yes")
				results <- result{out, errOut, code}
			}()
		}
		close(start)
		var codes []int
		for range 2 {
			res := <-results
			t.Logf("%s: exit %d\n%s%s", k, res.code, res.out, res.errOut)
			codes = append(codes, res.code)
			switch res.code {
			case 0:
			case 4:
				if !strings.Contains(res.errOut, "being published by another outbox redrive") {
					t.Errorf("%s: the run that published nothing does not say why:\n%s", k, res.errOut)
				}
			case 3:
				if !strings.Contains(res.errOut, "nothing to redrive") {
					t.Errorf("%s: exit 3 without saying why:\n%s", k, res.errOut)
				}
			default:
				t.Errorf("%s: exit %d\n%s", k, res.code, res.errOut)
			}
		}
		slices.Sort(codes)
		if codes[0] != 0 || codes[1] == 0 {
			t.Errorf("%s: exit codes %v, want one run to publish (0) and the other not (3 or 4)", k, codes)
		}
		if got := r.get(r.shipping); len(got) != 2 {
			t.Errorf("%s: %s got %d copies, want 2 (its 2 returned messages, once each)", k, r.shipping, len(got))
		}
		if got, want := states(r.inspect(k)), "published,published,published"; got != want {
			t.Errorf("%s: after the redrives: got %v, want %v", k, got, want)
		}
	}
}
