package amqpidem_test

import (
	"context"
	"errors"
	"net"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
)

// freezeGate forwards connections on loopback to a broker (a
// testenv.Proxy) and, while frozen, stops reading what clients send, as
// RabbitMQ does with a connection it has blocked (a memory or disk alarm)
// once it publishes: the broker's frames still come, the client's wait.
type freezeGate struct {
	proxy  *testenv.Proxy
	frozen atomic.Bool
}

func newFreezeGate(t *testing.T, upstream string) *freezeGate {
	t.Helper()
	g := &freezeGate{}
	g.proxy = testenv.StartProxy(t, upstream, g.up, nil)
	t.Cleanup(func() { g.frozen.Store(false) }) // before the proxy's: up waits while frozen
	return g
}

// up copies what a client sends to the broker, holding it while frozen.
func (g *freezeGate) up(c, up net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		for g.frozen.Load() { // what came while frozen waits too
			time.Sleep(5 * time.Millisecond)
		}
		if n > 0 {
			if _, werr := up.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// url is the AMQP URL of brokerURL's broker through the gate.
func (g *freezeGate) url(t *testing.T, brokerURL string) string { return g.proxy.URL(t, brokerURL) }

// A publish whose confirm does not come in time on a connection the
// broker has stopped reading (blocked) returns at its context: the channel
// it gives up is closed in the background. Before, the Publisher closed it
// on the caller's time, and channel.close waits for a close-ok that a
// blocked connection does not send until the broker unblocks it.
func TestPublisherGivesUpOnBlockedConnection(t *testing.T) {
	e := newEnv(t, nil)
	brokerURL, _ := url.Parse(e.url)
	g := newFreezeGate(t, brokerURL.Host)
	conn, err := amqp.Dial(g.url(t, e.url))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.CloseDeadline(time.Now().Add(time.Second)) })
	pub := amqpidem.NewPublisher(conn)
	ctx := context.Background()
	if err := pub.Publish(ctx, "", e.queue, amqp.Publishing{MessageId: "m1"}); err != nil {
		t.Fatal(err)
	}
	g.frozen.Store(true)
	thaw := time.AfterFunc(10*time.Second, func() { g.frozen.Store(false) }) // bounds the test before the fix
	defer thaw.Stop()
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	within(t, 1500*time.Millisecond, "a publish with a 300 ms context on a blocked connection", func() {
		if err := pub.Publish(short, "", e.queue, amqp.Publishing{MessageId: "m2"}); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Publish: %v, want DeadlineExceeded", err)
		}
	})
	g.frozen.Store(false)
	pub.Close()
}

// Run ends, and Shutdown returns, while the broker has blocked the
// publishing connection: its idle channels are closed in the background
// and the connection within a second. Before, Run's end closed each idle
// channel on its own time, and closing waited for the broker to unblock
// the connection.
func TestConsumerStopsWithBlockedPublishingConnection(t *testing.T) {
	e := newEnv(t, nil)
	brokerURL, _ := url.Parse(e.url)
	g := newFreezeGate(t, brokerURL.Host)
	var dials atomic.Int32
	rec := &recorder{}
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{
		Dial: func() (*amqp.Connection, error) {
			if dials.Add(1) == 1 {
				return amqp.Dial(e.url) // the consuming connection, not blocked
			}
			return amqp.Dial(g.url(t, e.url))
		},
		Config: amqpidem.Config{Queue: e.queue, Observer: rec},
	}, amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) {
		return nil, amqpidem.Permanent(errors.New("no")) // a dead letter: a publish
	}))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	e.publish(amqp.Publishing{MessageId: "m", Body: []byte("x")})
	rec.waitFor(t, 10*time.Second, "m dead-lettered", func(evs []amqpidem.Event) bool {
		return count(evs, "m", amqpidem.DeadLettered) == 1
	})
	g.frozen.Store(true)
	thaw := time.AfterFunc(10*time.Second, func() { g.frozen.Store(false) }) // bounds the test before the fix
	defer thaw.Stop()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	within(t, 2500*time.Millisecond, "Shutdown with the publishing connection blocked", func() {
		if err := c.Shutdown(sctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		select {
		case err := <-done:
			if !errors.Is(err, amqpidem.ErrConsumerClosed) {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Run did not return")
		}
	})
}
