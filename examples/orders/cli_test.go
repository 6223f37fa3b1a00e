package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// decliningBank declines every charge while declining is set, like a card
// processor that refuses a card until the customer's bank unblocks it.
type decliningBank struct {
	declining atomic.Bool
	mu        sync.Mutex
	charged   map[string]int
}

func (b *decliningBank) Charge(ctx context.Context, p payment, fence int64) (string, error) {
	if b.declining.Load() {
		return "", errDeclined
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.charged[p.ID]++
	return fmt.Sprintf("rcpt-%s-%d", p.ID, fence), nil
}

// A payment this example's handler dead-letters (a declined card) is
// listed by the amqpidem command, replayed once the cause is fixed, and
// charged once.
func TestDeclinedPaymentReplayedWithCLI(t *testing.T) {
	redisAddr, url := testenv.RedisAddr(t), testenv.AMQPURL(t)
	queue := testenv.Name(t)
	prefix := "orders-" + queue
	t.Setenv("AMQPIDEM_SIGNING_KEY", "orders-example-signing-key") // the consumer's and the CLI's
	bin := filepath.Join(t.TempDir(), "amqpidem")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/amqpidem/amqpidem/cmd/amqpidem").CombinedOutput(); err != nil {
		t.Fatalf("building cmd/amqpidem: %v\n%s", err, out)
	}
	cli := func(want int, args ...string) string {
		t.Helper()
		args = append(args, "--redis", "redis://"+redisAddr, "--amqp", url, "--prefix", prefix)
		out, err := exec.Command(bin, args...).CombinedOutput()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != want {
			t.Fatalf("amqpidem %s: exit %d, want %d\n%s", strings.Join(args, " "), code, want, out)
		}
		return string(out)
	}

	store, err := lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	bank := &decliningBank{charged: map[string]int{}}
	bank.declining.Store(true)
	dead := make(chan string, 10)
	cfg := config(queue, slog.New(slog.DiscardHandler))
	cfg.Observer = amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) {
		if e.Outcome == amqpidem.DeadLettered || e.Outcome == amqpidem.Completed {
			dead <- e.Outcome.String() + " " + e.Key
		}
	})
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{URL: url, Config: cfg}, chargeHandler(bank))
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			for _, q := range []string{queue, queue + ".dlq"} {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
		}
		conn.Close()
	})
	testrun.Consumer(t, c) // shut down before the queues are deleted
	pub := amqpidem.NewPublisher(conn)
	defer pub.Close()
	body, _ := json.Marshal(payment{ID: "pay-77", Amount: 1250})
	// The consumer declares the queue when it starts; publish once it exists.
	deadline := time.Now().Add(15 * time.Second)
	for {
		err := pub.Publish(context.Background(), "", queue, amqp.Publishing{MessageId: "pay-77", Body: body})
		if err == nil {
			break
		}
		if !errors.Is(err, amqpidem.ErrUnroutable) || time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	wait := func(want string) {
		t.Helper()
		select {
		case got := <-dead:
			if got != want {
				t.Fatalf("got %q, want %q", got, want)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("no %q in 30s", want)
		}
	}
	wait("dead_lettered pay-77")

	out := cli(0, "dlq", "list", queue)
	if !strings.Contains(out, "pay-77") || !strings.Contains(out, "permanent failure") || !strings.Contains(out, "card declined") {
		t.Fatalf("dlq list:\n%s", out)
	}
	bank.declining.Store(false) // the card works again
	cli(0, "dlq", "replay", queue, "--key", "pay-77", "--forget")
	wait("completed pay-77")
	if out := cli(0, "inspect", "pay-77", "--queue", queue); !strings.Contains(out, "completed") || !strings.Contains(out, "rcpt-pay-77") {
		t.Fatalf("inspect:\n%s", out)
	}
	bank.mu.Lock()
	defer bank.mu.Unlock()
	if n := bank.charged["pay-77"]; n != 1 {
		t.Fatalf("pay-77 charged %d times, want once", n)
	}
}
