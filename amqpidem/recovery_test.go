package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// recoveryConfig turns on amqp091-go's automatic connection recovery
// (v1.16), quick enough for a test.
func recoveryConfig(name string) amqp.Config {
	return amqp.Config{
		Properties: amqp.Table{"connection_name": name},
		Recovery: &amqp.Recovery{ReconnectionConfig: &amqp.ReconnectionConfig{
			MaxRetryCount: 20, RetryInterval: 100 * time.Millisecond,
		}},
	}
}

// connectionNameRE reads connection_name out of rabbitmqctl's
// client_properties.
var connectionNameRE = regexp.MustCompile(`\{"connection_name","([^"]*)"\}`)

// closeConnection closes, on the broker, the connection named name
// (connection_name), as an operator or a network fault would.
func closeConnection(t *testing.T, name string) {
	t.Helper()
	out, err := rabbitmqctl("list_connections", "-q", "--no-table-headers", "pid", "client_properties")
	if err != nil {
		t.Fatalf("list_connections: %v: %s", err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		pid, props, ok := strings.Cut(strings.TrimSpace(line), "\t")
		if m := connectionNameRE.FindStringSubmatch(props); ok && m != nil && m[1] == name {
			if out, err := rabbitmqctl("close_connection", pid, "closed by the test"); err != nil {
				t.Fatalf("close_connection %s: %v: %s", pid, err, out)
			}
			return
		}
	}
	t.Fatalf("no connection named %q:\n%s", name, out)
}

// queueUnacked returns how many deliveries of queue the broker counts as
// delivered and not acknowledged.
func queueUnacked(t *testing.T, queue string) int {
	t.Helper()
	out, err := rabbitmqctl("list_queues", "-q", "--no-table-headers", "name", "messages_unacknowledged")
	if err != nil {
		t.Fatalf("list_queues: %v: %s", err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == queue {
			n, err := strconv.Atoi(f[1])
			if err != nil {
				t.Fatalf("list_queues: %q", line)
			}
			return n
		}
	}
	t.Fatalf("queue %s not listed:\n%s", queue, out)
	return 0
}

// A Dial whose connections recover by themselves (amqp.Config.Recovery)
// is refused: amqp091-go rebuilds such a connection under the same
// channel, whose delivery tags start again at 1 while the Consumer still
// acks the old ones. Without the refusal the story goes: "old" (tag 3)
// runs through a close_connection; after the recovery "new1" and "new2"
// get tags 2 and 3 of the rebuilt channel, and old's ack, folded into a
// multiple ack of tag 3, acks them while their handlers still run: a
// crash then would lose them.
func TestConsumerRefusesAutomaticRecovery(t *testing.T) {
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Skip("no rabbitmqctl to close the connection with")
	}
	e := newEnv(t, nil)
	var dials atomic.Int32
	oldStarted, newStarted := make(chan struct{}, 1), make(chan string, 2)
	releaseOld, releaseNew := make(chan struct{}), make(chan struct{})
	var once sync.Once
	var ran atomic.Int32
	rec := &recorder{}
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{
		Dial: func() (*amqp.Connection, error) {
			return amqp.DialConfig(e.url, recoveryConfig(fmt.Sprintf("%s-%d", e.queue, dials.Add(1))))
		},
		Config: amqpidem.Config{Queue: e.queue, Observer: rec},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		ran.Add(1)
		switch d.MessageId {
		case "old":
			oldStarted <- struct{}{}
			<-releaseOld
		case "new1", "new2":
			newStarted <- d.MessageId
			select { // a long job
			case <-releaseNew:
			case <-ctx.Done():
			}
		}
		return nil, nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	done := connRun(t, c, context.Background())
	// Before Shutdown, which waits for the handlers.
	t.Cleanup(func() { once.Do(func() { close(releaseOld) }); close(releaseNew) })
	for _, id := range []string{"m1", "m2", "old"} {
		e.publish(amqp.Publishing{MessageId: id, Body: []byte(id)})
	}
	select {
	case err := <-done:
		if !errors.Is(err, amqpidem.ErrAutoRecovery) || !strings.Contains(err.Error(), "Recovery") {
			t.Fatalf("Run: %v; want ErrAutoRecovery, naming amqp.Config.Recovery", err)
		}
		if n := ran.Load(); n != 0 {
			t.Fatalf("%d handlers ran before the refusal", n)
		}
		return
	case <-oldStarted:
	case <-time.After(15 * time.Second):
		t.Fatal("neither refused nor consuming after 15 s")
	}

	// The connection recovers; old's redelivery is acked as busy, on the
	// rebuilt channel (tag 1).
	closeConnection(t, e.queue+"-1")
	rec.waitFor(t, 15*time.Second, "old's redelivery requeued as busy", func(evs []amqpidem.Event) bool {
		return count(evs, "old", amqpidem.Busy) == 1
	})
	e.publish(amqp.Publishing{MessageId: "new1", Body: []byte("x")})
	e.publish(amqp.Publishing{MessageId: "new2", Body: []byte("x")})
	for range 2 {
		select {
		case <-newStarted:
		case <-time.After(10 * time.Second):
			t.Fatal("new1 and new2 not both started")
		}
	}
	once.Do(func() { close(releaseOld) }) // old completes: its ack goes out
	rec.waitFor(t, 10*time.Second, "old completed", func(evs []amqpidem.Event) bool {
		return count(evs, "old", amqpidem.Completed) == 1
	})
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		if n := queueUnacked(t, e.queue); n < 2 {
			t.Fatalf("the broker counts %d deliveries unacknowledged while new1 and new2 still run: "+
				"old's ack acked them on the recovered channel", n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Wrap refuses a publishing connection that recovers by itself, and a
// Publisher's publishes on one fail: a recovered channel's publish
// sequence numbers start again under the confirms awaited.
func TestWrapAndPublisherRefuseAutomaticRecovery(t *testing.T) {
	e := newEnv(t, nil)
	conn, err := amqp.DialConfig(e.url, recoveryConfig(e.queue+"-pub"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	if _, err := amqpidem.Wrap(conn, e.store, amqpidem.Config{Queue: e.queue}, amqpidem.HandlerFunc(connNoop)); !errors.Is(err, amqpidem.ErrAutoRecovery) {
		t.Errorf("Wrap: %v, want ErrAutoRecovery", err)
	}
	pub := amqpidem.NewPublisher(conn)
	defer pub.Close()
	if err := pub.Publish(context.Background(), "", e.queue, amqp.Publishing{MessageId: "m"}); !errors.Is(err, amqpidem.ErrAutoRecovery) {
		t.Errorf("NewPublisher's Publish: %v, want ErrAutoRecovery", err)
	}
	dp := amqpidem.DialPublisher(func() (*amqp.Connection, error) {
		return amqp.DialConfig(e.url, recoveryConfig(e.queue+"-dialpub"))
	}, nil)
	defer dp.Close()
	if err := dp.Publish(context.Background(), "", e.queue, amqp.Publishing{MessageId: "m"}); !errors.Is(err, amqpidem.ErrAutoRecovery) {
		t.Errorf("DialPublisher's Publish: %v, want ErrAutoRecovery", err)
	}
	if q, err := e.ch.QueueDeclarePassive(e.queue, true, false, false, false, nil); err != nil || q.Messages != 0 {
		t.Errorf("queue after refused publishes: %d messages (%v), want 0", q.Messages, err)
	}
}
