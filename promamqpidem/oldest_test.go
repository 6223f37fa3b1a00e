package promamqpidem_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// oldestName is the gauge of the oldest running handler's age.
const oldestName = "amqpidem_oldest_handler_age_seconds"

// TestOldestHandlerAge: the gauge is the age of the oldest handler still
// running on each queue (each handler known by the context its hooks get),
// 0 once none runs.
func TestOldestHandlerAge(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	now := time.Unix(1_000_000, 0)
	promamqpidem.SetClock(m, func() time.Time { return now })
	a1, a2 := context.WithValue(context.Background(), q, 1), context.WithValue(context.Background(), q, 2)
	b := context.WithValue(context.Background(), q, 3)
	ia, ib := amqpidem.Info{Queue: "a", Key: "k", Fence: 1}, amqpidem.Info{Queue: "b"}

	m.HandlerStarted(a1, ia)
	now = now.Add(10 * time.Second)
	m.HandlerStarted(a2, ia) // the same Info: told apart by their contexts
	m.HandlerStarted(b, ib)
	now = now.Add(5 * time.Second)
	for _, c := range []struct {
		queue string
		want  float64
	}{{"a", 15}, {"b", 5}} {
		if got := value(t, m, oldestName, "queue", c.queue); got != c.want {
			t.Errorf("oldest on %s: got %v, want %v", c.queue, got, c.want)
		}
	}
	m.HandlerEnded(a1, ia)
	if got, want := value(t, m, oldestName, "queue", "a"), 5.0; got != want {
		t.Errorf("oldest on a after the first ended: got %v, want %v", got, want)
	}
	m.HandlerEnded(a2, ia)
	m.HandlerEnded(b, ib)
	for _, queue := range []string{"a", "b"} {
		if s := series(t, m, oldestName, "queue", queue); s == nil || s.GetGauge().GetValue() != 0 {
			t.Errorf("oldest on %s with none running: got %v, want 0", queue, s)
		}
	}
	// Hooks given one context twice (as a caller of its own may): the
	// entry lasts until both ended.
	ctx := context.Background()
	m.HandlerStarted(ctx, ia)
	now = now.Add(time.Second)
	m.HandlerStarted(ctx, ia)
	m.HandlerEnded(ctx, ia)
	if got, want := value(t, m, oldestName, "queue", "a"), 1.0; got != want {
		t.Errorf("oldest on a, one context started twice, ended once: got %v, want %v", got, want)
	}
	m.HandlerEnded(ctx, ia)
	if got, want := value(t, m, oldestName, "queue", "a"), 0.0; got != want {
		t.Errorf("oldest on a, one context started and ended twice: got %v, want %v", got, want)
	}
	lint(t, m)
}

// TestConsumerOldestHandler: a real consumer's handler that does not
// return shows as a growing oldest_handler_age_seconds on its queue, which
// reads 0 again once it returned.
func TestConsumerOldestHandler(t *testing.T) {
	url := testenv.AMQPURL(t)
	rdb := testenv.RedisClient(t)
	name := testenv.Name(t)
	testenv.DeleteQueues(t, url, name, name+".dlq")
	testenv.DeleteKeys(t, rdb, name+"*")
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: name})
	if err != nil {
		t.Fatal(err)
	}
	m := promamqpidem.New(promamqpidem.Options{})
	started, release := make(chan struct{}), make(chan struct{})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
		URL: url,
		Config: amqpidem.Config{Queue: name, Observer: m, Retention: time.Minute,
			Logger: slog.New(slog.NewTextHandler(t.Output(), nil))},
	}, amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		close(started)
		<-release
		return nil, nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	for c.Ready(ctx) != nil {
		select {
		case <-ctx.Done():
			t.Fatalf("consumer not ready: %v", c.Ready(context.Background()))
		case <-time.After(10 * time.Millisecond):
		}
	}
	pub := amqpidem.NewPublisher(conn)
	defer pub.Close()
	if err := pub.Publish(ctx, "", name, amqp.Publishing{MessageId: "k1", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the handler did not start")
	}
	time.Sleep(300 * time.Millisecond)
	if got := value(t, m, oldestName, "queue", name); got < 0.3 || got > 10 {
		t.Errorf("oldest handler's age while it runs: got %v, want 0.3 s to 10 s", got)
	}
	close(release)
	for {
		if value(t, m, "amqpidem_handlers_in_flight", "queue", name) == 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the handler did not end")
		case <-time.After(10 * time.Millisecond):
		}
	}
	if s := series(t, m, oldestName, "queue", name); s == nil || s.GetGauge().GetValue() != 0 {
		t.Errorf("oldest handler's age once it returned: got %v, want 0", s)
	}
}
