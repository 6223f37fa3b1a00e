package amqpidem

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// tracing is a middleware that notes its name before and after next.
func tracing(name string, log *[]string) Middleware {
	return func(next Handler) Handler {
		return HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			*log = append(*log, name+">")
			res, err := next.Handle(ctx, d)
			*log = append(*log, "<"+name)
			return res, err
		})
	}
}

func TestChainOrder(t *testing.T) {
	var log []string
	h := Chain(HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) {
		log = append(log, "h")
		return []byte("r"), nil
	}), tracing("a", &log), tracing("b", &log))
	p, _ := newTestProcessor(t, Config{}, h.Handle)
	d, _ := delivery("k", "x")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
		t.Fatalf("outcome: %v %v", ev.Outcome, ev.Err)
	}
	if got, want := strings.Join(log, " "), "a> b> h <b <a"; got != want {
		t.Fatalf("order: got %q, want %q", got, want)
	}
	// A duplicate runs neither.
	log = nil
	d, _ = delivery("k", "x")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Duplicate || len(log) != 0 {
		t.Fatalf("duplicate: %v, ran %v", ev.Outcome, log)
	}
	if c := (&txCompleter{}); Chain(c) != Handler(c) {
		t.Fatalf("Chain without middleware: got another handler, want h itself")
	}
}

// txCompleter is a Completer whose HandleComplete completes the record
// (as a transaction would, with the work) unless fail is set.
type txCompleter struct {
	store lock.Store
	fail  error
	runs  int
}

func (c *txCompleter) Handle(context.Context, *amqp.Delivery) ([]byte, error) {
	return []byte("plain"), nil
}
func (c *txCompleter) CompleterStore() lock.Store { return c.store }
func (c *txCompleter) HandleComplete(ctx context.Context, d *amqp.Delivery, l lock.Lease, value func([]byte) ([]byte, error)) ([]byte, error) {
	c.runs++
	if c.fail != nil {
		return nil, c.fail
	}
	v, err := value([]byte("committed"))
	if err != nil {
		return nil, err
	}
	if err := c.store.Complete(ctx, l, v); err != nil {
		return nil, err
	}
	return []byte("committed"), nil
}

// txTaker is a txCompleter that takes its own leases.
type txTaker struct{ *txCompleter }

func (t txTaker) AcquireLease(ctx context.Context, req lock.Request, _ *amqp.Delivery) (lock.Result, error) {
	return t.store.Acquire(ctx, req)
}

// TestChainKeepsCompleter: a Completer (a LeaseTaker) wrapped in
// middleware stays one, so its work still commits with its record; the
// transaction, not the middleware, decides the outcome.
func TestChainKeepsCompleter(t *testing.T) {
	errTx := errors.New("tx failed")
	swallow := func(next Handler) Handler {
		return HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			_, _ = next.Handle(ctx, d)
			return []byte("mine"), nil
		})
	}
	complain := func(next Handler) Handler {
		return HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			_, _ = next.Handle(ctx, d)
			return nil, errors.New("middleware error")
		})
	}
	skip := func(Handler) Handler {
		return HandlerFunc(func(context.Context, *amqp.Delivery) ([]byte, error) { return nil, nil })
	}
	tests := []struct {
		name       string
		fail       error
		mw         Middleware
		want       Outcome
		wantReason string
		wantErr    error
	}{
		{"committed, swallowed", nil, swallow, Completed, "", nil},
		{"committed, middleware error", nil, complain, Completed, "", nil},
		{"failed, swallowed", Permanent(errTx), swallow, DeadLettered, "permanent failure", errTx},
		{"skipped", nil, skip, DeadLettered, "permanent failure", ErrMiddlewareSkipped},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			mem, err := lock.NewMemoryStore(lock.Config{})
			if err != nil {
				t.Fatal(err)
			}
			inner := &txCompleter{store: mem, fail: tc.fail}
			h := Chain(txTaker{inner}, tc.mw)
			if _, ok := h.(LeaseTaker); !ok {
				t.Fatalf("Chain of a LeaseTaker: got %T, not a LeaseTaker", h)
			}
			p, err := newProcessor(mem, Config{Queue: "q", Logger: slog.New(slog.DiscardHandler)}, h)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = p.keeper.Shutdown(context.Background()) })
			var b fakeBroker
			d, _ := delivery("k", "x")
			d.ReplyTo = "replies"
			ev := p.process(context.Background(), &b, d, nil)
			if ev.Outcome != tc.want || ev.Reason != tc.wantReason || (tc.wantErr == nil) != (ev.Err == nil) || !errors.Is(ev.Err, tc.wantErr) {
				t.Fatalf("got %v %q %v, want %v %q %v", ev.Outcome, ev.Reason, ev.Err, tc.want, tc.wantReason, tc.wantErr)
			}
			if tc.want == Completed && (len(b.pubs) != 1 || string(b.pubs[0].msg.Body) != "committed") {
				t.Fatalf("reply: %+v; want the committed result", b.pubs)
			}
		})
	}
	// A plain Completer stays a Completer, not a LeaseTaker.
	mem, _ := lock.NewMemoryStore(lock.Config{})
	h := Chain(&txCompleter{store: mem}, swallow)
	if _, ok := h.(Completer); !ok {
		t.Fatalf("Chain of a Completer: got %T", h)
	}
	if _, ok := h.(LeaseTaker); ok {
		t.Fatalf("Chain of a Completer made a LeaseTaker")
	}
}
