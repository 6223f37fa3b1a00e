package amqpidem_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// lockedBuffer is a bytes.Buffer a logger and the test share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestMalformedURLFailsFastWithoutPassword: a ConsumerConfig.URL whose
// password has an unescaped '%', '#', '/' or '?' can never parse: Run
// ends at once with an error naming the URL redacted, and neither the
// error nor the log quotes any of the password (amqp091-go's parse error
// quotes the URL, or the piece after the ':' of the password).
func TestMalformedURLFailsFastWithoutPassword(t *testing.T) {
	for _, pass := range []string{"p%zz", "p#ss", "p/ss", "p?ss"} {
		t.Run(pass, func(t *testing.T) {
			var logs lockedBuffer
			log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
			url := "amqp://guest:" + pass + "@127.0.0.1:5672/"
			c, err := amqpidem.NewConsumer(newMemStore(t), amqpidem.ConsumerConfig{URL: url,
				Config: amqpidem.Config{Queue: "secret-test", Logger: log}}, amqpidem.HandlerFunc(connNoop))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			start := time.Now()
			err = c.Run(ctx)
			took := time.Since(start)
			t.Logf("Run after %v: %v", took.Round(time.Millisecond), err)
			if err == nil {
				t.Fatalf("Run after %v returned nil", took)
			}
			if errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Run after %v: %v, want the malformed URL's error at once", took, err)
			}
			if took > time.Second {
				t.Errorf("Run took %v to give up on a URL that cannot parse", took)
			}
			leaks := func(s string) bool {
				return strings.Contains(s, pass) || strings.Contains(s, `":p"`) || strings.Contains(s, `"%zz"`)
			}
			if leaks(err.Error()) {
				t.Errorf("Run's error quotes the password: %v", err)
			}
			if !strings.Contains(err.Error(), "amqp://guest:xxxxx@127.0.0.1:5672/") {
				t.Errorf("Run's error does not name the URL redacted: %v", err)
			}
			if leaks(logs.String()) {
				t.Errorf("the log quotes the password:\n%s", logs.String())
			}
		})
	}
}

// TestDialParseErrorLoggedWithoutPassword: a ConsumerConfig.Dial that
// dials a URL that does not parse returns amqp091-go's parse error, which
// quotes the URL (or the password's start): the consumer retries (the
// Dial may build another URL next time) but logs and returns none of it.
func TestDialParseErrorLoggedWithoutPassword(t *testing.T) {
	for _, pass := range []string{"p%zz", "p#ss", "p/ss"} {
		t.Run(pass, func(t *testing.T) {
			var logs lockedBuffer
			log := slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
			url := "amqp://guest:" + pass + "@127.0.0.1:5672/"
			c, err := amqpidem.NewConsumer(newMemStore(t), amqpidem.ConsumerConfig{
				Dial:   func() (*amqp.Connection, error) { return amqp.Dial(url) },
				Config: amqpidem.Config{Queue: "secret-test", Logger: log}}, amqpidem.HandlerFunc(connNoop))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
			defer cancel()
			err = c.Run(ctx)
			t.Logf("Run: %v", err)
			out := logs.String()
			if !strings.Contains(out, "retrying") {
				t.Errorf("no retry logged:\n%s", out)
			}
			if strings.Contains(out, pass) || strings.Contains(out, `":p"`) || strings.Contains(out, `guest:p`) {
				t.Errorf("the log quotes the password:\n%s", out)
			}
		})
	}
}

// TestPublisherDialParseErrorHidesPassword: a DialPublisher whose dial
// fails to parse its URL returns Publish errors that quote none of it.
func TestPublisherDialParseErrorHidesPassword(t *testing.T) {
	for _, pass := range []string{"p%zz", "p#ss", "p/ss"} {
		url := "amqp://guest:" + pass + "@127.0.0.1:5672/"
		var logs lockedBuffer
		p := amqpidem.DialPublisher(func() (*amqp.Connection, error) { return amqp.Dial(url) },
			slog.New(slog.NewTextHandler(&logs, nil)))
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := p.Publish(ctx, "", "q", amqp.Publishing{MessageId: "k", Body: []byte("x")})
		cancel()
		p.Close()
		t.Logf("%s: Publish: %v", pass, err)
		if err == nil {
			t.Fatalf("%s: Publish succeeded", pass)
		}
		if msg := err.Error() + logs.String(); strings.Contains(msg, pass) || strings.Contains(msg, `":p"`) || strings.Contains(msg, "guest:p") {
			t.Errorf("%s: quotes the password: %s", pass, msg)
		}
	}
}
