package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// fanout binds two fresh queues to a fresh fanout exchange and returns
// the exchange and the queues' names.
func fanout(t *testing.T, e *env) (string, [2]string) {
	t.Helper()
	exchange := e.queue + ".fanout"
	if err := e.ch.ExchangeDeclare(exchange, "fanout", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	var queues [2]string
	for i := range queues {
		queues[i] = fmt.Sprintf("%s.%c", e.queue, 'a'+i)
		if _, err := e.ch.QueueDeclare(queues[i], false, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := e.ch.QueueBind(queues[i], "", exchange, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	return exchange, queues
}

// runOn runs a Consumer of queue, declared already, on e's store until the
// test ends.
func runOn(t *testing.T, e *env, queue string, cfg amqpidem.Config, h amqpidem.Handler) {
	t.Helper()
	cfg.Queue = queue
	startConsumer(t, e, amqpidem.ConsumerConfig{Config: cfg, Declare: func(*amqp.Channel) error { return nil }}, h)
}

// Records belong to the consuming endpoint: an event fanned out to two
// queues, consumed through one store, runs once on each queue. With one
// Endpoint set explicitly on both, it runs once in all.
func TestRecordsScopedPerQueue(t *testing.T) {
	const events = 200
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprint("shared endpoint=", shared), func(t *testing.T) {
			e := newEnv(t, nil)
			exchange, queues := fanout(t, e)
			var r [2]runs
			var rec recorder
			for i, q := range queues {
				// A copy that finds the other queue's consumer holding the
				// shared key waits at most a second, not the lease's 30s.
				cfg := amqpidem.Config{Observer: &rec, InProgressDelay: time.Second}
				if shared {
					cfg.Endpoint = e.queue + ".inbox"
				}
				i := i
				runOn(t, e, q, cfg, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
					r[i].add(d.MessageId)
					return nil, nil
				}))
			}
			for n := range events {
				if err := e.ch.PublishWithContext(context.Background(), exchange, "", false, false,
					amqp.Publishing{MessageId: fmt.Sprint("ev-", n), Body: []byte("x")}); err != nil {
					t.Fatal(err)
				}
			}
			rec.waitFor(t, 30*time.Second, "every copy settled", func(evs []amqpidem.Event) bool {
				settled := 0
				for _, ev := range evs {
					if ev.Outcome == amqpidem.Completed || ev.Outcome == amqpidem.Duplicate {
						settled++
					}
				}
				return settled == 2*events
			})
			for n := range events {
				key := fmt.Sprint("ev-", n)
				a, b := r[0].get(key), r[1].get(key)
				if shared && a+b != 1 || !shared && (a != 1 || b != 1) {
					t.Fatalf("%s ran %d times on %s and %d on %s", key, a, queues[0], b, queues[1])
				}
			}
		})
	}
}

// keeperGoroutines counts the goroutines of heartbeat keepers.
func keeperGoroutines() int {
	buf := make([]byte, 4<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "heartbeat.(*Keeper)")
}

// waitKeepers fails unless the keepers' goroutines come back to n.
func waitKeepers(t *testing.T, n int, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for keeperGoroutines() != n {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d keeper goroutines, want %d", what, keeperGoroutines(), n)
		}
		runtime.GC()
		time.Sleep(20 * time.Millisecond)
	}
}

// A Consumer whose Run ends through its context, without Shutdown, and a
// Wrapper dropped without Shutdown leave no keeper goroutine behind.
func TestNoKeeperLeftBehind(t *testing.T) {
	e := newEnv(t, nil)
	before := keeperGoroutines()

	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{URL: e.url, Config: amqpidem.Config{Queue: e.queue}},
		amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	e.publish(amqp.Publishing{MessageId: "m", Body: []byte("x")})
	time.Sleep(200 * time.Millisecond)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run: %v", err)
	}
	waitKeepers(t, before, "Run ended by its context")
	runtime.KeepAlive(c) // Run's end stops the keeper, not the garbage collector

	func() {
		w, err := amqpidem.Wrap(e.conn, e.store, amqpidem.Config{Queue: e.queue},
			amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }))
		if err != nil {
			t.Fatal(err)
		}
		_ = w
	}()
	waitKeepers(t, before, "Wrapper dropped")
}
