package amqpidem_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// Redis down: deliveries are requeued with a delay (fail closed) and run
// once Redis is back.
func TestStoreUnavailableFailsClosed(t *testing.T) {
	e := newEnv(t, nil)
	srv := testenv.RedisServer(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: 1, DialTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { client.Close() })
	store, err := lock.NewRedisStore(client, lock.Config{Prefix: e.queue})
	if err != nil {
		t.Fatal(err)
	}
	e.store = store
	var ran runs
	rec := &recorder{}
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Config: amqpidem.Config{Observer: rec, UnavailableDelay: 200 * time.Millisecond},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		ran.add(d.MessageId)
		return nil, nil
	}))

	srv.Stop()
	e.publish(amqp.Publishing{MessageId: "pay-1", Body: []byte("x")})
	rec.waitFor(t, 10*time.Second, "requeued while Redis is down", func(evs []amqpidem.Event) bool {
		return count(evs, "pay-1", amqpidem.Abandoned) >= 2
	})
	if got := ran.get("pay-1"); got != 0 {
		t.Fatalf("handler ran %d times without a store (fail closed)", got)
	}
	srv.Start()
	rec.waitFor(t, 15*time.Second, "completed once Redis is back", func(evs []amqpidem.Event) bool {
		return count(evs, "pay-1", amqpidem.Completed) == 1
	})
	rec.mu.Lock()
	for _, ev := range rec.events {
		if ev.Outcome == amqpidem.Abandoned && (ev.Reason != "store unavailable" || ev.Delay != 200*time.Millisecond) {
			t.Errorf("abandoned event: reason %q delay %v", ev.Reason, ev.Delay)
		}
	}
	rec.mu.Unlock()
	if got := ran.get("pay-1"); got != 1 {
		t.Fatalf("handler ran %d times, want 1", got)
	}
}

// A lease lost while the handler runs (here: the record evicted from
// Redis) cancels the handler within about one heartbeat, discards its
// result and requeues the message, which then runs again.
func TestLeaseLostWhileRunning(t *testing.T) {
	e := newEnv(t, nil)
	rdb := testenv.RedisClient(t)
	var ran runs
	cancelled := make(chan time.Duration, 4)
	rec := &recorder{}
	const ttl = 300 * time.Millisecond
	startConsumer(t, e, amqpidem.ConsumerConfig{
		Config: amqpidem.Config{Observer: rec, LeaseTTL: ttl, InProgressDelay: 100 * time.Millisecond},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		if ran.add(d.MessageId) > 1 {
			return []byte("second run"), nil
		}
		keys, err := rdb.Keys(ctx, e.queue+":*").Result()
		if err != nil || len(keys) != 1 {
			return nil, amqpidem.Permanent(errors.New("record not found"))
		}
		rdb.Del(ctx, keys[0]) // evicted
		start := time.Now()
		select {
		case <-ctx.Done():
			cancelled <- time.Since(start)
			if !errors.Is(context.Cause(ctx), lock.ErrLeaseLost) {
				return nil, amqpidem.Permanent(context.Cause(ctx))
			}
			return []byte("stale"), nil // returns success anyway: must be discarded
		case <-time.After(10 * ttl):
			return nil, amqpidem.Permanent(errors.New("not cancelled"))
		}
	}))
	e.publish(amqp.Publishing{MessageId: "job", Body: []byte("x")})
	rec.waitFor(t, 10*time.Second, "second run completes", func(evs []amqpidem.Event) bool {
		return count(evs, "job", amqpidem.Completed) == 1
	})
	if d := <-cancelled; d > ttl/2 {
		t.Errorf("cancelled %v after the loss, want within one heartbeat (~%v)", d, ttl/3)
	}
	rec.mu.Lock()
	abandoned := count(rec.events, "job", amqpidem.Abandoned)
	rec.mu.Unlock()
	if abandoned != 1 {
		t.Errorf("abandoned events: %d, want 1", abandoned)
	}
	res, err := e.store.Acquire(context.Background(), lock.Request{Key: amqpidem.StoreKey(e.queue, "job")})
	if err != nil || res.Status != lock.Completed || !bytes.HasSuffix(res.Value, []byte("second run")) {
		t.Fatalf("record: %v %q %v", res.Status, res.Value, err)
	}
}
