package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// Environment of TestHrev9RelayKillHelper, set by
// TestHrev9RelayKilledBetweenConfirmAndMark.
const (
	hrev9EnvDSN    = "HREV9_KILL_DSN"
	hrev9EnvSchema = "HREV9_KILL_SCHEMA"
	hrev9EnvAMQP   = "HREV9_KILL_AMQP"
)

// TestHrev9RelayKillHelper is the process TestHrev9RelayKilledBetweenConfirmAndMark
// kills: a relay that sends itself SIGKILL when it is about to mark its
// first published rows sent (after the broker's confirms). Skipped unless
// that test runs it.
func TestHrev9RelayKillHelper(t *testing.T) {
	dsn := os.Getenv(hrev9EnvDSN)
	if dsn == "" {
		t.Skip("run by TestHrev9RelayKilledBetweenConfirmAndMark")
	}
	pool, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	ob, err := pgstore.NewOutbox(pool, pgstore.Config{Schema: os.Getenv(hrev9EnvSchema), CleanupInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	rl, err := pgstore.NewRelay(ob, pgstore.RelayConfig{URL: os.Getenv(hrev9EnvAMQP), ClaimTTL: 2 * time.Second,
		PublishTimeout: 500 * time.Millisecond, Batch: 8, Concurrency: 8, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	pgstore.SetBeforeMark(rl, func() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL) })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_ = rl.Run(ctx)
	t.Fatal("the relay was not killed before its mark")
}

// TestHrev9RelayKilledBetweenConfirmAndMark: a relay process killed
// (SIGKILL) after the broker confirmed its messages and before it marked
// their rows sent. As docs/relay.md says: the rows stay pending, claimed,
// until the claim ends; then another relay publishes them again, each copy
// with the same MessageId (and body), and marks them sent: at least once,
// here exactly twice.
func TestHrev9RelayKilledBetweenConfirmAndMark(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a process")
	}
	r := newOutboxRig(t)
	var ids []string
	for i := range 3 {
		ids = append(ids, r.write(true, r.msg(fmt.Sprint("m", i)))...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestHrev9RelayKillHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), hrev9EnvDSN+"="+pgenv.DSN(t), hrev9EnvSchema+"="+r.cfg.Schema,
		hrev9EnvAMQP+"="+testenv.AMQPURL(t))
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("the relay process: %v, want killed by SIGKILL; output:\n%s", err, out)
	}
	// The broker took the three; their rows are pending, claimed.
	first := r.take(3, 10*time.Second)
	if n := r.count("p"); n != 3 {
		t.Fatalf("%d rows pending after the kill, want 3", n)
	}
	startRelay(t, r.ob, pgstore.RelayConfig{PollInterval: 50 * time.Millisecond}, nil)
	r.waitCount("s", 3, 20*time.Second)
	again := r.take(3, 10*time.Second)
	bodies := map[string][]string{}
	for _, d := range append(first, again...) {
		bodies[d.MessageId] = append(bodies[d.MessageId], string(d.Body))
	}
	for _, id := range ids {
		if b := bodies[id]; len(b) != 2 || b[0] != b[1] {
			t.Errorf("message %s arrived as %q, want twice, the same body", id, b)
		}
	}
	if len(bodies) != len(ids) {
		t.Errorf("%d message ids arrived, want %d", len(bodies), len(ids))
	}
}

// hrev9States returns the outbox rows' states by MessageId.
func hrev9States(t *testing.T, r *outboxRig) map[string]string {
	t.Helper()
	s, _ := hrev9Snapshot(t, r)
	return s
}

// hrev9Snapshot returns the outbox rows' states by MessageId and, read in
// the same statement (one snapshot), each row in full with the
// transaction that wrote it (xmin) and the statement's snapshot: what a
// watcher reports when the states break an order.
func hrev9Snapshot(t *testing.T, r *outboxRig) (map[string]string, string) {
	t.Helper()
	rows, err := r.pool.Query(context.Background(), `SELECT message_id, state, format('id=%s xmin=%s key=%s seq=%s state=%s '||
			'attempts=%s claimed_by=%s due_at=%s sent_at=%s error=%s (snapshot %s)', id, xmin, order_key, seq, state, attempts,
			claimed_by, due_at, sent_at, last_error, pg_current_snapshot()) FROM `+
		pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()+" ORDER BY id")
	if err != nil {
		t.Error(err)
		return nil, ""
	}
	defer rows.Close()
	out := map[string]string{}
	var all strings.Builder
	for rows.Next() {
		var id, state, row string
		if err := rows.Scan(&id, &state, &row); err != nil {
			t.Error(err)
			return nil, ""
		}
		if _, twice := out[id]; twice {
			t.Errorf("two outbox rows with MessageId %s", id)
		}
		out[id] = state
		fmt.Fprintf(&all, "\n\t%s: %s", id, row)
	}
	if err := rows.Err(); err != nil {
		t.Error(err)
		return nil, ""
	}
	return out, all.String()
}

