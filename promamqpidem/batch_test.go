package promamqpidem_test

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// ObserveBatch records a batch's size, duration and handler calls, also
// through Observers.
func TestObserveBatch(t *testing.T) {
	m := promamqpidem.New(promamqpidem.Options{})
	o := amqpidem.Observers(nil, m).(amqpidem.BatchObserver)
	ctx := context.Background()
	o.ObserveBatch(ctx, amqpidem.BatchInfo{Queue: q, Size: 100, Runs: 1, Duration: 20 * time.Millisecond})
	o.ObserveBatch(ctx, amqpidem.BatchInfo{Queue: q, Size: 7, Runs: 5, Duration: 30 * time.Millisecond})
	size := series(t, m, "amqpidem_batch_size", "queue", q).GetHistogram()
	if got, want := fmt.Sprint(size.GetSampleCount(), size.GetSampleSum()), "2 107"; got != want {
		t.Errorf("batch_size count and sum: got %s, want %s", got, want)
	}
	for _, b := range size.GetBucket() {
		if b.GetUpperBound() == 10 && b.GetCumulativeCount() != 1 {
			t.Errorf("batch_size bucket le=10: got %d, want 1", b.GetCumulativeCount())
		}
	}
	d := series(t, m, "amqpidem_batch_duration_seconds", "queue", q).GetHistogram()
	if got, want := d.GetSampleSum(), 0.05; d.GetSampleCount() != 2 || math.Abs(got-want) > 1e-9 {
		t.Errorf("batch_duration_seconds: got count %d sum %v, want 2 and %v", d.GetSampleCount(), got, want)
	}
	if got, want := value(t, m, "amqpidem_batch_handler_runs_total", "queue", q), 6.0; got != want {
		t.Errorf("batch_handler_runs_total: got %v, want %v", got, want)
	}
	lint(t, m)
}

// The batch metrics of a real batch consumer: its batches' sizes add up
// to the messages it ran, one handler call each.
func TestBatchConsumer(t *testing.T) {
	url := testenv.AMQPURL(t)
	rdb := testenv.RedisClient(t)
	name := testenv.Name(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	testenv.DeleteQueues(t, url, name, name+".dlq")
	testenv.DeleteKeys(t, rdb, name+"*")
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: name})
	if err != nil {
		t.Fatal(err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	const n = 30
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for i := range n {
		if err := ch.PublishWithContext(ctx, "", name, false, false, amqp.Publishing{MessageId: fmt.Sprint("m", i)}); err != nil {
			t.Fatal(err)
		}
	}
	m := promamqpidem.New(promamqpidem.Options{})
	c, err := amqpidem.NewBatchConsumer(store, amqpidem.ConsumerConfig{
		URL: url, BatchSize: 10,
		Config: amqpidem.Config{Queue: name, Observer: m, Logger: slog.New(slog.DiscardHandler)},
	}, amqpidem.BatchHandlerFunc(func(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
		return nil, nil
	}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	for value(t, m, "amqpidem_messages_total", "queue", name, "outcome", "completed", "reason", "") != n {
		select {
		case <-ctx.Done():
			t.Fatal("messages not all completed")
		case <-time.After(10 * time.Millisecond):
		}
	}
	size := series(t, m, "amqpidem_batch_size", "queue", name).GetHistogram()
	if got, want := size.GetSampleSum(), float64(n); got != want {
		t.Errorf("batch_size sum: got %v, want %v", got, want)
	}
	if size.GetSampleCount() < n/10 {
		t.Errorf("batch_size count: got %d, want at least %d (batches of at most 10)", size.GetSampleCount(), n/10)
	}
	if got, want := value(t, m, "amqpidem_batch_handler_runs_total", "queue", name), float64(size.GetSampleCount()); got != want {
		t.Errorf("batch_handler_runs_total: got %v, want one per batch, %v", got, want)
	}
	if got, want := series(t, m, "amqpidem_batch_duration_seconds", "queue", name).GetHistogram().GetSampleCount(), size.GetSampleCount(); got != want {
		t.Errorf("batch_duration_seconds count: got %d, want %d", got, want)
	}
}
