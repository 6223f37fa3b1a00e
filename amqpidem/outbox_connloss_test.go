package amqpidem_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// publishCutter, on a testenv.Proxy to the broker, cuts a connection,
// both ways, when its client sends a basic.publish with routing key key,
// without forwarding that publish: the first cuts such publishes, then it
// forwards them. Everything else passes through. It stands for a network
// or a broker node lost at the worst moment for a staged message.
type publishCutter struct {
	proxy *testenv.Proxy
	key   string

	mu   sync.Mutex
	left int // cuts still to make
	cut  int // cuts made
}

// newPublishCutter starts a publishCutter in front of the broker at
// amqpURL, closed when the test ends.
func newPublishCutter(t *testing.T, amqpURL, key string, cuts int) *publishCutter {
	t.Helper()
	u, err := url.Parse(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	p := &publishCutter{key: key, left: cuts}
	p.proxy = testenv.StartProxy(t, u.Host, p.forward, nil)
	return p
}

// url is amqpURL with the proxy's address in place of the broker's.
func (p *publishCutter) url(t *testing.T, amqpURL string) string { return p.proxy.URL(t, amqpURL) }

// cuts returns how many connections it cut.
func (p *publishCutter) cuts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cut
}

// forward copies the client's frames to the broker, one at a time, until
// either side fails or a publish to key is to be cut.
func (p *publishCutter) forward(c, up net.Conn) {
	r := bufio.NewReader(c)
	header := make([]byte, 8) // "AMQP" 0 0 9 1
	if _, err := io.ReadFull(r, header); err != nil {
		return
	}
	if _, err := up.Write(header); err != nil {
		return
	}
	for {
		head := make([]byte, 7) // type, channel, size
		if _, err := io.ReadFull(r, head); err != nil {
			return
		}
		size := binary.BigEndian.Uint32(head[3:])
		frame := make([]byte, 7+int(size)+1) // and the frame-end octet
		copy(frame, head)
		if _, err := io.ReadFull(r, frame[7:]); err != nil {
			return
		}
		if head[0] == 1 && p.cutPublish(frame[7:7+size]) {
			return
		}
		if _, err := up.Write(frame); err != nil {
			return
		}
	}
}

// cutPublish reports whether the method frame payload m is a basic.publish
// to p.key that is to be cut (and counts the cut).
func (p *publishCutter) cutPublish(m []byte) bool {
	// class 60 (basic), method 40 (publish): reserved short, exchange and
	// routing key as short strings.
	if len(m) < 7 || binary.BigEndian.Uint16(m) != 60 || binary.BigEndian.Uint16(m[2:]) != 40 {
		return false
	}
	at := 6
	at += 1 + int(m[at]) // exchange
	if at >= len(m) || at+1+int(m[at]) > len(m) {
		return false
	}
	if string(m[at+1:at+1+int(m[at])]) != p.key {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.left == 0 {
		return false
	}
	p.left--
	p.cut++
	return true
}

// TestOutboxConnectionLostIsNotRefusal: a staged message whose publish
// loses its connection, time after time (more times than MaxAttempts),
// while its queue is routable, is not the broker refusing it: it is never
// given up, and once the connection holds it is published, once.
func TestOutboxConnectionLostIsNotRefusal(t *testing.T) {
	e := newEnv(t, nil)
	next := e.queue + ".next"
	if _, err := e.ch.QueueDeclare(next, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(next, false, false, false) })
	const maxAttempts = 5
	proxy := newPublishCutter(t, e.url, next, maxAttempts+2)
	proxyURL := proxy.url(t, e.url)
	logs, logger := newConnLogs()
	rec := &recorder{}
	h := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		return nil, amqpidem.Stage(ctx, "", next, amqp.Publishing{Body: []byte("after " + string(d.Body))})
	})
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Dial: func() (*amqp.Connection, error) { return amqp.Dial(proxyURL) },
		Config: amqpidem.Config{Observer: rec, Logger: logger, MaxAttempts: maxAttempts,
			UnavailableDelay: 50 * time.Millisecond, DelayInProcess: true},
	}, h)
	e.publish(amqp.Publishing{MessageId: "op", Body: []byte("op")})

	// Settled for good: acked as completed or duplicate work, with its
	// staged message published or given up.
	rec.waitFor(t, 60*time.Second, "the operation settled", func(evs []amqpidem.Event) bool {
		for _, ev := range evs {
			if ev.Key == "op" && (ev.Outcome == amqpidem.Completed || ev.Outcome == amqpidem.Duplicate) {
				return true
			}
		}
		return false
	})
	if logs.hasLine("staged message given up") {
		for _, line := range strings.Split(logs.String(), "\n") {
			if strings.Contains(line, "given up") {
				t.Log(line)
			}
		}
		t.Errorf("a staged message was given up after %d lost connections, its queue routable", proxy.cuts())
	}
	var got []amqp.Delivery
	for {
		m, ok := e.get(next, time.Second)
		if !ok {
			break
		}
		got = append(got, m)
	}
	if len(got) != 1 || string(got[0].Body) != "after op" {
		t.Fatalf("downstream got %d messages after %d lost connections, want the staged one once", len(got), proxy.cuts())
	}
	if n := proxy.cuts(); n != maxAttempts+2 {
		t.Fatalf("the proxy cut %d publishes, want %d", n, maxAttempts+2)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, ev := range rec.events {
		if ev.Outbox.Returned != 0 {
			t.Fatalf("an event counted a staged message given up: %+v", ev)
		}
		if ev.Err != nil && amqpidem.IsRefused(ev.Err) {
			t.Fatalf("a lost connection taken for a refusal: %v", ev.Err)
		}
	}
}
