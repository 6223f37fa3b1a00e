// Package txtest is the conformance suite of transactional handlers (an
// amqpidem.Completer whose effects commit with the record: pgstore's and
// dynamostore's TxHandler): the handler shapes users write, run through a
// real Consumer on RabbitMQ, each message published twice, half of them
// failing retryably on their first execution so that their retry takes the
// lease a retry takes (a record row, for pgstore). A store's tests give it
// their cases, one handler per idiom, and say what each must come to: its
// effect exactly once and every copy acked, or the message failing loudly
// (dead-lettered) with its effect as many times as the case says. It
// guarantees nothing by itself; the guarantees are the stores', and this
// suite is where they are shown for code written as users write it.
package txtest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// Ops is how many operations each case publishes, each twice.
const Ops = 6

// LeaseTTL is the lease of the suite's consumers: a case that idles or
// blocks past the lease waits about 1.5 times it.
const LeaseTTL = time.Second

// MaxAttempts is how many executions a message gets before it is
// dead-lettered.
const MaxAttempts = 3

// Env is what a store's test gives the suite.
type Env struct {
	// Store is the Consumer's store, which the handlers complete in.
	Store lock.Store
	// Effects returns how many times the effect of op (see Op) happened.
	Effects func(t testing.TB, op string) int
}

// Case is one handler idiom.
type Case struct {
	Name string
	// Handler returns the idiom's handler, a Completer of the Env's Store,
	// whose effect is recorded under Op(ctx, d). Its function begins with
	// `if err := r.FailFirst(d); err != nil { return nil, err }`, before
	// the idiom, and asks r.First(d) where the idiom does something on an
	// op's first execution only (idle past the lease, say).
	Handler func(r *Run) amqpidem.Handler
	// Effects is how many times each op's effect must have happened: 1,
	// or 0 for a case that must fail with nothing written.
	Effects int
	// DeadLettered: every copy of every op must be dead-lettered (a loud
	// failure); else every copy must be acked, completed or duplicate.
	DeadLettered bool
}

// Run is one case's run: it tells a handler which executions fail first
// and which are an op's first past that.
type Run struct {
	mu    sync.Mutex
	calls map[string]int // executions per op, by MessageId
}

// errFirst is the retryable error of an op's failing first execution.
var errFirst = errors.New("txtest: the first execution of this op fails, so that its retry takes a retry's lease")

// FailFirst returns a retryable error on the first execution of every
// other op (those whose MessageId ends in an even digit), nil otherwise.
func (r *Run) FailFirst(d *amqp.Delivery) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls[d.MessageId]++
	if r.calls[d.MessageId] == 1 && strings.IndexByte("02468", d.MessageId[len(d.MessageId)-1]) >= 0 {
		return errFirst
	}
	return nil
}

// First reports whether this is the first execution of d's op that got
// past FailFirst.
func (r *Run) First(d *amqp.Delivery) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := r.calls[d.MessageId]
	if strings.IndexByte("02468", d.MessageId[len(d.MessageId)-1]) >= 0 {
		n--
	}
	return n == 1
}

// Op names the effect of the delivery d processed under ctx: its queue and
// MessageId, unique to one case's run.
func Op(ctx context.Context, d *amqp.Delivery) string {
	info, _ := amqpidem.FromContext(ctx)
	return op(info.Queue, d.MessageId)
}

// op is Op of the message id of queue.
func op(queue, id string) string { return queue + "/" + id }

// Row is what one case came to on one path.
type Row struct {
	Case, Path string
	// Effects are the effects of every op, in order.
	Effects []int
	// Outcomes counts the settled copies by outcome.
	Outcomes map[amqpidem.Outcome]int
	// Reasons are the distinct reasons of the dead-lettered copies.
	Reasons []string
	// DLQ is how many messages the dead-letter queue held after.
	DLQ int
	// Err is what was not as the case wants, or empty.
	Err string
}

// String is the row as the closing table prints it.
func (r Row) String() string {
	var out []string
	for _, o := range []amqpidem.Outcome{amqpidem.Completed, amqpidem.Duplicate, amqpidem.DeadLettered, amqpidem.Dropped} {
		if n := r.Outcomes[o]; n > 0 {
			out = append(out, fmt.Sprintf("%s=%d", o, n))
		}
	}
	ok := "ok"
	if r.Err != "" {
		ok = "FAIL: " + r.Err
	}
	return fmt.Sprintf("%-50s %-5s effects=%v %s dlq=%d reasons=%q %s", r.Case, r.Path, r.Effects, strings.Join(out, " "), r.DLQ, r.Reasons, ok)
}

// Check runs every case on the path named path, each on a queue of its
// own with a Consumer on the store newEnv returns for it, in parallel
// subtests, and fails each case whose ops did not come to what it wants.
// It returns a row per case, in the order of cases, once all are done.
func Check(t *testing.T, path string, newEnv func(t *testing.T) Env, cases []Case) []Row {
	rows := make([]Row, len(cases))
	t.Run(path, func(t *testing.T) {
		for i, c := range cases {
			t.Run(c.Name, func(t *testing.T) {
				t.Parallel()
				rows[i] = runCase(t, path, newEnv(t), c)
				if rows[i].Err != "" {
					t.Error(rows[i].String())
				}
			})
		}
	})
	return rows
}

