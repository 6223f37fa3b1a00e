package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// htrialCheckedStore is the RedisStore whose Check, when Run calls it,
// closes done once it has returned.
type htrialCheckedStore struct {
	*lock.RedisStore
	done chan struct{}
}

func (s *htrialCheckedStore) Check(ctx context.Context) error {
	defer close(s.done)
	return s.RedisStore.Check(ctx)
}

// TestHtrialEvictionWarnedOnce: the README's quick start calls
// store.Check (to fail fast), then Run, which checks the store again in
// the background: a Redis whose maxmemory-policy may evict records must
// be warned about once, not once per check, or an operator sees the same
// warning twice per consumer at every start (and N+1 times for a Group of
// N consumers) and learns to ignore it.
func TestHtrialEvictionWarnedOnce(t *testing.T) {
	srv := testenv.RedisServer(t, "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
	var logs lockedBuffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	store, err := lock.NewRedisStore(srv.Client(t), lock.Config{Prefix: "htrial-checkwarn", Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := store.Check(ctx); err != nil { // as the README's quick start does
		t.Fatal(err)
	}
	queue := fmt.Sprintf("htrial-checkwarn-%d", time.Now().UnixNano())
	url := testenv.AMQPURL(t)
	t.Cleanup(func() {
		conn, err := amqp.Dial(url)
		if err != nil {
			return
		}
		defer conn.Close()
		for _, q := range []string{queue, queue + ".dlq"} {
			if ch, err := conn.Channel(); err == nil {
				_, _ = ch.QueueDelete(q, false, false, false)
				ch.Close()
			}
		}
	})
	checked := &htrialCheckedStore{RedisStore: store, done: make(chan struct{})}
	c, err := amqpidem.NewConsumer(checked, amqpidem.ConsumerConfig{
		URL:    url,
		Config: amqpidem.Config{Queue: queue, Logger: logger},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) { return nil, nil }))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for c.Ready(ctx) != nil {
		if time.Now().After(deadline) {
			t.Fatal("the consumer never got ready")
		}
		time.Sleep(20 * time.Millisecond)
	}
	select { // Run's own background check has ended: shutting down cannot cut it short
	case <-checked.done:
	case <-time.After(30 * time.Second):
		t.Fatal("Run never checked the store")
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := c.Shutdown(sctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
		t.Fatalf("Run returned %v", err)
	}
	if n := strings.Count(logs.String(), "maxmemory-policy is not noeviction"); n != 1 {
		t.Errorf("the eviction warning was logged %d times, want once:\n%s", n, logs.String())
	}
}
