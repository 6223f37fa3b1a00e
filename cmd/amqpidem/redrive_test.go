package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// stagedValues returns, by count, stored values of completed records
// whose handler staged 1 to 4 messages, to the default exchange with
// routing key "<queue>.next" and MessageIds "m0", "m1"..., with the result
// "result": made by a real consumer (on a MemoryStore) whose messages the
// broker returned, so that the values are amqpidem's own, all returned.
func stagedValues(t *testing.T) map[int][]byte {
	t.Helper()
	url := testenv.AMQPURL(t)
	queue := testenv.Name(t)
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	testenv.DeleteQueues(t, url, queue, queue+".dlq")
	given := make(chan string, 10)
	c, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{URL: url, Config: amqpidem.Config{Queue: queue, MaxAttempts: 1,
		Logger: slog.New(slog.DiscardHandler),
		Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) {
			if e.Outbox.Returned > 0 {
				given <- e.Key
			}
		})}},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			n, _ := strconv.Atoi(string(d.Body))
			for i := range n {
				id := fmt.Sprintf("m%d", i)
				if err := amqpidem.Stage(ctx, "", queue+".next", amqp.Publishing{MessageId: id, Body: []byte("body of " + id)}); err != nil {
					return nil, err
				}
			}
			return []byte("result"), nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.Shutdown(ctx)
		<-done
	}()
	values := map[int][]byte{}
	for n := 1; n <= 4; n++ {
		key := fmt.Sprintf("v%d", n)
		if err := ch.Publish("", queue, false, false, amqp.Publishing{MessageId: key, Body: []byte(strconv.Itoa(n))}); err != nil {
			t.Fatal(err)
		}
		select {
		case <-given:
		case err := <-done:
			t.Fatalf("the consumer stopped: %v", err)
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: its staged messages were not given up in 30s", key)
		}
		rec, err := store.Inspect(context.Background(), amqpidem.StoreKey(queue, key))
		if err != nil {
			t.Fatal(err)
		}
		msgs, err := amqpidem.StoredOutbox(rec.Value)
		if err != nil || len(msgs) != n || msgs[n-1].State != returned || msgs[n-1].Msg.MessageId != fmt.Sprintf("m%d", n-1) {
			t.Fatalf("%s: staged %+v %v", key, msgs, err)
		}
		values[n] = rec.Value
	}
	return values
}

// withStates is value with its staged messages in states, one each.
func withStates(t *testing.T, value []byte, states ...amqpidem.OutboxState) []byte {
	t.Helper()
	for i, s := range states {
		var err error
		if value, err = amqpidem.SetOutboxState(value, i, s); err != nil {
			t.Fatal(err)
		}
	}
	return value
}

// fakePublisher records what it is asked to publish; fail, when set,
// answers for a MessageId.
type fakePublisher struct {
	sent []string
	fail func(id string) error
}

func (p *fakePublisher) publish(_ context.Context, _, _ string, msg amqp.Publishing) error {
	if p.fail != nil {
		if err := p.fail(msg.MessageId); err != nil {
			return err
		}
	}
	p.sent = append(p.sent, msg.MessageId)
	return nil
}

// racingAmender is a store whose first Amend after the skip first finds
// that before, another writer (a consumer, an operator) did something to
// the record.
type racingAmender struct {
	*lock.MemoryStore
	skip   int // Amends let through first (redrive's claim is one)
	before func(ctx context.Context) error
	err    error // answered by every Amend after the skip instead of amending, when set
}

func (a *racingAmender) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	if a.skip > 0 {
		a.skip--
		return a.MemoryStore.Amend(ctx, key, fence, old, value)
	}
	if a.before != nil {
		before := a.before
		a.before = nil
		if err := before(ctx); err != nil {
			return err
		}
	}
	if a.err != nil {
		return a.err
	}
	return a.MemoryStore.Amend(ctx, key, fence, old, value)
}

// completedWith makes a MemoryStore holding one completed record of key k
// on queue q with value.
func completedWith(t *testing.T, value []byte) (*lock.MemoryStore, string) {
	t.Helper()
	s, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	skey := amqpidem.StoreKey("q", "k")
	ctx := context.Background()
	res, err := s.Acquire(ctx, lock.Request{Key: skey, TTL: time.Minute})
	if err != nil || res.Status != lock.Acquired {
		t.Fatalf("Acquire: %v %v", res.Status, err)
	}
	if err := s.Complete(ctx, res.Lease, value); err != nil {
		t.Fatal(err)
	}
	return s, skey
}

