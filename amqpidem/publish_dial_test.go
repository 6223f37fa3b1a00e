package amqpidem_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// DialPublisher dials when the first publish needs it, dials again once
// its connection closed, and Close closes the connection it dialled.
func TestDialPublisherRedials(t *testing.T) {
	e := newEnv(t, nil)
	var mu sync.Mutex
	var conns []*amqp.Connection
	pub := amqpidem.DialPublisher(func() (*amqp.Connection, error) {
		c, err := amqp.Dial(testenv.AMQPURL(t))
		if err == nil {
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
		return c, err
	}, nil)
	if len(conns) != 0 {
		t.Fatal("DialPublisher dialled before the first publish")
	}
	ctx := context.Background()
	publish := func(id string) {
		t.Helper()
		if err := pub.Publish(ctx, "", e.queue, amqp.Publishing{MessageId: id, Body: []byte(id)}); err != nil {
			t.Fatalf("Publish %s: %v", id, err)
		}
	}
	publish("m1")
	_ = conns[0].Close() // as a broker restart would
	publish("m2")
	if len(conns) != 2 {
		t.Fatalf("%d dials, want 2: one, and one after the connection closed", len(conns))
	}
	for _, id := range []string{"m1", "m2"} {
		if d, ok := e.get(e.queue, 5*time.Second); !ok || d.MessageId != id {
			t.Fatalf("want %s delivered, got %q %v", id, d.MessageId, ok)
		}
	}
	pub.Close()
	if !conns[1].IsClosed() {
		t.Error("Close left the dialled connection open")
	}
	if err := pub.Publish(ctx, "", e.queue, amqp.Publishing{MessageId: "m3"}); err == nil {
		t.Error("Publish after Close succeeded")
	}
}

// A dial error is the error of the publish that needed the connection.
func TestDialPublisherDialError(t *testing.T) {
	pub := amqpidem.DialPublisher(func() (*amqp.Connection, error) { return nil, errors.New("no broker here") }, nil)
	defer pub.Close()
	err := pub.Publish(context.Background(), "", "q", amqp.Publishing{MessageId: "m"})
	if err == nil || !strings.Contains(err.Error(), "no broker here") {
		t.Fatalf("Publish = %v, want the dial error", err)
	}
}

// MarshalPublishing and UnmarshalPublishing are each other's inverse, and
// UnmarshalPublishing refuses bytes after the message.
func TestMarshalPublishingRoundTrip(t *testing.T) {
	msg := amqp.Publishing{MessageId: "m", ContentType: "text/plain", DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"a": "b", "n": int64(7)}, Body: []byte("body")}
	b, err := amqpidem.MarshalPublishing("ex", "rk", msg)
	if err != nil {
		t.Fatal(err)
	}
	ex, key, got, err := amqpidem.UnmarshalPublishing(b)
	if err != nil || ex != "ex" || key != "rk" || got.MessageId != "m" || string(got.Body) != "body" ||
		got.Headers["n"] != int64(7) || got.ContentType != "text/plain" {
		t.Fatalf("UnmarshalPublishing = %q %q %+v %v", ex, key, got, err)
	}
	if _, _, _, err := amqpidem.UnmarshalPublishing(append(b, 0)); err == nil || !strings.Contains(err.Error(), "after the message") {
		t.Fatalf("with a byte after the message: %v", err)
	}
	if _, err := amqpidem.MarshalPublishing("ex", "rk", amqp.Publishing{Headers: amqp.Table{"c": 1i}}); err == nil {
		t.Fatal("MarshalPublishing of a complex header: no error")
	}
}
