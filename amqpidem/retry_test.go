package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestRetryDelaySources(t *testing.T) {
	errLimited := errors.New("429")
	errBoom := errors.New("boom")
	var seen []string
	byErr := func(n int, err error, d *amqp.Delivery) time.Duration {
		seen = append(seen, fmt.Sprintf("%d %v %s", n, err, d.MessageId))
		switch {
		case errors.Is(err, errLimited):
			return 7 * time.Second
		case errors.Is(err, errBoom):
			return -1 // no more retries
		}
		return 2 * time.Second
	}
	fails := func(err error) HandlerFunc {
		return func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, err }
	}
	tests := []struct {
		name       string
		cfg        Config
		err        error
		want       Outcome
		wantDelay  time.Duration
		wantReason string
	}{
		{"backoff", Config{Backoff: Constant(3 * time.Second)}, errLimited, Retried, 3 * time.Second, "handler error"},
		{"retry delay by error", Config{Backoff: Constant(3 * time.Second), RetryDelay: byErr}, errLimited, Retried, 7 * time.Second, "handler error"},
		{"retry delay, other error", Config{RetryDelay: byErr}, errors.New("x"), Retried, 2 * time.Second, "handler error"},
		{"retry delay says stop", Config{RetryDelay: byErr}, errBoom, DeadLettered, 0, "attempts exhausted"},
		{"retry after wins", Config{RetryDelay: byErr}, RetryAfter(errLimited, 30*time.Second), Retried, 30 * time.Second, "handler error"},
		{"retry after, wrapped", Config{}, fmt.Errorf("call: %w", RetryAfter(errLimited, 20*time.Second)), Retried, 20 * time.Second, "handler error"},
		{"permanent wins over retry after", Config{}, Permanent(RetryAfter(errLimited, time.Second)), DeadLettered, 0, "permanent failure"},
		{"retry delay panics", Config{RetryDelay: func(int, error, *amqp.Delivery) time.Duration { panic("x") }, UnavailableDelay: 4 * time.Second},
			errLimited, Retried, 4 * time.Second, "handler error"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			seen = nil
			p, _ := newTestProcessor(t, tc.cfg, fails(tc.err))
			d, _ := delivery("a", "x")
			ev := p.process(context.Background(), &fakeBroker{}, d, nil)
			if ev.Outcome != tc.want || ev.Reason != tc.wantReason {
				t.Fatalf("outcome: got %v %q (%v), want %v %q", ev.Outcome, ev.Reason, ev.Err, tc.want, tc.wantReason)
			}
			if got, want := ev.Delay, tc.wantDelay; got != want {
				t.Fatalf("delay: got %v, want %v", got, want)
			}
		})
	}
	// RetryDelay is told the attempt, the error and the delivery.
	seen = nil
	p, _ := newTestProcessor(t, Config{RetryDelay: byErr}, fails(errLimited))
	for range 2 {
		d, _ := delivery("a", "x")
		p.process(context.Background(), &fakeBroker{}, d, nil)
	}
	if got, want := fmt.Sprint(seen), "[1 429 a 2 429 a]"; got != want {
		t.Fatalf("RetryDelay calls: got %s, want %s", got, want)
	}
}

func TestBackoffHelpers(t *testing.T) {
	tests := []struct {
		name string
		b    func() interface{ NextBackOff() time.Duration }
		want string
	}{
		{"constant", func() interface{ NextBackOff() time.Duration } { return Constant(time.Second)() }, "[1s 1s 1s 1s]"},
		{"steps", func() interface{ NextBackOff() time.Duration } {
			return Steps(time.Second, 10*time.Second, time.Minute)()
		},
			"[1s 10s 1m0s 1m0s]"},
		{"no steps", func() interface{ NextBackOff() time.Duration } { return Steps()() }, "[0s 0s 0s 0s]"},
	}
	for _, tc := range tests {
		b := tc.b()
		var got []time.Duration
		for range 4 {
			got = append(got, b.NextBackOff())
		}
		if fmt.Sprint(got) != tc.want {
			t.Errorf("%s: got %v, want %s", tc.name, got, tc.want)
		}
	}
	s := Steps(time.Second, time.Minute)()
	s.NextBackOff()
	s.NextBackOff()
	s.Reset()
	if got := s.NextBackOff(); got != time.Second {
		t.Errorf("steps after Reset: got %v, want 1s", got)
	}
}
