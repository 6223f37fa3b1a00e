package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// A delay queue deleted by someone while the consumer still has it down as
// declared is declared again by the next requeue to it, and the copy waits
// its delay there. Before, the copy came back unroutable, was held in
// process for UnavailableDelay at most and sent straight back: a 1.5 s
// backoff became 100 ms, and attempts burnt early.
func TestConsumerRedeclaresDeletedDelayQueue(t *testing.T) {
	e := newEnv(t, nil)
	const delay = 1500 * time.Millisecond
	delayQ := fmt.Sprintf("%s.delay.%d", e.queue, delay.Milliseconds())
	t.Cleanup(func() { deleteQueues(e, delayQ) })
	var mu sync.Mutex
	var starts, ends []time.Time
	second := make(chan struct{})
	goOn := make(chan struct{})
	startConsumer(t, e, amqpidem.ConsumerConfig{Config: amqpidem.Config{
		MaxAttempts:      5,
		UnavailableDelay: 100 * time.Millisecond,
		Backoff:          func() backoff.BackOff { return backoff.NewConstantBackOff(delay) },
	}}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		mu.Lock()
		starts = append(starts, time.Now())
		n := len(starts)
		mu.Unlock()
		if n == 2 {
			close(second)
			select { // the test deletes the delay queue meanwhile
			case <-goOn:
			case <-ctx.Done():
			}
		}
		mu.Lock()
		ends = append(ends, time.Now())
		mu.Unlock()
		if n < 3 {
			return nil, errors.New("not yet")
		}
		return []byte("ok"), nil
	}))
	e.publish(amqp.Publishing{MessageId: "m", Body: []byte("x")})
	select {
	case <-second:
	case <-time.After(15 * time.Second):
		t.Fatal("no second attempt")
	}
	if _, err := e.ch.QueueDelete(delayQ, false, false, false); err != nil {
		t.Fatalf("deleting %s: %v", delayQ, err)
	}
	close(goOn)
	eventually(t, 15*time.Second, "a third attempt", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(starts) >= 3
	})
	mu.Lock()
	waited := starts[2].Sub(ends[1])
	mu.Unlock()
	if waited < delay-100*time.Millisecond {
		t.Fatalf("the retry after the delay queue was deleted came %v after the failure, want about %v", waited.Round(time.Millisecond), delay)
	}
	if _, err := e.ch.QueueDeclarePassive(delayQ, true, false, false, false, nil); err != nil {
		t.Fatalf("the delay queue was not declared again: %v", err)
	}
}
