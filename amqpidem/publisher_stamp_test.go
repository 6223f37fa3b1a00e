package amqpidem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// Publisher stamps when a message was published (the timestamp property
// and HeaderTimestampMillis, which Event.Published reads), keeps a
// publisher's own stamp, and never changes the caller's header table.
func TestPublisherStampsPublishTime(t *testing.T) {
	e := newEnv(t, nil)
	pub := amqpidem.NewPublisher(e.conn)
	defer pub.Close()
	headers := amqp.Table{"tenant": "a"}
	before := time.Now()
	if err := pub.Publish(context.Background(), "", e.queue, amqp.Publishing{MessageId: "m1", Headers: headers, Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(context.Background(), "", e.queue, amqp.Publishing{MessageId: "m2", Body: []byte("x"),
		Headers: amqp.Table{amqpidem.HeaderTimestampMillis: int64(1700000000123)}}); err != nil {
		t.Fatal(err)
	}
	if len(headers) != 1 {
		t.Fatalf("the caller's headers were changed: %v", headers)
	}
	d, ok := e.get(e.queue, 5*time.Second)
	if !ok {
		t.Fatal("m1 not delivered")
	}
	ms, _ := d.Headers[amqpidem.HeaderTimestampMillis].(int64)
	if ms < before.UnixMilli() || ms > time.Now().UnixMilli() || d.Headers["tenant"] != "a" ||
		d.Timestamp.Before(before.Truncate(time.Second)) {
		t.Fatalf("m1: %s %v, timestamp %v; want now, and the caller's headers kept", amqpidem.HeaderTimestampMillis, d.Headers, d.Timestamp)
	}
	d, ok = e.get(e.queue, 5*time.Second)
	if !ok || d.Headers[amqpidem.HeaderTimestampMillis] != int64(1700000000123) {
		t.Fatalf("m2: %v %v, want the publisher's own stamp kept", ok, d.Headers)
	}
}

// Publishing before the queue exists is the first thing a new user does
// (publisher started before the consumer that declares the queue): the
// error says what to do, not only the broker's 312 NO_ROUTE.
func TestPublisherUnroutableSaysWhatToDo(t *testing.T) {
	e := newEnv(t, nil)
	pub := amqpidem.NewPublisher(e.conn)
	defer pub.Close()
	err := pub.Publish(context.Background(), "", e.queue+".nobody", amqp.Publishing{MessageId: "m1", Body: []byte("x")})
	if !errors.Is(err, amqpidem.ErrUnroutable) || !strings.Contains(err.Error(), "declare the queue") {
		t.Fatalf("got %v, want ErrUnroutable saying to declare the queue", err)
	}
}
