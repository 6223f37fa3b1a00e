package console_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/console"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// TestConsoleUnpublished: the unpublished records of an endpoint are the
// completed ones whose staged messages a real consumer could not publish
// (returned: no queue takes them), with their counts; completed records
// without staged messages, and others, are not shown.
func TestConsoleUnpublished(t *testing.T) {
	url := testenv.AMQPURL(t)
	queue := testenv.Name(t)
	store, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: "console-" + queue})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	testenv.DeleteQueues(t, url, queue, queue+".dlq")
	events := make(chan amqpidem.Event, 100)
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{URL: url, Config: amqpidem.Config{Queue: queue, MaxAttempts: 1,
		Logger:   slog.New(slog.DiscardHandler),
		Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { events <- e })}},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			if strings.HasPrefix(d.MessageId, "stage-") {
				// No queue is bound to take it: the broker returns it.
				if err := amqpidem.Stage(ctx, "", queue+".nowhere", amqp.Publishing{MessageId: "out-" + d.MessageId, Body: []byte("x")}); err != nil {
					return nil, err
				}
			}
			return []byte("ok"), nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	pub := amqpidem.NewPublisher(conn)
	t.Cleanup(pub.Close)
	keys := []string{"stage-1", "stage-2", "plain-1", "plain-2", "plain-3"}
	for _, k := range keys {
		if err := pub.Publish(context.Background(), "", queue, amqp.Publishing{MessageId: k, Body: []byte("pay")}); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.After(60 * time.Second)
	for done := 0; done < len(keys); {
		select {
		case e := <-events:
			// A staged message the broker returns is given up after
			// MaxAttempts tries, and its record says returned.
			if (e.Outcome == amqpidem.Completed && !strings.HasPrefix(e.Key, "stage-")) || e.Outbox.Returned > 0 {
				done++
			}
		case <-deadline:
			t.Fatalf("%d of %d messages completed (or their staged message returned) in 60 s", done, len(keys))
		}
	}
	srv := serve(t, nil, console.Config{Admin: store})
	var all strings.Builder
	seen := listPages(t, func(path string) string {
		p := get(t, srv, path, http.StatusOK)
		all.WriteString(p)
		return p
	}, "/records?endpoint="+queue+"&state=unpublished", 500)
	if len(seen) != 2 || seen["stage-1"] != 1 || seen["stage-2"] != 1 {
		t.Fatalf("unpublished records shown: %v, want stage-1 and stage-2 once each", seen)
	}
	mustContain(t, "unpublished pages", all.String(), "1 returned", "staged, not published", "outbox redrive")
}
