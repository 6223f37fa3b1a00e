package testenv_test

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

func TestRedisClient(t *testing.T) {
	ctx := context.Background()
	rdb := testenv.RedisClient(t)
	key := testenv.Name(t)
	t.Cleanup(func() { rdb.Del(context.Background(), key) })

	if err := rdb.Set(ctx, key, "v", time.Minute).Err(); err != nil {
		t.Fatalf("SET %s: %v", key, err)
	}
	got, err := rdb.Get(ctx, key).Result()
	if err != nil {
		t.Fatalf("GET %s: %v", key, err)
	}
	if want := "v"; got != want {
		t.Fatalf("GET %s: got %q, want %q", key, got, want)
	}
	if got, want := testenv.RedisAddr(t), rdb.Options().Addr; got != want {
		t.Fatalf("RedisAddr: got %q, want the client's %q", got, want)
	}
}

func TestAMQPURL(t *testing.T) {
	conn, err := amqp.Dial(testenv.AMQPURL(t))
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatalf("channel: %v", err)
	}
	q, err := ch.QueueDeclare(testenv.Name(t), false, true, true, false, nil)
	if err != nil {
		t.Fatalf("declare: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ch.PublishWithContext(ctx, "", q.Name, false, false, amqp.Publishing{Body: []byte("hello")}); err != nil {
		t.Fatalf("publish: %v", err)
	}
	for {
		d, ok, err := ch.Get(q.Name, true)
		if err != nil {
			t.Fatalf("get: %v", err)
		}
		if ok {
			if got, want := string(d.Body), "hello"; got != want {
				t.Fatalf("body: got %q, want %q", got, want)
			}
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("no message on %s: %v", q.Name, ctx.Err())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestName(t *testing.T) {
	valid := regexp.MustCompile(`^[A-Za-z0-9._-]+-[0-9a-f]{8}$`)
	tests := []struct {
		sub        string
		wantPrefix string
	}{
		{"plain", "TestName_plain-"},
		{"with space and {tag}:colon", "TestName_with_space_and_tag_colon-"},
		{"unicode ✓ ok", "TestName_unicode_ok-"},
		{strings.Repeat("x", 100), "TestName_" + strings.Repeat("x", 31) + "-"},
	}
	for _, tt := range tests {
		t.Run(tt.sub, func(t *testing.T) {
			a, b := testenv.Name(t), testenv.Name(t)
			if a == b {
				t.Fatalf("Name twice: got %q both times, want different names", a)
			}
			if !valid.MatchString(a) {
				t.Fatalf("Name: got %q, want it to match %s", a, valid)
			}
			if !strings.HasPrefix(a, tt.wantPrefix) {
				t.Fatalf("Name: got %q, want prefix %q", a, tt.wantPrefix)
			}
			if got, max := len(a), 49; got > max {
				t.Fatalf("len(Name): got %d, want at most %d", got, max)
			}
		})
	}
}