// statesOf reads the states of the staged messages of the record skey.
func statesOf(t *testing.T, s lock.Admin, skey string) string {
	t.Helper()
	rec, err := s.Inspect(context.Background(), skey)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := amqpidem.StoredOutbox(rec.Value)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range msgs {
		out = append(out, m.State.String())
	}
	return strings.Join(out, ",")
}

const (
	pending   = amqpidem.OutboxPending
	published = amqpidem.OutboxPublished
	returned  = amqpidem.OutboxReturned
)

// Which staged messages redrive publishes, and which it leaves, for each
// choice of flags.
func TestRedriveSelection(t *testing.T) {
	msgs := []amqpidem.OutboxMessage{{State: published}, {State: returned}, {State: pending}, {State: returned}}
	tests := []struct {
		name  string
		f     redriveFlags
		want  string // index:action, "" for publish
		code  int    // of the error, 0 for none
		error string // in the error
	}{
		{name: "default: returned ones", want: "1: 3:"},
		{name: "--all: pending too", f: redriveFlags{all: true}, want: "1: 2: 3:"},
		{name: "--force: every one", f: redriveFlags{force: true}, want: "0: 1: 2: 3:"},
		{name: "--index returned", f: redriveFlags{indexes: []int{3}}, want: "3:"},
		{name: "--index sorted, once", f: redriveFlags{indexes: []int{3, 1, 3}}, want: "1: 3:"},
		{name: "--index published: left", f: redriveFlags{indexes: []int{0, 1}}, want: "0:left 1:"},
		{name: "--index pending: left", f: redriveFlags{indexes: []int{2}}, want: "2:left"},
		{name: "--index pending --all", f: redriveFlags{indexes: []int{2}, all: true}, want: "2:"},
		{name: "--index published --force", f: redriveFlags{indexes: []int{0}, force: true}, want: "0:"},
		{name: "--index out of range", f: redriveFlags{indexes: []int{4}}, code: exitNotFound, error: "no staged message 4: the record has 4 staged messages (0 to 3)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &redriver{key: "k", k: &keyFlags{queue: "q"}, f: &tt.f}
			out, err := r.selected(msgs)
			var ce *codeError
			switch {
			case tt.code != 0:
				if !errors.As(err, &ce) || ce.code != tt.code || !strings.Contains(err.Error(), tt.error) {
					t.Fatalf("got %v, want exit %d and %q", err, tt.code, tt.error)
				}
				return
			case err != nil:
				t.Fatal(err)
			}
			var got []string
			for _, d := range out {
				got = append(got, fmt.Sprintf("%d:%s", d.Index, d.Action))
			}
			if got, want := strings.Join(got, " "), tt.want; got != want {
				t.Fatalf("got %v, want %v", got, want)
			}
		})
	}
	r := &redriver{key: "k", k: &keyFlags{queue: "q"}, f: &redriveFlags{}}
	_, err := r.selected([]amqpidem.OutboxMessage{{State: published}, {State: pending}})
	var ce *codeError
	if !errors.As(err, &ce) || ce.code != exitNotFound ||
		!strings.Contains(err.Error(), "nothing to redrive: 2 staged messages: 1 published, 1 pending, 0 returned") {
		t.Fatalf("nothing returned: %v", err)
	}
}

// redriveOn runs a redrive of the record of key k on queue q in store
// with the flags f, publishing with pub; it returns the actions taken by
// index, the output and the error.
func redriveOn(t *testing.T, admin lock.Admin, amender lock.Amender, pub stagedPublisher, f redriveFlags) (string, string, error) {
	t.Helper()
	var stdout bytes.Buffer
	f.yes = true // an operator who confirmed: what the tests here look at comes after
	o := &options{stdout: &stdout, stderr: &stdout, timeout: 5 * time.Second, json: true, redisURL: "redis://test"}
	r := &redriver{o: o, k: &keyFlags{queue: "q"}, key: "k", skey: amqpidem.StoreKey("q", "k"), admin: admin, amender: amender, f: &f, pub: pub}
	err := r.run(context.Background())
	var did []redriven
	if jerr := json.Unmarshal(stdout.Bytes(), &did); jerr != nil && (err == nil || stdout.Len() > 0) {
		t.Fatalf("output: %v\n%s", jerr, stdout.String())
	}
	var actions []string
	for _, d := range did {
		actions = append(actions, fmt.Sprintf("%d:%s", d.Index, d.Action))
	}
	return strings.Join(actions, " "), stdout.String() + r.note, err
}

