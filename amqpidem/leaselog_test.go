package amqpidem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// unreleasable is a store whose Release does not answer.
type unreleasable struct{ lock.Store }

func (unreleasable) Release(context.Context, lock.Lease) error {
	return fmt.Errorf("%w: test", lock.ErrUnavailable)
}

// TestReleaseFailedLogsTheKey: a release that failed is logged with the
// message key, as every other record of amqpidem's (key=a), not the
// store's internal key (key="q\x00a") (issue 42, item 5).
func TestReleaseFailedLogsTheKey(t *testing.T) {
	var logs bytes.Buffer
	mem, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	p := newProcessorOn(t, unreleasable{mem}, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))},
		func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, errors.New("boom") })
	d, _ := delivery("a", "x")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Retried {
		t.Fatalf("outcome: got %v, want %v", ev.Outcome, Retried)
	}
	got := logs.String()
	if !strings.Contains(got, "release failed") || !strings.Contains(got, " key=a ") || strings.Contains(got, `key="q`) {
		t.Fatalf("got log %q, want the release failure with key=a", got)
	}
}
