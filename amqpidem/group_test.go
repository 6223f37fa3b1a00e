package amqpidem_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// TestGroup: two queues' consumers in one Group: one Run consumes both,
// Ready holds once both consume, and one Shutdown stops both; Run then
// returns ErrGroupClosed and no goroutine is left (issue 42, item 8).
func TestGroup(t *testing.T) {
	e1, e2 := newEnv(t, nil), newEnv(t, nil)
	baseline := runtime.NumGoroutine()
	rec := &recorder{}
	ok := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) { return nil, nil })
	var consumers []*amqpidem.Consumer
	for _, e := range []*env{e1, e2} {
		c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: e.url, Config: amqpidem.Config{Queue: e.queue, Observer: rec}}, ok)
		if err != nil {
			t.Fatal(err)
		}
		consumers = append(consumers, c)
	}
	g := amqpidem.NewGroup(consumers...)
	if err := g.Ready(context.Background()); !errors.Is(err, amqpidem.ErrNotReady) {
		t.Fatalf("Ready before Run: got %v, want ErrNotReady", err)
	}
	done := make(chan error, 1)
	go func() { done <- g.Run(context.Background()) }()
	deadline := time.Now().Add(10 * time.Second)
	for g.Ready(context.Background()) != nil {
		if time.Now().After(deadline) {
			t.Fatalf("not ready: %v", g.Ready(context.Background()))
		}
		time.Sleep(20 * time.Millisecond)
	}
	e1.publish(amqp.Publishing{MessageId: "one", Body: []byte("x")})
	e2.publish(amqp.Publishing{MessageId: "two", Body: []byte("x")})
	rec.waitFor(t, 10*time.Second, "both queues' messages completed", func(evs []amqpidem.Event) bool {
		got := map[string]bool{}
		for _, ev := range evs {
			if ev.Outcome == amqpidem.Completed {
				got[ev.Queue] = true
			}
		}
		return got[e1.queue] && got[e2.queue]
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := g.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if err := <-done; !errors.Is(err, amqpidem.ErrGroupClosed) {
		t.Fatalf("Run: got %v, want ErrGroupClosed", err)
	}
	if err := g.Ready(context.Background()); !errors.Is(err, amqpidem.ErrNotReady) || !strings.Contains(err.Error(), e2.queue) {
		t.Fatalf("Ready after Shutdown: %v", err)
	}
	waitGoroutines(t, baseline)
}

// TestGroupOneFails: a consumer that the broker refuses (wrong password)
// ends the Group's Run with its error, after the other was shut down.
func TestGroupOneFails(t *testing.T) {
	e1, e2 := newEnv(t, nil), newEnv(t, nil)
	ok := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) { return nil, nil })
	good, err := amqpidem.NewConsumer(e1.store, amqpidem.ConsumerConfig{URL: e1.url, Config: amqpidem.Config{Queue: e1.queue}}, ok)
	if err != nil {
		t.Fatal(err)
	}
	badURL := strings.Replace(e2.url, "guest:guest@", "guest:wrong@", 1)
	if badURL == e2.url {
		t.Skipf("AMQP URL %q has no guest:guest to spoil", e2.url)
	}
	bad, err := amqpidem.NewConsumer(e2.store, amqpidem.ConsumerConfig{URL: badURL, Config: amqpidem.Config{Queue: e2.queue}}, ok)
	if err != nil {
		t.Fatal(err)
	}
	g := amqpidem.NewGroup(good, bad)
	done := make(chan error, 1)
	go func() { done <- g.Run(context.Background()) }()
	select {
	case err := <-done:
		var aerr *amqp.Error
		if !errors.As(err, &aerr) || aerr.Code != amqp.AccessRefused {
			t.Fatalf("Run: got %v, want the broker's ACCESS_REFUSED", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Run did not return")
	}
	if err := good.Ready(context.Background()); !errors.Is(err, amqpidem.ErrNotReady) {
		t.Fatalf("the other consumer still ready: %v", err)
	}
}