// exitCode is the exit code err ends the command with.
func exitCode(err error) int {
	var ce *codeError
	if errors.As(err, &ce) {
		return ce.code
	}
	if err != nil {
		return -1
	}
	return exitOK
}

// What redrive marks in the record when the broker, the store or another
// writer has a say.
func TestRedriveMarks(t *testing.T) {
	errNope := errors.New("connection reset")
	tests := []struct {
		name   string
		states []amqpidem.OutboxState
		f      redriveFlags
		fail   func(id string) error
		// race runs before the first Amend: another writer's change.
		race      func(ctx context.Context, s *lock.MemoryStore, skey string) error
		amendErr  error
		code      int
		actions   string // index:action as reported
		sent      string // MessageIds published
		after     string // the states in the record afterwards
		inOutput  string
		wantNoted bool
	}{
		{name: "returned ones published and marked", states: []amqpidem.OutboxState{published, returned, pending, returned},
			actions: "1:redriven 3:redriven", sent: "m1 m3", after: "published,published,pending,published"},
		{name: "dry run publishes and marks nothing", states: []amqpidem.OutboxState{returned}, f: redriveFlags{dryRun: true},
			actions: "0:would redrive", after: "returned"},
		{name: "returned again: left, not marked, the next one goes on", states: []amqpidem.OutboxState{returned, returned},
			fail: func(id string) error {
				if id == "m0" {
					return left("returned again")
				}
				return nil
			},
			code: exitRefused, actions: "0:left 1:redriven", sent: "m1", after: "returned,published", inOutput: "returned again"},
		{name: "broker gone: what was published is marked, the run stops", states: []amqpidem.OutboxState{returned, returned, returned},
			fail: func(id string) error {
				if id == "m1" {
					return withCode(exitFailed, "RabbitMQ: %w", errNope)
				}
				return nil
			},
			code: exitFailed, actions: "0:redriven 1:left", sent: "m0", after: "published,returned,returned", inOutput: "the run stopped here"},
		{name: "a consumer marked another message first: marked on what the record holds now",
			states: []amqpidem.OutboxState{returned, pending}, race: markPublished(1),
			actions: "0:redriven", sent: "m0", after: "published,published", wantNoted: true},
		{name: "a consumer published the same message first: nothing left to mark",
			states: []amqpidem.OutboxState{pending, pending}, f: redriveFlags{all: true, indexes: []int{0}}, race: markPublished(0, 1),
			actions: "0:redriven", sent: "m0", after: "published,published", wantNoted: true},
		{name: "record forgotten meanwhile: published, not marked",
			states: []amqpidem.OutboxState{returned},
			race: func(ctx context.Context, s *lock.MemoryStore, skey string) error {
				rec, _ := s.Inspect(ctx, skey)
				return s.Forget(ctx, skey, rec.State, rec.Fence)
			},
			code: exitRefused, actions: "0:published, not marked", sent: "m0", inOutput: "the record is gone"},
		{name: "store unavailable: published, not marked", states: []amqpidem.OutboxState{returned},
			amendErr: fmt.Errorf("%w: timeout", lock.ErrUnavailable),
			code:     exitFailed, actions: "0:published, not marked", sent: "m0", after: "returned", inOutput: "published again by the next redrive"},
	}
	values := stagedValues(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, skey := completedWith(t, withStates(t, values[len(tt.states)], tt.states...))
			// The race comes at the mark, after redrive took the claim.
			a := &racingAmender{MemoryStore: s, err: tt.amendErr, skip: 1}
			if tt.race != nil {
				a.before = func(ctx context.Context) error { return tt.race(ctx, s, skey) }
			}
			pub := &fakePublisher{fail: tt.fail}
			actions, out, err := redriveOn(t, s, a, pub, tt.f)
			if got, want := exitCode(err), tt.code; got != want {
				t.Fatalf("exit code: got %v, want %v (%v)\n%s", got, want, err, out)
			}
			if got, want := actions, tt.actions; got != want {
				t.Fatalf("actions: got %v, want %v\n%s", got, want, out)
			}
			if got, want := strings.Join(pub.sent, " "), tt.sent; got != want {
				t.Fatalf("published: got %v, want %v", got, want)
			}
			if tt.after != "" {
				if got, want := statesOf(t, s, skey), tt.after; got != want {
					t.Fatalf("record: got %v, want %v", got, want)
				}
			}
			if msg := fmt.Sprint(err) + out; !strings.Contains(msg, tt.inOutput) {
				t.Fatalf("output has no %q:\n%s", tt.inOutput, msg)
			}
			if got, want := strings.Contains(out, "the record changed while this ran"), tt.wantNoted; got != want {
				t.Fatalf("noted the change: got %v, want %v\n%s", got, want, out)
			}
			if rec, err := s.Inspect(context.Background(), skey); err == nil && string(amqpidem.StoredResult(rec.Value)) != "result" {
				t.Fatalf("the result changed: %q", amqpidem.StoredResult(rec.Value))
			}
		})
	}
}