// hrev9Watch samples the rows' states every few ms until stop is closed,
// and reports each time a row of after was sent while its row before
// was still pending, with the rows as that one statement read them.
func hrev9Watch(t *testing.T, r *outboxRig, before string, after []string, stop <-chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		reported := map[string]bool{}
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			s, all := hrev9Snapshot(t, r)
			for _, a := range after {
				if s[a] == "s" && s[before] == "p" && !reported[a] {
					reported[a] = true
					t.Errorf("%s was sent while %s, before it in its order key, was still pending; the rows, read together:%s",
						a, before, all)
				}
			}
		}
	}()
	return &wg
}

// TestHrev9RelayTooLargeAndUnroutable: a message whose headers exceed
// the broker's frame_max, and one no queue takes, are refused, made dead
// after MaxAttempts with their ids logged at error level, and hold back
// nothing but (with Ordered) the later messages of their own order key,
// until they are dead.
func TestHrev9RelayTooLargeAndUnroutable(t *testing.T) {
	for _, ordered := range []bool{false, true} {
		t.Run(fmt.Sprint("ordered=", ordered), func(t *testing.T) {
			r := newOutboxRig(t)
			key := func(m pgstore.Message, k string) pgstore.Message {
				if ordered {
					m.OrderKey = k
				}
				return m
			}
			big := key(r.msg("big"), "k")
			big.Publishing.MessageId = "big"
			big.Publishing.Headers = amqp.Table{"blob": strings.Repeat("x", 200_000)}
			lost := key(pgstore.Message{RoutingKey: r.queue + "-nobody", Publishing: amqp.Publishing{MessageId: "lost", Body: []byte("lost")}}, "l")
			named := func(id, k string) pgstore.Message {
				m := key(r.msg(id), k)
				m.Publishing.MessageId = id
				return m
			}
			r.write(true, big, named("k2", "k"), lost, named("l2", "l"), named("free", "m"))
			var log testenv.SyncBuffer
			start := time.Now()
			startRelay(t, r.ob, pgstore.RelayConfig{Ordered: ordered, MaxAttempts: 3, RetryBackoff: 300 * time.Millisecond,
				PollInterval: 50 * time.Millisecond, Logger: logTo(&log)}, nil)
			t.Cleanup(func() { t.Logf("relay log:\n%s", log.String()) })
			stop := make(chan struct{})
			var watch *sync.WaitGroup
			if ordered {
				w1 := hrev9Watch(t, r, "big", []string{"k2"}, stop)
				w2 := hrev9Watch(t, r, "lost", []string{"l2"}, stop)
				watch = &sync.WaitGroup{}
				watch.Add(1)
				go func() { w1.Wait(); w2.Wait(); watch.Done() }()
			}
			// The free row goes at once, the refused ones' retries
			// notwithstanding (300 ms, then 600 ms).
			d, ok := hrev9Get(t, r, r.queue, 5*time.Second)
			if !ok {
				t.Fatal("nothing arrived in 5 s")
			}
			if ordered && d.MessageId != "free" {
				t.Errorf("first delivery %s, want free (the others wait for their refused heads)", d.MessageId)
			}
			firstAt := time.Since(start)
			r.waitCount("d", 2, 20*time.Second)
			r.waitCount("s", 3, 10*time.Second)
			close(stop)
			if watch != nil {
				watch.Wait()
			}
			rest := r.take(2, 10*time.Second)
			got := []string{d.MessageId}
			for _, d := range rest {
				got = append(got, d.MessageId)
			}
			slices.Sort(got)
			if !slices.Equal(got, []string{"free", "k2", "l2"}) {
				t.Errorf("delivered %q, want free, k2, l2 once each", got)
			}
			dead, err := r.ob.List(context.Background(), "dead", 0, 10)
			if err != nil {
				t.Fatal(err)
			}
			why := map[string]string{}
			for _, row := range dead {
				why[row.MessageID] = row.LastError
				if row.Attempts != 3 {
					t.Errorf("dead row %s: %d attempts, want 3", row.MessageID, row.Attempts)
				}
				logged := false
				for _, line := range strings.Split(log.String(), "\n") {
					if strings.Contains(line, "level=ERROR") && strings.Contains(line, "a message is dead") &&
						strings.Contains(line, fmt.Sprintf(" id=%d ", row.ID)) {
						logged = true
					}
				}
				if !logged {
					t.Errorf("dead row %s (id %d) is not logged at error level with its id", row.MessageID, row.ID)
				}
			}
			if !strings.Contains(why["big"], "frame_max") || !strings.Contains(why["lost"], "unroutable") {
				t.Errorf("dead rows' reasons %q: want frame_max for big, unroutable for lost", why)
			}
			t.Logf("first delivery after %v", firstAt)
		})
	}
}

