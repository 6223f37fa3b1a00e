package amqpidem

import (
	"errors"
	"fmt"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// hobs2Conn is a socket whose writes fail while fail is set.
type hobs2Conn struct {
	net.Conn
	fail atomic.Bool
}

func (c *hobs2Conn) Write(p []byte) (int, error) {
	if c.fail.Load() {
		return 0, errors.New("write refused (test)")
	}
	return c.Conn.Write(p)
}

// hobs2Frames is an amqp.Acknowledger that records each call made to the
// channel under it and what it returned.
type hobs2Frames struct {
	ch  *amqp.Channel
	mu  sync.Mutex
	log []string
}

func (f *hobs2Frames) rec(s string, err error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.log = append(f.log, fmt.Sprintf("%s err=%v", s, err != nil))
	return err
}

func (f *hobs2Frames) Ack(tag uint64, multiple bool) error {
	return f.rec(fmt.Sprintf("ack %d multiple=%v", tag, multiple), f.ch.Ack(tag, multiple))
}

func (f *hobs2Frames) Nack(tag uint64, multiple, requeue bool) error {
	return f.rec(fmt.Sprintf("nack %d", tag), f.ch.Nack(tag, multiple, requeue))
}

func (f *hobs2Frames) Reject(tag uint64, requeue bool) error {
	return f.rec(fmt.Sprintf("reject %d", tag), f.ch.Reject(tag, requeue))
}

// The acker counts a nack whose frame failed to be written as settled
// (sent), so the frontier passes it and a held ack above it goes out as a
// multiple ack covering it. On amqp091-go that multiple ack cannot reach
// the broker: a frame's write error fails every later frame of the
// connection (its bufio.Writer keeps the error, and the connection shuts
// down), even once the socket would write again; a channel or connection
// closed fails them with ErrClosed. Against the real RabbitMQ: deliveries
// 1..3, 1 acked (written), 3 acked and held above 2, the socket's writes
// fail for 2's nack (dead letter, requeue false), then work again: the
// multiple ack of 3 fails too, and 2 and 3 are back in the queue, not
// acked.
func TestHobs2AckerFailedNackNotCoveredByMultipleAck(t *testing.T) {
	const url = "amqp://guest:guest@127.0.0.1:5672/"
	admin, err := amqp.Dial(url)
	if err != nil {
		t.Skipf("RabbitMQ: %v", err)
	}
	defer admin.Close()
	ach, err := admin.Channel()
	if err != nil {
		t.Fatal(err)
	}
	queue := fmt.Sprintf("hobs2-acker-%d", time.Now().UnixNano())
	if _, err := ach.QueueDeclare(queue, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ach.QueueDelete(queue, false, false, false) })
	for i := 1; i <= 3; i++ {
		if err := ach.Publish("", queue, false, false, amqp.Publishing{Body: []byte(fmt.Sprintf("m%d", i))}); err != nil {
			t.Fatal(err)
		}
	}

	var sock *hobs2Conn
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: func(network, addr string) (net.Conn, error) {
		c, err := amqp.DefaultDial(5*time.Second)(network, addr)
		if err != nil {
			return nil, err
		}
		sock = &hobs2Conn{Conn: c}
		return sock, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Qos(3, 0, false); err != nil {
		t.Fatal(err)
	}
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 3; i++ {
		select {
		case <-ds:
		case <-time.After(5 * time.Second):
			t.Fatalf("delivery %d not received", i)
		}
	}
	frames := &hobs2Frames{ch: ch}
	a := newAcker(frames, 3)
	if err := a.Ack(1, false); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // ackFlush: 1 written
	if err := a.Ack(3, false); err != nil {
		t.Fatal(err)
	}
	sock.fail.Store(true)
	nackErr := a.Nack(2, false, false)
	sock.fail.Store(false)
	if nackErr == nil {
		t.Fatal("the nack's write did not fail")
	}
	time.Sleep(50 * time.Millisecond)
	a.flush()
	frames.mu.Lock()
	t.Logf("frames: %q", frames.log)
	for _, l := range frames.log {
		if l == "ack 3 multiple=true err=false" || l == "ack 3 multiple=false err=false" {
			t.Errorf("3's ack was written after 2's nack failed: %q", frames.log)
		}
	}
	frames.mu.Unlock()
	_ = conn.Close()

	// What the broker holds now: 2 and 3, never settled.
	var got []string
	deadline := time.Now().Add(5 * time.Second)
	for len(got) < 2 && time.Now().Before(deadline) {
		m, ok, err := ach.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		got = append(got, string(m.Body))
	}
	time.Sleep(100 * time.Millisecond)
	if _, ok, _ := ach.Get(queue, true); ok {
		t.Errorf("more than two messages back in the queue")
	}
	sort.Strings(got)
	if fmt.Sprint(got) != "[m2 m3]" {
		t.Errorf("back in the queue: %v, want [m2 m3] (m1 acked, 2's nack and 3's ack never reached the broker)", got)
	}
}
