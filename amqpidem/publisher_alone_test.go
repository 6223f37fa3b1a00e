package amqpidem

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// TestPublishWithoutMessageIDAlone publishes 120 messages without a
// MessageId at once (as amqpidem's copies of a delivery that had none),
// every fourth to a routing key no queue is bound to: a return cannot be
// told apart by id among them, so each has a channel to itself, and each
// returned one, and only those, fails with ErrUnroutable. Let share a
// channel (without the alone rule and the check that no two publishes in
// flight on a channel share an id), a return goes to another publish.
func TestPublishWithoutMessageIDAlone(t *testing.T) {
	conn, err := amqp.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q := testenv.Name(t)
	if _, err := ch.QueueDeclare(q, false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = ch.QueueDelete(q, false, false, false) }()
	p := newPublisher(conn, queueClassic)
	defer p.close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const n = 120
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := q
			if i%4 == 0 {
				key = q + ".unbound"
			}
			errs[i] = p.publish(ctx, "", key, amqp.Publishing{Body: []byte("x")})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if want := i%4 == 0; errors.Is(err, ErrUnroutable) != want || (!want && err != nil) {
			t.Errorf("publish %d (unroutable %v): %v", i, want, err)
		}
	}
}
