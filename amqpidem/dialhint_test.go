package amqpidem

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// notAMQP listens on a loopback port that is not an AMQP listener: it
// answers every connection with reply (nothing when empty) and closes it,
// as a mistyped port's server does (PostgreSQL's closes, an HTTP server
// answers 400). It stops with the test.
func notAMQP(t *testing.T, reply string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.SetDeadline(time.Now().Add(time.Second))
			_, _ = c.Read(make([]byte, 64))
			_, _ = c.Write([]byte(reply))
			c.Close()
		}
	}()
	return ln.Addr().String()
}

// A Consumer whose URL names a port that is not RabbitMQ's AMQP listener
// keeps retrying (a broker starting up answers the same way for a
// moment), and its log says what to check rather than amqp091-go's bare
// "Exception (501) EOF" or "tls: first record does not look like a TLS
// handshake".
func TestDialWrongPortSaysWhatToCheck(t *testing.T) {
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, scheme, reply, says string
	}{
		{"closes", "amqp", "", "RabbitMQ AMQP listener"},
		{"answers HTTP", "amqp", "HTTP/1.1 400 Bad Request\r\n\r\n", "RabbitMQ AMQP listener"},
		{"amqps on a plain port", "amqps", "AMQP\x00\x00\x09\x01", "amqps:// URL on a plain AMQP port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs testenv.SyncBuffer
			url := tc.scheme + "://guest:guest@" + notAMQP(t, tc.reply) + "/"
			c, err := NewConsumer(mem, ConsumerConfig{URL: url, Config: Config{Queue: "dial-hint",
				Logger: slog.New(slog.NewTextHandler(&logs, nil))}},
				HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil }))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
			defer cancel()
			runErr := c.Run(ctx)
			if !strings.Contains(logs.String(), tc.says) || strings.Count(logs.String(), "cannot consume; retrying") < 2 {
				t.Fatalf("want retries whose log says %q; Run: %v; log:\n%s", tc.says, runErr, logs.String())
			}
			if runErr == nil || !strings.Contains(runErr.Error(), tc.says) {
				t.Errorf("Run: %v, want the last attempt's error saying %q", runErr, tc.says)
			}
		})
	}
}

// A Publisher dialling a port that is not RabbitMQ's AMQP listener says
// what to check in Publish's error, as a Consumer does in its log.
func TestPublisherDialWrongPortSaysWhatToCheck(t *testing.T) {
	addr := notAMQP(t, "")
	p := DialPublisher(func() (*amqp.Connection, error) { return amqp.Dial("amqp://guest:guest@" + addr + "/") },
		slog.New(slog.DiscardHandler))
	t.Cleanup(p.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	err := p.Publish(ctx, "", "dial-hint", amqp.Publishing{MessageId: "m1", Body: []byte("x")})
	if err == nil || !strings.Contains(err.Error(), "RabbitMQ AMQP listener") {
		t.Fatalf("Publish: %v, want an error saying to check the port", err)
	}
}
