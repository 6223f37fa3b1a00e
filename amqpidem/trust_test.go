package amqpidem

import (
	"context"
	"errors"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

var (
	testSigningKey = []byte("0123456789abcdef-test-key")
	errDeclined    = errors.New("card declined")
)

// settleOnce runs d through a processor of cfg whose handler is h and
// returns the one copy it published.
func settleOnce(t *testing.T, cfg Config, h HandlerFunc, d *amqp.Delivery) (Event, published) {
	t.Helper()
	p, _ := newTestProcessor(t, cfg, h)
	b := &fakeBroker{}
	ev := p.process(context.Background(), b, d, nil)
	if len(b.pubs) != 1 {
		t.Fatalf("%v (%s, %v): published %d copies, want 1", ev.Outcome, ev.Reason, ev.Err, len(b.pubs))
	}
	return ev, b.pubs[0]
}

// TestDeadLetterSigned checks that a consumer with a SigningKey signs its
// dead letters, and that the signature covers what an operator's tool acts
// on: any change to the endpoint, key, original exchange or routing key,
// or body, or another key, fails to verify.
func TestDeadLetterSigned(t *testing.T) {
	d, _ := delivery("pay-1", "body")
	_, dl := settleOnce(t, Config{SigningKey: testSigningKey}, fails(Permanent(errDeclined)), d)
	h, body := dl.msg.Headers, dl.msg.Body
	if err := VerifySignature(testSigningKey, h, body); err != nil {
		t.Fatalf("dead letter does not verify: %v (headers %v)", err, h)
	}
	if h[HeaderKey] != "pay-1" || h[HeaderEndpoint] != "q" || h[HeaderOriginalExchange] != "ex" || h[HeaderOriginalRoutingKey] != "rk" {
		t.Fatalf("dead letter headers: %v", h)
	}
	for _, name := range []string{HeaderEndpoint, HeaderKey, HeaderOriginalExchange, HeaderOriginalRoutingKey} {
		forged := maps.Clone(h)
		forged[name] = "other"
		if err := VerifySignature(testSigningKey, forged, body); !errors.Is(err, ErrBadSignature) {
			t.Errorf("%s changed: %v, want ErrBadSignature", name, err)
		}
		delete(forged, name)
		if err := VerifySignature(testSigningKey, forged, body); !errors.Is(err, ErrBadSignature) {
			t.Errorf("%s removed: %v, want ErrBadSignature", name, err)
		}
	}
	if err := VerifySignature(testSigningKey, h, []byte("bodY")); !errors.Is(err, ErrBadSignature) {
		t.Errorf("body changed: %v, want ErrBadSignature", err)
	}
	if err := VerifySignature([]byte("another key of 16 bytes"), h, body); !errors.Is(err, ErrBadSignature) {
		t.Errorf("other key: %v, want ErrBadSignature", err)
	}
	if err := VerifySignature(nil, h, body); !errors.Is(err, ErrBadSignature) {
		t.Errorf("no key: %v, want ErrBadSignature", err)
	}
	unsigned := maps.Clone(h)
	delete(unsigned, HeaderSignature)
	if err := VerifySignature(testSigningKey, unsigned, body); !errors.Is(err, ErrUnsigned) {
		t.Errorf("no signature: %v, want ErrUnsigned", err)
	}
	unsigned[HeaderSignature] = int64(1)
	if err := VerifySignature(testSigningKey, unsigned, body); !errors.Is(err, ErrBadSignature) {
		t.Errorf("signature not text: %v, want ErrBadSignature", err)
	}
}

// TestForgedOriginNotCarried checks that, with a SigningKey, the original
// exchange and routing key a publisher writes into a message's headers do
// not reach its dead letter (signed, they would be trusted): the copy
// names the delivery's own. Headers a signed copy carried are kept, so
// that a message requeued before it was dead-lettered still names where
// it was first published.
func TestForgedOriginNotCarried(t *testing.T) {
	forged := amqp.Table{HeaderOriginalExchange: "payments", HeaderOriginalRoutingKey: "refund.all"}
	d, _ := delivery("pay-2", "body")
	d.Headers = maps.Clone(forged)
	_, dl := settleOnce(t, Config{SigningKey: testSigningKey}, fails(Permanent(errDeclined)), d)
	if h := dl.msg.Headers; h[HeaderOriginalExchange] != "ex" || h[HeaderOriginalRoutingKey] != "rk" {
		t.Errorf("forged origin signed into the dead letter: %v", h)
	}

	// Without a key nothing is verified (and nothing signed): the
	// headers are informational, as before.
	d, _ = delivery("pay-3", "body")
	d.Headers = maps.Clone(forged)
	_, dl = settleOnce(t, Config{}, fails(Permanent(errDeclined)), d)
	if h := dl.msg.Headers; h[HeaderOriginalExchange] != "payments" || h[HeaderSignature] != nil {
		t.Errorf("without a key: %v", h)
	}

	// A retry's copy is signed; when it comes back (through the delay
	// queue, by the default exchange) and fails for good, its dead letter
	// keeps the first exchange and routing key, signed again.
	retry := Config{SigningKey: testSigningKey, Backoff: func() backoff.BackOff { return backoff.NewConstantBackOff(time.Second) }}
	d, _ = delivery("pay-4", "body")
	_, rq := settleOnce(t, retry, fails(errDeclined), d)
	if rq.key != "requeue" {
		t.Fatalf("got a publish to %q, want a requeue", rq.key)
	}
	if err := VerifySignature(testSigningKey, rq.msg.Headers, rq.msg.Body); err != nil {
		t.Fatalf("requeued copy: %v", err)
	}
	back, _ := delivery("pay-4", "body")
	back.Headers, back.Exchange, back.RoutingKey = rq.msg.Headers, "", "q"
	_, dl = settleOnce(t, retry, fails(Permanent(errDeclined)), back)
	h := dl.msg.Headers
	if h[HeaderOriginalExchange] != "ex" || h[HeaderOriginalRoutingKey] != "rk" || VerifySignature(testSigningKey, h, dl.msg.Body) != nil {
		t.Errorf("dead letter of a requeued copy: %v", h)
	}

	// A signature a consumer without the key cannot renew is dropped.
	back, _ = delivery("pay-4", "body")
	back.Headers = maps.Clone(rq.msg.Headers)
	_, dl = settleOnce(t, Config{}, fails(Permanent(errDeclined)), back)
	if _, ok := dl.msg.Headers[HeaderSignature]; ok {
		t.Errorf("a consumer without a key carried a signature: %v", dl.msg.Headers)
	}
}

// TestReplyToAllowList checks Config.ReplyTo: a message naming a reply
// queue outside it is dead-lettered without running, one inside it (by
// name or prefix) runs, and one without ReplyTo is not affected.
func TestReplyToAllowList(t *testing.T) {
	cfg := Config{ReplyTo: []string{"rpc.replies", "amq.rabbitmq.reply-to.*"}}
	for _, tc := range []struct {
		replyTo string
		runs    bool
	}{
		{"rpc.replies", true},
		{"amq.rabbitmq.reply-to.g1h2AA", true},
		{"", true},
		{"rpc.replies.other", false},
		{"payments", false},
		{"amq.rabbitmq.reply-to", false},
	} {
		runs := 0
		h := func(context.Context, *amqp.Delivery) ([]byte, error) { runs++; return []byte("r"), nil }
		p, store := newTestProcessor(t, cfg, h)
		b := &fakeBroker{}
		d, _ := delivery("k", "x")
		d.ReplyTo = tc.replyTo
		ev := p.process(context.Background(), b, d, nil)
		if got := runs == 1; got != tc.runs {
			t.Errorf("ReplyTo %q: ran %d times (%v, %s, %v), want run %v", tc.replyTo, runs, ev.Outcome, ev.Reason, ev.Err, tc.runs)
			continue
		}
		if tc.runs {
			continue
		}
		if ev.Outcome != DeadLettered || ev.Reason != "reply-to refused" || len(b.pubs) != 1 || b.pubs[0].key != "q.dlq" {
			t.Errorf("ReplyTo %q: %v %q %v, publishes %+v; want dead-lettered", tc.replyTo, ev.Outcome, ev.Reason, ev.Err, b.pubs)
		}
		if res, err := store.Acquire(context.Background(), lock.Request{Key: StoreKey("q", "k"), TTL: time.Second}); err != nil || res.Status != lock.Acquired || res.Attempts != 1 {
			t.Errorf("ReplyTo %q: the record afterwards: %+v %v, want none (a first attempt)", tc.replyTo, res, err)
		}
	}
}

// TestValidateSigningKeyAndReplyTo checks the new fields' validation.
func TestValidateSigningKeyAndReplyTo(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Queue: "q", SigningKey: []byte("short")}, "SigningKey"},
		{Config{Queue: "q", ReplyTo: []string{"*"}}, "ReplyTo"},
		{Config{Queue: "q", ReplyTo: []string{""}}, "ReplyTo"},
		{Config{Queue: "q", SigningKey: testSigningKey, ReplyTo: []string{"a", "b.*"}}, ""},
	} {
		err := tc.cfg.Validate()
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%+v: %v, want an error naming %q", tc.cfg, err, tc.want)
		}
	}
}