// hrev9Get gets one message from queue, waiting up to timeout.
func hrev9Get(t *testing.T, r *outboxRig, queue string, timeout time.Duration) (amqp.Delivery, bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		d, ok, err := r.ch.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok || time.Now().After(deadline) {
			return d, ok
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestHrev9RelayBodyAboveMaxMessageSize: a body above the broker's
// max_message_size (128 MiB by default) makes the broker close the channel
// (406 PRECONDITION_FAILED): a refusal, dead after MaxAttempts; the row
// behind it goes on.
func TestHrev9RelayBodyAboveMaxMessageSize(t *testing.T) {
	if testing.Short() {
		t.Skip("128 MiB")
	}
	r := newOutboxRig(t)
	huge := r.msg("")
	huge.Publishing.MessageId = "huge"
	huge.Publishing.Body = bytes.Repeat([]byte{'h'}, 128<<20+1)
	after := r.msg("after")
	after.Publishing.MessageId = "after"
	r.write(true, huge, after)
	var log testenv.SyncBuffer
	startRelay(t, r.ob, pgstore.RelayConfig{MaxAttempts: 2, RetryBackoff: 100 * time.Millisecond, Batch: 2, Concurrency: 2,
		PublishTimeout: 20 * time.Second, ClaimTTL: time.Minute, PollInterval: 50 * time.Millisecond, Logger: logTo(&log)}, nil)
	t.Cleanup(func() {
		s := log.String()
		if len(s) > 4000 {
			s = s[:4000]
		}
		t.Logf("relay log:\n%s", s)
	})
	if d, ok := hrev9Get(t, r, r.queue, 20*time.Second); !ok || d.MessageId != "after" {
		t.Fatalf("got %q, %v; want the row after the huge one", d.MessageId, ok)
	}
	r.waitCount("d", 1, 60*time.Second)
	dead, err := r.ob.List(context.Background(), "dead", 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].MessageID != "huge" {
		t.Fatalf("dead rows %v, want huge", dead)
	}
	t.Logf("huge: %d attempts, last error %s", dead[0].Attempts, dead[0].LastError)
}

// hrev9Goroutines returns the stacks of the running goroutines, by id.
func hrev9Goroutines() map[string]string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	out := map[string]string{}
	for _, g := range strings.Split(string(buf), "\n\n") {
		head, _, _ := strings.Cut(g, "\n")
		out[head[:strings.Index(head, " [")]] = g
	}
	return out
}

// hrev9RelayGoroutines returns the stacks in now, not in before, of a
// relay (pgstore's, amqpidem's publisher, amqp091-go's connection, a pgx
// connection's), but for the test's writer.
func hrev9RelayGoroutines(before, now map[string]string) []string {
	var out []string
	for id, g := range now {
		if _, ok := before[id]; ok || strings.Contains(g, "(*outboxRig).write") {
			continue
		}
		if strings.Contains(g, "amqpidem/pgstore.") || strings.Contains(g, "amqp091-go.") ||
			strings.Contains(g, "amqpidem/amqpidem.") || strings.Contains(g, "pgx/v5.(*Conn)") {
			out = append(out, g)
		}
	}
	return out
}

// hrev9Settled returns left, the relay's goroutines found when Shutdown
// returned, but for those of amqp091-go's connection alone (its reader,
// which Connection.Close does not wait for: it ends when the closed socket
// answers its read) that end within a second, which it logs: amqpidem's
// Publisher.Close cannot wait for them.
func hrev9Settled(t *testing.T, before map[string]string, left []string) []string {
	t.Helper()
	var own []string
	lib := map[string]string{}
	for _, g := range left {
		head, _, _ := strings.Cut(g, "\n")
		if !strings.Contains(g, "amqpidem/") && strings.Contains(g, "amqp091-go.(*Connection).") {
			lib[head[:strings.Index(head, " [")]] = g
			continue
		}
		own = append(own, g)
	}
	if len(own) > 0 {
		// A goroutine that a WaitGroup's Wait already let go may still be
		// in the dump, between its deferred Done and its end (the
		// Publisher's channel closes): look again once, a moment later.
		time.Sleep(50 * time.Millisecond)
		now := hrev9Goroutines()
		var still []string
		for _, g := range own {
			head, _, _ := strings.Cut(g, "\n")
			if _, ok := now[head[:strings.Index(head, " [")]]; ok {
				still = append(still, g)
			}
		}
		own = still
	}
	if len(lib) == 0 {
		return own
	}
	deadline := time.Now().Add(time.Second)
	for {
		now := hrev9Goroutines()
		still := 0
		for id := range lib {
			if _, ok := now[id]; ok {
				still++
			}
		}
		if still == 0 {
			t.Logf("%d goroutines of amqp091-go's connection ran on when Shutdown returned, and ended within a second", len(lib))
			return own
		}
		if time.Now().After(deadline) {
			for id := range lib {
				if g, ok := now[id]; ok {
					own = append(own, g)
				}
			}
			return own
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestHrev9RelayShutdownLeavesNoGoroutine: when Shutdown returns, nothing
// the relay started runs any more: no round, publish or confirm wait, no
// listener or cleanup, no goroutine of its broker connection, and its
// listening session is closed. The relay is stopped with work in flight
// (ordered chains, a refused row in backoff, publishes awaiting their
// confirms).
func TestHrev9RelayShutdownLeavesNoGoroutine(t *testing.T) {
	r := newOutboxRig(t)
	pool, app := appPool(t, 4)
	ob, err := pgstore.NewOutbox(pool, r.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := pool.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	before := hrev9Goroutines()
	rl, err := pgstore.NewRelay(ob, pgstore.RelayConfig{URL: testenv.AMQPURL(t), Ordered: true, Batch: 16, Concurrency: 4,
		PublishTimeout: 2 * time.Second, PollInterval: 20 * time.Millisecond, RetryBackoff: 50 * time.Millisecond, MaxAttempts: 2,
		CleanupInterval: 30 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- rl.Run(context.Background()) }()
	t.Cleanup(func() { // on a failure before the test's own Shutdown
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = rl.Shutdown(ctx)
	})
	var writes atomic.Int64
	stopWriting := make(chan struct{})
	var writers sync.WaitGroup
	writers.Add(1)
	go func() {
		defer writers.Done()
		for i := 0; ; i++ {
			select {
			case <-stopWriting:
				return
			default:
			}
			m := r.msg(fmt.Sprint(i))
			m.OrderKey = fmt.Sprint("k", i%5)
			if i%17 == 0 {
				m.RoutingKey = r.queue + "-nobody"
			}
			r.write(true, m)
			writes.Add(1)
		}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for pub, _, _ := rl.Counts(); pub < 100; pub, _, _ = rl.Counts() {
		if time.Now().After(deadline) {
			close(stopWriting)
			writers.Wait()
			t.Fatalf("%d published in 10 s", pub)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// What counts as the relay's, seen while it runs: the filter below
	// finds its goroutines.
	if n := len(hrev9RelayGoroutines(before, hrev9Goroutines())); n == 0 {
		t.Error("no goroutine of the running relay found: the check below cannot see any")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = rl.Shutdown(ctx)
	after := hrev9Goroutines()
	close(stopWriting)
	writers.Wait()
	if err != nil {
		t.Errorf("Shutdown: %v", err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	default:
		t.Error("Run had not returned when Shutdown did")
	}
	if left := hrev9Settled(t, before, hrev9RelayGoroutines(before, after)); len(left) > 0 {
		t.Errorf("%d goroutines of the relay still run when Shutdown returned:\n%s", len(left), strings.Join(left, "\n\n"))
	}
	// The listening session ends (the server's backend exits after the
	// client's Terminate).
	if listening := hrev9Listening(t, r, app); listening != 0 {
		t.Errorf("%d listening sessions of the relay left after Shutdown", listening)
	}
	t.Logf("%d messages written; Counts at the end: %v", writes.Load(), fmt.Sprint(rl.Counts()))
}

// hrev9Declare declares queue with args (deleted in t.Cleanup).
func hrev9Declare(t *testing.T, r *outboxRig, queue string, args amqp.Table) {
	t.Helper()
	if _, err := r.ch.QueueDeclare(queue, true, false, false, false, args); err != nil {
		t.Fatal(err)
	}
	testenv.DeleteQueues(t, testenv.AMQPURL(t), queue)
}

// TestHrev9RelayOrderedChainFailsHalfway: an order key's rows A1, A2, A3,
// A4, claimed as one chain, and A2's publish fails: refused (its headers
// exceed frame_max: dead after MaxAttempts), or nacked (its queue is full,
// reject-publish: not a refusal; it waits until the queue takes it). Two
// relays run. A3 and A4 must not be published before A2 is confirmed (or
// dead): when A3 arrives, A2 is dead, or already in its queue.
func TestHrev9RelayOrderedChainFailsHalfway(t *testing.T) {
	for _, how := range []string{"refused", "nacked"} {
		t.Run(how, func(t *testing.T) {
			r := newOutboxRig(t)
			msg := func(id string) pgstore.Message {
				m := r.msg(id)
				m.Publishing.MessageId = id
				m.OrderKey = "a"
				return m
			}
			a2 := msg("A2")
			full := r.queue + "-full"
			if how == "refused" {
				a2.Publishing.Headers = amqp.Table{"blob": strings.Repeat("x", 200_000)}
			} else {
				// A2 goes to an exchange bound to a queue that takes
				// nothing; later bound to one that takes it too, and
				// unbound from the full one.
				hrev9Declare(t, r, full, amqp.Table{"x-max-length": int32(0), "x-overflow": "reject-publish"})
				hrev9Declare(t, r, full+"-ok", nil)
				if err := r.ch.ExchangeDeclare(full, "direct", false, true, false, false, nil); err != nil {
					t.Fatal(err)
				}
				if err := r.ch.QueueBind(full, "a2", full, false, nil); err != nil {
					t.Fatal(err)
				}
				a2.Exchange, a2.RoutingKey = full, "a2"
			}
			r.write(true, msg("A1"), a2, msg("A3"), msg("A4"))
			for range 2 {
				startRelay(t, r.ob, pgstore.RelayConfig{Ordered: true, MaxAttempts: 3, RetryBackoff: 200 * time.Millisecond,
					MaxBackoff: 400 * time.Millisecond, PollInterval: 20 * time.Millisecond, Batch: 8, Concurrency: 4}, nil)
			}
			stop := make(chan struct{})
			watch := hrev9Watch(t, r, "A2", []string{"A3", "A4"}, stop)
			defer func() { close(stop); watch.Wait() }()
			d, ok := hrev9Get(t, r, r.queue, 10*time.Second)
			if !ok || d.MessageId != "A1" {
				t.Fatalf("first delivery %q (%v), want A1", d.MessageId, ok)
			}
			if how == "nacked" {
				time.Sleep(1500 * time.Millisecond) // A2 nacked a few times
				if s := hrev9States(t, r); s["A2"] != "p" || s["A3"] != "p" {
					t.Fatalf("states %v: want A2 and A3 pending while A2's queue is full", s)
				}
				if err := r.ch.QueueBind(full+"-ok", "a2", full, false, nil); err != nil {
					t.Fatal(err)
				}
				if err := r.ch.QueueUnbind(full, "a2", full, nil); err != nil {
					t.Fatal(err)
				}
			}
			d, ok = hrev9Get(t, r, r.queue, 20*time.Second)
			if !ok || d.MessageId != "A3" {
				t.Fatalf("second delivery %q (%v), want A3", d.MessageId, ok)
			}
			if how == "refused" {
				if s := hrev9States(t, r); s["A2"] != "d" {
					t.Errorf("A3 arrived while A2 is %q, want dead", s["A2"])
				}
			} else {
				q, err := r.ch.QueueDeclarePassive(full+"-ok", true, false, false, false, nil)
				if err != nil {
					t.Fatal(err)
				}
				if q.Messages != 1 {
					t.Errorf("A3 arrived while A2's queue holds %d messages, want A2 in it", q.Messages)
				}
			}
			if d, ok := hrev9Get(t, r, r.queue, 10*time.Second); !ok || d.MessageId != "A4" {
				t.Fatalf("third delivery %q (%v), want A4", d.MessageId, ok)
			}
			want := 4
			if how == "refused" {
				want = 3
			}
			r.waitCount("s", want, 10*time.Second)
			if d, ok, _ := r.ch.Get(r.queue, true); ok {
				t.Errorf("a copy arrived: %s", d.MessageId)
			}
		})
	}
}

// TestHrev9RelayCopyOfALostConfirm: the broker takes a message whose
// confirm does not reach the relay within PublishTimeout (a proxy holds
// back what the broker sends). The row is released and published again:
// the queue holds the message twice, with one MessageId, with no crash,
// no lost mark and no pause, which Relay's doc, saying copies came "only"
// from those, left out. Nothing is lost.
func TestHrev9RelayCopyOfALostConfirm(t *testing.T) {
	r := newOutboxRig(t)
	amqpURL := testenv.AMQPURL(t)
	u, err := url.Parse(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	up, down := newHrev9Gate(), newHrev9Gate()
	px := testenv.StartProxy(t, u.Host, up.copy, down.copy)
	t.Cleanup(down.resume)
	viaProxy := px.URL(t, amqpURL)
	startRelay(t, r.ob, pgstore.RelayConfig{Dial: func() (*amqp.Connection, error) { return amqp.Dial(viaProxy) },
		PublishTimeout: 300 * time.Millisecond, ClaimTTL: 5 * time.Second, Batch: 4, Concurrency: 4,
		RetryBackoff: 100 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, PollInterval: 50 * time.Millisecond}, nil)
	t.Cleanup(down.resume) // before the relay's shutdown
	warm := r.write(true, r.msg("warm"))
	r.waitCount("s", 1, 10*time.Second)
	down.pause()
	late := r.write(true, r.msg("late"))
	// The broker has it; its confirm waits in the proxy.
	deadline := time.Now().Add(10 * time.Second)
	for {
		q, err := r.ch.QueueDeclarePassive(r.queue, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if q.Messages == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d messages in the queue after 10 s, want warm and late", q.Messages)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(time.Second) // PublishTimeout passes: the row is released
	down.resume()
	r.waitCount("s", 2, 20*time.Second)
	got := r.take(2, 10*time.Second)
	seen := map[string]int{}
	for _, d := range got {
		seen[d.MessageId]++
	}
	if seen[warm[0]] != 1 || seen[late[0]] < 1 {
		t.Fatalf("deliveries by MessageId %v: want warm once, late at least once", seen)
	}
	t.Logf("the message whose confirm was held back arrived %d times", seen[late[0]])
}

// TestHrev9RelayOrderedClaimSize: with Ordered, one claim takes up to
// Batch heads, each with up to Batch-1 of its key's next rows: Batch²
// rows, not Batch as RelayConfig.Batch said. Four keys of four rows,
// Batch 4: the first round holds all 16 before its mark.
func TestHrev9RelayOrderedClaimSize(t *testing.T) {
	r := newOutboxRig(t)
	var msgs []pgstore.Message
	for k := range 4 {
		for i := range 4 {
			m := r.msg(fmt.Sprint(k, "-", i))
			m.OrderKey = fmt.Sprint("k", k)
			msgs = append(msgs, m)
		}
	}
	r.write(true, msgs...)
	var once sync.Once
	claimed := -1
	startRelay(t, r.ob, pgstore.RelayConfig{Ordered: true, Batch: 4, Concurrency: 4, PollInterval: 50 * time.Millisecond},
		func(rl *pgstore.Relay) {
			pgstore.SetBeforeMark(rl, func() {
				once.Do(func() {
					if err := r.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+
						pgx.Identifier{r.cfg.Schema, pgstore.DefaultOutboxTable}.Sanitize()+
						" WHERE state = 'p' AND claimed_by IS NOT NULL").Scan(&claimed); err != nil {
						t.Error(err)
					}
				})
			})
		})
	r.waitCount("s", 16, 10*time.Second)
	t.Logf("the first claim held %d rows, Batch 4", claimed)
	if claimed != 16 {
		t.Errorf("the first claim held %d rows, want 16 (4 heads, each with its 3 next rows)", claimed)
	}
}

// hrev9Listening returns how many server sessions of application name app
// still run a LISTEN, after waiting up to a second for none to.
func hrev9Listening(t *testing.T, r *outboxRig, app string) int {
	t.Helper()
	var listening int
	for range 50 {
		if err := r.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND query LIKE 'LISTEN%'`, app).Scan(&listening); err != nil {
			t.Fatal(err)
		}
		if listening == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return listening
}
