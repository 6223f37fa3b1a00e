package amqpidem_test

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

func waitReady(t *testing.T, c *amqpidem.Consumer, want bool) error {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ready(ctx)
		cancel()
		if (err == nil) == want || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestReadyFollowsBrokerSession(t *testing.T) {
	e := newEnv(t, nil)
	conns := make(chan *amqp.Connection, 10)
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: e.url, Config: amqpidem.Config{Queue: e.queue},
		Dial: func() (*amqp.Connection, error) {
			conn, err := amqp.Dial(e.url)
			if err == nil {
				conns <- conn
			}
			return conn, err
		}}, amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Ready(context.Background()); !errors.Is(err, amqpidem.ErrNotReady) {
		t.Fatalf("before Run: got %v, want ErrNotReady", err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	if err := waitReady(t, c, true); err != nil {
		t.Fatalf("consuming: %v", err)
	}
	(<-conns).Close() // the session dies; the consumer reconnects
	// Ready may see the reconnection already done; it must be ready again.
	if err := waitReady(t, c, true); err != nil {
		t.Fatalf("after reconnecting: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	<-done
	if err := c.Ready(context.Background()); !errors.Is(err, amqpidem.ErrNotReady) {
		t.Fatalf("after Shutdown: got %v, want ErrNotReady", err)
	}
}

func TestReadyPingsStore(t *testing.T) {
	e := newEnv(t, nil)
	// A Redis that does not answer: a listener that accepts and says nothing.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	client := redis.NewClient(&redis.Options{Addr: ln.Addr().String(), MaxRetries: -1, ReadTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { client.Close() })
	mute, err := lock.NewRedisStore(client, lock.Config{Prefix: e.queue})
	if err != nil {
		t.Fatal(err)
	}
	c := startConsumerWith(t, e, mute, amqpidem.ConsumerConfig{Config: amqpidem.Config{Logger: slog.New(slog.DiscardHandler)}},
		amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }))
	// Once consuming, the store that does not answer is the reason.
	deadline := time.Now().Add(15 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err = c.Ready(ctx)
		cancel()
		if err == nil {
			t.Fatal("ready with a store that does not answer")
		}
		if !errors.Is(err, amqpidem.ErrNotReady) {
			t.Fatalf("got %v, want ErrNotReady", err)
		}
		if errors.Is(err, lock.ErrUnavailable) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still %v, want the store's ErrUnavailable once consuming", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
