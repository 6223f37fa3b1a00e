package amqpidem_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// hangServer is a broker node that hangs: it accepts connections and
// never answers.
type hangServer struct{ *testenv.SilentServer }

func newHangServer(t *testing.T) hangServer { return hangServer{testenv.NewSilentServer(t)} }

// url is an AMQP URL of the server.
func (s hangServer) url() string { return "amqp://guest:guest@" + s.Addr() + "/" }

// waitAccepted waits until the server accepted n connections.
func (s hangServer) waitAccepted(t *testing.T, n int) {
	t.Helper()
	eventually(t, 10*time.Second, fmt.Sprintf("%d connections accepted", n), func() bool { return s.Accepted() >= n })
}

// within fails the test unless f returns within d; it returns how long f
// took.
func within(t *testing.T, d time.Duration, what string, f func()) time.Duration {
	t.Helper()
	start := time.Now()
	f()
	took := time.Since(start)
	if took > d {
		t.Errorf("%s took %v, want at most %v", what, took.Round(time.Millisecond), d)
	}
	return took
}

// Shutdown and Run's context are heard while the consuming connection is
// being dialled, by URL (Run's own dial, whose socket is closed then: no
// goroutine is left) and by a Dial of the user's (not waited for: the
// connection, if it comes, is closed).
func TestConsumerStopsWhileDialHangs(t *testing.T) {
	for _, tc := range []struct {
		name     string
		userDial bool
		byCtx    bool
	}{
		{"URL/Shutdown", false, false},
		{"URL/Run's context", false, true},
		{"Dial/Shutdown", true, false},
		{"Dial/Run's context", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := newHangServer(t)
			baseline := runtime.NumGoroutine()
			cfg := amqpidem.ConsumerConfig{Config: amqpidem.Config{Queue: "never-consumed", Logger: slog.New(slog.DiscardHandler)}}
			if tc.userDial {
				cfg.Dial = func() (*amqp.Connection, error) {
					return amqp.DialConfig(srv.url(), amqp.Config{Dial: amqp.DefaultDial(3 * time.Second)})
				}
			} else {
				cfg.URL = srv.url()
			}
			c, err := amqpidem.NewConsumer(newMemStore(t), cfg, amqpidem.HandlerFunc(connNoop))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			srv.waitAccepted(t, 1)
			time.Sleep(100 * time.Millisecond) // well into the handshake's wait
			want := amqpidem.ErrConsumerClosed
			if tc.byCtx {
				cancel()
				want = context.Canceled
			} else {
				sctx, scancel := context.WithTimeout(context.Background(), time.Second)
				defer scancel()
				within(t, 1500*time.Millisecond, "Shutdown with a 1 s deadline while dialling", func() {
					if err := c.Shutdown(sctx); err != nil {
						t.Errorf("Shutdown: %v, want nil (no handler had to be cancelled)", err)
					}
				})
			}
			within(t, 1500*time.Millisecond, "Run's return", func() {
				select {
				case err := <-done:
					if !errors.Is(err, want) {
						t.Errorf("Run: %v, want %v", err, want)
					}
				case <-time.After(40 * time.Second):
					t.Fatal("Run did not return")
				}
			})
			if !tc.userDial {
				waitGoroutines(t, baseline)
			}
			_ = c.Shutdown(context.Background())
		})
	}
}

// A copy that needs the publishing connection while it is being dialled
// waits for it within its settle timeout and, once Shutdown's deadline
// has passed, not at all: the delivery is nacked back to the queue and
// Shutdown returns on time. The publishing connection is dialled outside
// the lock, so that a caller that gives up does not wait for it.
func TestConsumerShutdownWhilePublishingDialHangs(t *testing.T) {
	e := newEnv(t, nil)
	srv := newHangServer(t)
	var dials atomic.Int32
	ran := make(chan struct{}, 8)
	c, err := amqpidem.NewConsumer(e.store, amqpidem.ConsumerConfig{
		Dial: func() (*amqp.Connection, error) {
			if dials.Add(1) == 1 {
				return amqp.Dial(e.url) // the consuming connection
			}
			return amqp.DialConfig(srv.url(), amqp.Config{Dial: amqp.DefaultDial(20 * time.Second)})
		},
		Config: amqpidem.Config{Queue: e.queue, Logger: slog.New(slog.DiscardHandler)},
	}, amqpidem.HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) {
		ran <- struct{}{}
		return nil, errors.New("try again later") // a retry: a copy to publish
	}))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	e.publish(amqp.Publishing{MessageId: "m", Body: []byte("x")})
	select {
	case <-ran:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never ran")
	}
	srv.waitAccepted(t, 1) // the copy waits for the publishing connection
	time.Sleep(200 * time.Millisecond)
	sctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	within(t, 2*time.Second, "Shutdown with a 1 s deadline while the publishing connection is dialled", func() {
		_ = c.Shutdown(sctx)
		select {
		case err := <-done:
			if !errors.Is(err, amqpidem.ErrConsumerClosed) {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(40 * time.Second):
			t.Fatal("Run did not return")
		}
	})
	// The delivery went back to the queue, nacked (no copy could go out).
	m, ok := e.get(e.queue, 5*time.Second)
	if !ok || m.MessageId != "m" {
		t.Fatal("the message is not back in the queue")
	}
}

// Publish gives up at its context while the publishing connection is
// being dialled, and so does a second Publish meanwhile: the dial is made
// outside the lock the callers wait on.
func TestDialPublisherHonoursContextWhileDialling(t *testing.T) {
	srv := newHangServer(t)
	pub := amqpidem.DialPublisher(func() (*amqp.Connection, error) {
		return amqp.DialConfig(srv.url(), amqp.Config{Dial: amqp.DefaultDial(3 * time.Second)})
	}, slog.New(slog.DiscardHandler))
	defer pub.Close()
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			within(t, time.Second, fmt.Sprintf("Publish %d with a 300 ms context while dialling", i), func() {
				if err := pub.Publish(ctx, "", "q", amqp.Publishing{MessageId: "m"}); !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("Publish: %v, want DeadlineExceeded", err)
				}
			})
		}()
	}
	wg.Wait()
}

// newMemStore returns a MemoryStore, for tests that never reach a store.
func newMemStore(t *testing.T) lock.Store {
	t.Helper()
	s, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}