// markPublished is another writer marking the messages of indexes
// published.
func markPublished(indexes ...int) func(ctx context.Context, s *lock.MemoryStore, skey string) error {
	return func(ctx context.Context, s *lock.MemoryStore, skey string) error {
		rec, err := s.Inspect(ctx, skey)
		if err != nil {
			return err
		}
		v := rec.Value
		for _, i := range indexes {
			if v, err = amqpidem.SetOutboxState(v, i, published); err != nil {
				return err
			}
		}
		return s.Amend(ctx, skey, rec.Fence, rec.Value, v)
	}
}

// redrive takes the claim on the staged messages, as a copy of their
// message does, before it publishes: a claim held by another (a redrive,
// a consumer's copy), or taken by another while this one reads, means
// nothing is published; a run gives its claim up when it is done.
func TestRedriveClaim(t *testing.T) {
	values := stagedValues(t)
	claimed := func(t *testing.T, v []byte) []byte {
		t.Helper()
		v, err := amqpidem.ClaimOutbox(v, time.Now().Add(time.Minute))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	t.Run("held: refused, nothing published", func(t *testing.T) {
		s, skey := completedWith(t, claimed(t, withStates(t, values[2], returned, returned)))
		pub := &fakePublisher{}
		_, out, err := redriveOn(t, s, s, pub, redriveFlags{})
		if got, want := exitCode(err), exitRefused; got != want {
			t.Fatalf("exit code: got %v, want %v (%v)\n%s", got, want, err, out)
		}
		if len(pub.sent) != 0 || !strings.Contains(err.Error(), "being published by another outbox redrive") {
			t.Fatalf("published %v; error %v", pub.sent, err)
		}
		if got, want := statesOf(t, s, skey), "returned,returned"; got != want {
			t.Fatalf("record: got %v, want %v", got, want)
		}
	})
	t.Run("taken by another meanwhile: refused, nothing published", func(t *testing.T) {
		s, skey := completedWith(t, withStates(t, values[2], returned, returned))
		a := &racingAmender{MemoryStore: s, before: func(ctx context.Context) error {
			rec, err := s.Inspect(ctx, skey)
			if err != nil {
				return err
			}
			return s.Amend(ctx, skey, rec.Fence, rec.Value, claimed(t, rec.Value))
		}}
		pub := &fakePublisher{}
		_, out, err := redriveOn(t, s, a, pub, redriveFlags{})
		if got, want := exitCode(err), exitRefused; got != want || len(pub.sent) != 0 {
			t.Fatalf("exit code %v (%v), published %v: want %v, nothing\n%s", got, err, pub.sent, want, out)
		}
	})
	t.Run("done: published, marked, claim given up", func(t *testing.T) {
		s, skey := completedWith(t, withStates(t, values[2], returned, returned))
		pub := &fakePublisher{}
		if _, out, err := redriveOn(t, s, s, pub, redriveFlags{}); err != nil || len(pub.sent) != 2 {
			t.Fatalf("published %v: %v\n%s", pub.sent, err, out)
		}
		rec, err := s.Inspect(context.Background(), skey)
		if err != nil {
			t.Fatal(err)
		}
		if held, err := amqpidem.OutboxClaim(rec.Value); err != nil || !held.IsZero() {
			t.Fatalf("claim after the run: %v %v, want none", held, err)
		}
	})
}