// Same fails t unless every case came to the same outcomes and reasons on
// each path (rows are Check's, one slice per path): "identically on every
// path".
func Same(t *testing.T, paths ...[]Row) {
	t.Helper()
	for i := 1; i < len(paths); i++ {
		for j, r := range paths[i] {
			first := paths[0][j]
			if !slices.Equal(r.Effects, first.Effects) || !slices.Equal(r.Reasons, first.Reasons) ||
				(r.Outcomes[amqpidem.DeadLettered] > 0) != (first.Outcomes[amqpidem.DeadLettered] > 0) {
				t.Errorf("%s: not the same on both paths:\n  %s\n  %s", r.Case, first, r)
			}
		}
	}
}

// runCase publishes Ops ops twice each and consumes them with c's handler
// until every copy is settled, then compares what happened with what c
// wants.
func runCase(t *testing.T, path string, env Env, c Case) Row {
	queue := testenv.Name(t)
	row := Row{Case: c.Name, Path: path, Outcomes: map[amqpidem.Outcome]int{}}
	events := make(chan amqpidem.Event, 4*Ops*MaxAttempts)
	cfg := amqpidem.ConsumerConfig{
		URL:         testenv.AMQPURL(t),
		Concurrency: 4,
		Config: amqpidem.Config{
			Queue:            queue,
			LeaseTTL:         LeaseTTL,
			MaxAttempts:      MaxAttempts,
			InProgressDelay:  amqpidem.MinInProgressDelay,
			UnavailableDelay: 100 * time.Millisecond,
			Backoff:          func() backoff.BackOff { return backoff.NewConstantBackOff(20 * time.Millisecond) },
			Logger:           slog.New(slog.DiscardHandler),
			Observer:         amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { events <- e }),
		},
	}
	consumer, err := amqpidem.NewConsumer(env.Store, cfg, c.Handler(&Run{calls: map[string]int{}}))
	if err != nil {
		t.Fatal(err)
	}
	ch := testenv.QueueChannel(t, queue)
	done := make(chan error, 1)
	go func() { done <- consumer.Run(context.Background()) }()
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := consumer.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if err := <-done; !errors.Is(err, amqpidem.ErrConsumerClosed) {
			t.Errorf("Run: %v", err)
		}
	}()
	for copy := range 2 {
		for i := range Ops {
			id := fmt.Sprintf("op-%d", i)
			err := ch.PublishWithContext(context.Background(), "", queue, false, false, amqp.Publishing{
				MessageId: id, DeliveryMode: amqp.Persistent, Body: []byte("do " + id)})
			if err != nil {
				t.Fatalf("publish %s copy %d: %v", id, copy, err)
			}
		}
	}
	// Every copy ends acked (completed, duplicate, dead-lettered,
	// dropped); the others are requeued and come again.
	settled := 0
	timeout := time.After(60 * time.Second)
	var seen []string
	for settled < 2*Ops {
		select {
		case e := <-events:
			seen = append(seen, fmt.Sprintf("%s:%v(%s)", e.Key, e.Outcome, e.Reason))
			switch e.Outcome {
			case amqpidem.Completed, amqpidem.Duplicate, amqpidem.DeadLettered, amqpidem.Dropped:
				settled++
				row.Outcomes[e.Outcome]++
				if e.Outcome == amqpidem.DeadLettered && !slices.Contains(row.Reasons, e.Reason) {
					row.Reasons = append(row.Reasons, e.Reason)
				}
			}
		case <-timeout:
			row.Err = fmt.Sprintf("%d of %d copies settled in 60s; events %v", settled, 2*Ops, seen)
			return row
		}
	}
	slices.Sort(row.Reasons)
	if q, err := ch.QueueDeclarePassive(queue+".dlq", true, false, false, false, nil); err == nil {
		row.DLQ = q.Messages
	}
	for i := range Ops {
		row.Effects = append(row.Effects, env.Effects(t, op(queue, fmt.Sprintf("op-%d", i))))
	}
	var errs []string
	for i, n := range row.Effects {
		if n != c.Effects {
			errs = append(errs, fmt.Sprintf("op-%d's effect %d times, want %d", i, n, c.Effects))
		}
	}
	acked := row.Outcomes[amqpidem.Completed] + row.Outcomes[amqpidem.Duplicate]
	switch {
	case c.DeadLettered && (row.Outcomes[amqpidem.DeadLettered] != 2*Ops || row.DLQ != 2*Ops):
		errs = append(errs, fmt.Sprintf("%d copies dead-lettered, %d in the DLQ, want every one (%d)", row.Outcomes[amqpidem.DeadLettered], row.DLQ, 2*Ops))
	case !c.DeadLettered && (acked != 2*Ops || row.Outcomes[amqpidem.Completed] != Ops):
		errs = append(errs, fmt.Sprintf("%d completed and %d duplicates, want %d of each", row.Outcomes[amqpidem.Completed], row.Outcomes[amqpidem.Duplicate], Ops))
	}
	row.Err = strings.Join(errs, "; ")
	return row
}
