package console_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/console"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// signingKey is the test consumers' Config.SigningKey.
const signingKey = "console-signing-key-0123456789"

// hostileKey would run a script if put into a page raw, and would move
// the cursor, set a terminal's title and reverse the text after it if
// printed raw.
const hostileKey = "<script>alert(1)</script>\x1b[2J\x1b]0;pwned\x07\u202eX\"'&"

// seeded is a queue whose real amqpidem consumer (on the local Redis and
// RabbitMQ) failed for good on each message published: each key has a
// failed record and a signed dead letter in QUEUE.dlq.
type seeded struct {
	queue string
	store *lock.RedisStore
	url   string
	conn  *amqp.Connection
}

func seed(t *testing.T, keys ...string) *seeded {
	t.Helper()
	url := testenv.AMQPURL(t)
	s := &seeded{queue: testenv.Name(t), url: url}
	var err error
	if s.store, err = lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: "console-" + s.queue}); err != nil {
		t.Fatal(err)
	}
	if s.conn, err = amqp.Dial(url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.conn.Close() })
	ch, err := s.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(s.queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	testenv.DeleteQueues(t, url, s.queue, s.queue+".dlq")
	events := make(chan amqpidem.Event, 100)
	c, err := amqpidem.NewConsumer(s.store, amqpidem.ConsumerConfig{URL: url, Config: amqpidem.Config{Queue: s.queue,
		Logger: slog.New(slog.DiscardHandler), SigningKey: []byte(signingKey),
		Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { events <- e })}},
		amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) {
			return nil, amqpidem.Permanent(errors.New("card declined <b>\x1b[31m"))
		}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	pub := amqpidem.NewPublisher(s.conn)
	t.Cleanup(pub.Close)
	for _, k := range keys {
		if err := pub.Publish(context.Background(), "", s.queue, amqp.Publishing{MessageId: k, Body: []byte("pay")}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.After(60 * time.Second)
	for seen := 0; seen < len(keys); {
		select {
		case e := <-events:
			if e.Outcome == amqpidem.DeadLettered {
				seen++
			}
		case <-deadline:
			t.Fatalf("%d of %d dead-lettered in 60 s", seen, len(keys))
		}
	}
	return s
}

// serve starts the console for s (nil: no services) with cfg's other
// fields.
func serve(t *testing.T, s *seeded, cfg console.Config) *httptest.Server {
	t.Helper()
	if s != nil {
		cfg.Admin, cfg.StoreName = s.store, "Redis (test)"
		cfg.Dial = func() (*amqp.Connection, error) { return amqp.Dial(s.url) }
		cfg.BrokerName = "RabbitMQ (test)"
	}
	cfg.Logger = slog.New(slog.DiscardHandler)
	h, err := console.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// get fetches path from srv and checks its status; it returns the body.
func get(t *testing.T, srv *httptest.Server, path string, status int) string {
	t.Helper()
	resp, err := http.Get(srv.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != status {
		t.Fatalf("GET %s: %d, want %d:\n%s", path, resp.StatusCode, status, b)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/html") {
		t.Fatalf("GET %s: Content-Type %q", path, ct)
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") {
		t.Fatalf("GET %s: Content-Security-Policy %q", path, csp)
	}
	return string(b)
}

// noRaw fails unless page holds none of the hostile pieces raw: no tag
// from a message, no ESC, BEL or bidi override.
func noRaw(t *testing.T, what, page string) {
	t.Helper()
	for _, bad := range []string{"<script", "<b>", "\x1b", "\x07", "\u202e"} {
		if strings.Contains(page, bad) {
			t.Fatalf("%s: %q reaches the page raw:\n%s", what, bad, page)
		}
	}
}

func mustContain(t *testing.T, what, page string, wants ...string) {
	t.Helper()
	for _, w := range wants {
		if !strings.Contains(page, w) {
			t.Fatalf("%s: no %q in:\n%s", what, w, page)
		}
	}
}

// TestConsoleKeyPage: a failed record, made by a real consumer, is shown
// with its state, attempts, fence, error and the command that forgets it;
// a hostile key and error are shown escaped.
func TestConsoleKeyPage(t *testing.T) {
	s := seed(t, "pay-1042", hostileKey)
	srv := serve(t, s, console.Config{})

	page := get(t, srv, "/key?endpoint="+url.QueryEscape(s.queue)+"&key=pay-1042", http.StatusOK)
	rec, err := s.store.Inspect(context.Background(), amqpidem.StoreKey(s.queue, "pay-1042"))
	if err != nil {
		t.Fatal(err)
	}
	mustContain(t, "key page", page, `class="state failed">failed<`, "<th>attempts</th><td>1</td>",
		"<th>fence</th><td>"+itoa(rec.Fence)+"</td>", "card declined &lt;b&gt;\\x1b[31m",
		"forget pay-1042 --endpoint "+s.queue+" --dry-run")
	noRaw(t, "key page", page)

	page = get(t, srv, "/key?endpoint="+url.QueryEscape(s.queue)+"&key="+url.QueryEscape(hostileKey), http.StatusOK)
	mustContain(t, "hostile key page", page, `&lt;script&gt;alert(1)&lt;/script&gt;\x1b[2J\x1b]0;pwned\x07\u202eX&#34;&#39;&amp;`, "failed")
	noRaw(t, "hostile key page", page)
	if strings.Contains(page, "forget &lt;script") {
		t.Fatalf("a command line with a key that cannot be typed back is shown:\n%s", page)
	}
}

// TestConsoleDeadLetters: the dead letters of a real consumer are listed
// with key, reason, error, attempts, origin and a link to each key's
// record, escaped, and are still all in the queue afterwards; without the
// signing key they are "unchecked".
func TestConsoleDeadLetters(t *testing.T) {
	s := seed(t, "pay-1042", hostileKey)
	srv := serve(t, s, console.Config{SigningKey: []byte(signingKey), Queues: []string{s.queue}})

	page := get(t, srv, "/dlq?queue="+url.QueryEscape(s.queue), http.StatusOK)
	mustContain(t, "dlq page", page, s.queue+".dlq holds 2 messages", "pay-1042", "permanent failure",
		`class="origin signed">signed<`, "card declined &lt;b&gt;\\x1b[31m",
		`href="key?endpoint=`+s.queue+`&amp;key=pay-1042"`,
		`href="key?endpoint=`+s.queue+`&amp;key=%3cscript%3ealert%281%29%3c%2fscript%3e%1b%5b2J`,
		"dlq replay "+s.queue+" --key pay-1042 --dry-run")
	noRaw(t, "dlq page", page)
	if strings.Count(page, `class="origin signed"`) != 2 {
		t.Fatalf("want 2 signed dead letters:\n%s", page)
	}
	if n := s.dlqLen(t); n != 2 {
		t.Fatalf("the dead-letter queue holds %d messages after the page, want 2 (given back)", n)
	}

	overview := get(t, srv, "/", http.StatusOK)
	mustContain(t, "overview", overview, `href="dlq?queue=`+s.queue+`">2</a>`, `action="key"`, `action="dlq"`, "read-only")

	unchecked := serve(t, s, console.Config{})
	mustContain(t, "dlq page without the key", get(t, unchecked, "/dlq?queue="+url.QueryEscape(s.queue), http.StatusOK),
		`class="origin unproven">unchecked<`, "signature not checked")
}

// TestConsoleBadInput: an unknown key or queue, a malformed parameter, an
// unknown page, a POST and services down each give a page saying what to
// do, with the status that fits, never a stack.
func TestConsoleBadInput(t *testing.T) {
	s := seed(t)
	srv := serve(t, s, console.Config{})
	for _, c := range []struct {
		path   string
		status int
		want   string
	}{
		{"/key?endpoint=" + s.queue + "&key=never-seen", http.StatusNotFound, "never seen, expired, or forgotten"},
		{"/key?endpoint=" + s.queue, http.StatusBadRequest, "Fill in both"},
		{"/key?endpoint=e&key=" + strings.Repeat("k", lock.MaxKeyLen+1), http.StatusBadRequest, "at most"},
		{"/dlq", http.StatusBadRequest, "Which queue?"},
		{"/dlq?queue=" + s.queue + "&limit=-1", http.StatusBadRequest, "not a number from 1 to 1000"},
		{"/dlq?queue=" + s.queue + "&limit=%3Cscript%3E", http.StatusBadRequest, "limit &#34;&lt;script&gt;&#34;"},
		{"/dlq?queue=no-such-queue-" + s.queue, http.StatusNotFound, "does not exist"},
		{"/nothing%3Cscript%3E", http.StatusNotFound, "Start from the overview"},
	} {
		page := get(t, srv, c.path, c.status)
		mustContain(t, c.path, page, c.want, "What to do:")
		noRaw(t, c.path, page)
		if strings.Contains(page, "goroutine") {
			t.Fatalf("%s: a stack on the page:\n%s", c.path, page)
		}
	}
	resp, err := http.Post(srv.URL+"/key?endpoint=e&key=k", "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("POST: %d, want 405", resp.StatusCode)
	}

	// Services down: a Redis and a RabbitMQ that are not there.
	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { dead.Close() })
	deadStore, err := lock.NewRedisStore(dead, lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	down := serve(t, nil, console.Config{Admin: deadStore, StoreName: "Redis at 127.0.0.1:1", Queues: []string{"orders"},
		Dial:       func() (*amqp.Connection, error) { return amqp.Dial("amqp://guest:secret-pw@127.0.0.1:1/") },
		BrokerName: "RabbitMQ at amqp://guest:xxxxx@127.0.0.1:1/", Timeout: 5 * time.Second})
	page := get(t, down, "/key?endpoint=orders&key=k", http.StatusServiceUnavailable)
	mustContain(t, "store down", page, "Redis at 127.0.0.1:1 did not answer", "Check that the store is up")
	page = get(t, down, "/dlq?queue=orders", http.StatusServiceUnavailable)
	mustContain(t, "broker down", page, "did not answer", "Check that RabbitMQ is up")
	mustContain(t, "overview, broker down", get(t, down, "/", http.StatusOK), "Depths unknown")
	for _, p := range []string{page, get(t, down, "/", http.StatusOK)} {
		if strings.Contains(p, "secret-pw") {
			t.Fatalf("a password on the page:\n%s", p)
		}
	}

	none := serve(t, nil, console.Config{})
	mustContain(t, "no store", get(t, none, "/key?endpoint=e&key=k", http.StatusServiceUnavailable), "No store")
	mustContain(t, "no broker", get(t, none, "/dlq?queue=q", http.StatusServiceUnavailable), "No broker")
}

func (s *seeded) dlqLen(t *testing.T) int {
	t.Helper()
	ch, err := s.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(s.queue+".dlq", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
