package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testrun"
	"github.com/amqpidem/amqpidem/lock"
)

// bin is the amqpidem binary the tests drive, built once by TestMain.
var bin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "amqpidem-cli")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "amqpidem")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building the binary: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// rig is a queue with an amqpidem consumer on the local services, and the
// flags that point the binary at them.
type rig struct {
	t      *testing.T
	queue  string
	prefix string
	flags  []string
	store  *lock.RedisStore
	conn   *amqp.Connection
	pub    *amqpidem.Publisher
	events chan amqpidem.Event

	broken   atomic.Bool   // the handler fails for good while set
	slowDone chan struct{} // closed when the test ends: the handler of "slow" returns
	mu       sync.Mutex
	runs     map[string]int // executions per key once fixed
}

func newRig(t *testing.T, concurrency int) *rig {
	t.Helper()
	return newRigWith(t, concurrency, nil)
}

// newRigWith is newRig with the consumer's Config changed by edit.
func newRigWith(t *testing.T, concurrency int, edit func(*amqpidem.Config)) *rig {
	t.Helper()
	url := testenv.AMQPURL(t)
	r := &rig{t: t, queue: testenv.Name(t), events: make(chan amqpidem.Event, 10000), runs: map[string]int{},
		slowDone: make(chan struct{})}
	r.prefix = "cli-" + r.queue
	r.flags = []string{"--redis", "redis://" + testenv.RedisAddr(t) + "/0", "--amqp", url, "--prefix", r.prefix}
	var err error
	if r.store, err = lock.NewRedisStore(testenv.RedisClient(t), lock.Config{Prefix: r.prefix}); err != nil {
		t.Fatal(err)
	}
	if r.conn, err = amqp.Dial(url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.conn.Close() })
	ch, err := r.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(r.queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	testenv.DeleteQueues(t, url, r.queue, r.queue+".dlq")
	r.pub = amqpidem.NewPublisher(r.conn)
	t.Cleanup(r.pub.Close)
	r.broken.Store(true)
	cfg := amqpidem.Config{Queue: r.queue, Logger: slog.New(slog.DiscardHandler), SigningKey: []byte(rigSigningKey),
		Observer: amqpidem.ObserverFunc(func(_ context.Context, e amqpidem.Event) { r.events <- e })}
	if edit != nil {
		edit(&cfg)
	}
	c, err := amqpidem.NewConsumer(r.store, amqpidem.ConsumerConfig{URL: url, Concurrency: concurrency, Prefetch: 2 * concurrency,
		Config: cfg},
		amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			if d.MessageId == "slow" {
				select {
				case <-ctx.Done():
					return nil, ctx.Err()
				case <-r.slowDone:
					return nil, nil
				}
			}
			if r.broken.Load() {
				return nil, amqpidem.Permanent(errors.New("card declined"))
			}
			r.mu.Lock()
			r.runs[d.MessageId]++
			r.mu.Unlock()
			return []byte(`{"receipt":"rcpt-` + d.MessageId + `"}`), nil
		}))
	if err != nil {
		t.Fatal(err)
	}
	testrun.Consumer(t, c)
	t.Cleanup(func() { close(r.slowDone) }) // before the Shutdown above
	return r
}

func (r *rig) publish(ids ...string) {
	r.t.Helper()
	for _, id := range ids {
		if err := r.pub.Publish(context.Background(), "", r.queue, amqp.Publishing{MessageId: id, Body: []byte("pay " + id)}); err != nil {
			r.t.Fatal(err)
		}
	}
}

// waitOutcomes waits until n events of outcome o have been seen.
func (r *rig) waitOutcomes(o amqpidem.Outcome, n int) {
	r.t.Helper()
	deadline := time.After(60 * time.Second)
	for seen := 0; seen < n; {
		select {
		case e := <-r.events:
			if e.Outcome == o {
				seen++
			}
		case <-deadline:
			r.t.Fatalf("saw %d of %d %v outcomes in 60s", seen, n, o)
		}
	}
}

// rigSigningKey is the rig's consumers' Config.SigningKey, given to the
// binary in AMQPIDEM_SIGNING_KEY.
const rigSigningKey = "rig-signing-key-0123456789"

// cli runs the binary with args and the rig's flags (and signing key); it
// returns stdout, stderr and the exit code.
func (r *rig) cli(args ...string) (string, string, int) {
	r.t.Helper()
	cmd := exec.Command(bin, append(args, r.flags...)...)
	cmd.Env = append(os.Environ(), "AMQPIDEM_SIGNING_KEY="+rigSigningKey)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		r.t.Fatal(err)
	}
	return stdout.String(), stderr.String(), code
}

// mustCLI runs the binary and fails the test unless it exits with code.
func (r *rig) mustCLI(code int, args ...string) string {
	r.t.Helper()
	out, errOut, got := r.cli(args...)
	if got != code {
		r.t.Fatalf("amqpidem %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), got, code, out, errOut)
	}
	return out
}

func (r *rig) dlqLen() int {
	r.t.Helper()
	return r.dlq().Messages
}

// dlq is the dead-letter queue's state: its ready messages (not those
// delivered and unacked) and its consumers.
func (r *rig) dlq() amqp.Queue {
	r.t.Helper()
	ch, err := r.conn.Channel()
	if err != nil {
		r.t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(r.queue+".dlq", true, false, false, false, nil)
	if err != nil {
		r.t.Fatal(err)
	}
	return q
}

func TestDeadLetterListedReplayedExecutedOnce(t *testing.T) {
	r := newRig(t, 4)
	r.publish("pay-1", "pay-2")
	r.waitOutcomes(amqpidem.DeadLettered, 2)

	var list []struct {
		Key, Reason, Error string
		Attempts           int
		OriginalRoutingKey string `json:"original_routing_key"`
	}
	out := r.mustCLI(0, "dlq", "list", r.queue, "--json")
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		t.Fatalf("dlq list --json: %v\n%s", err, out)
	}
	if len(list) != 2 || list[0].Key == list[1].Key {
		t.Fatalf("dlq list: %+v, want pay-1 and pay-2", list)
	}
	for _, dl := range list {
		if (dl.Key != "pay-1" && dl.Key != "pay-2") || dl.Reason != "permanent failure" || dl.OriginalRoutingKey != r.queue ||
			!strings.Contains(dl.Error, "card declined") || dl.Attempts != 1 {
			t.Fatalf("dlq list: %+v", list)
		}
	}
	if n := r.dlqLen(); n != 2 {
		t.Fatalf("after list, %d dead letters, want both still there", n)
	}
	text := r.mustCLI(0, "dlq", "list", r.queue)
	if !strings.Contains(text, "2 dead letters") || !strings.Contains(text, "pay-2") || !strings.Contains(text, "permanent failure") {
		t.Fatalf("dlq list:\n%s", text)
	}
	// The queue named as inspect names it lists the same.
	for _, flag := range []string{"--queue", "-q"} {
		if got := r.mustCLI(0, "dlq", "list", flag, r.queue); got != text {
			t.Fatalf("dlq list %s Q:\n%s\nwant what dlq list Q printed:\n%s", flag, got, text)
		}
	}

	var rec struct{ State, Error, Location string }
	out = r.mustCLI(0, "inspect", "pay-1", "--queue", r.queue, "--json")
	if err := json.Unmarshal([]byte(out), &rec); err != nil || rec.State != "failed" || !strings.Contains(rec.Error, "card declined") ||
		!strings.HasPrefix(rec.Location, "redis key "+r.prefix+":{") {
		t.Fatalf("inspect: %v %+v\n%s", err, rec, out)
	}

	// Replayed without --forget, the failed record would dead-letter it
	// again: replay leaves it, and says why.
	out = r.mustCLI(4, "dlq", "replay", r.queue, "--key", "pay-1")
	if !strings.Contains(out, "record failed") {
		t.Fatalf("replay without --forget:\n%s", out)
	}
	r.mustCLI(0, "dlq", "replay", r.queue, "--all", "--forget", "--dry-run")
	if n := r.dlqLen(); n != 2 {
		t.Fatalf("after a dry run, %d dead letters, want 2", n)
	}
	// The binary's stdin (/dev/null) is not a terminal: --all --forget
	// needs --yes, and without it nothing is forgotten or replayed.
	_, errOut, code := r.cli("dlq", "replay", r.queue, "--all", "--forget")
	if code != 2 || !strings.Contains(errOut, "replay the 2 dead letters in "+r.queue+".dlq") || !strings.Contains(errOut, "add --yes") {
		t.Fatalf("replay --all --forget without --yes: exit %d\n%s", code, errOut)
	}
	if n := r.dlqLen(); n != 2 {
		t.Fatalf("after a replay without --yes, %d dead letters, want 2", n)
	}
	if out := r.mustCLI(0, "inspect", "pay-1", "--queue", r.queue); !strings.Contains(out, "failed") {
		t.Fatalf("after a replay without --yes, the record of pay-1:\n%s", out)
	}

	r.broken.Store(false) // the cause is fixed
	out = r.mustCLI(0, "dlq", "replay", r.queue, "--key", "pay-1", "--forget")
	if !strings.Contains(out, "1 replayed") {
		t.Fatalf("replay:\n%s", out)
	}
	r.waitOutcomes(amqpidem.Completed, 1)
	if n := r.dlqLen(); n != 1 {
		t.Fatalf("after replaying pay-1, %d dead letters, want pay-2 alone", n)
	}
	r.mustCLI(3, "dlq", "replay", r.queue, "--key", "pay-1", "--forget") // nothing left of pay-1
	out = r.mustCLI(0, "inspect", "pay-1", "--queue", r.queue)
	if !strings.Contains(out, "completed") || !strings.Contains(out, "rcpt-pay-1") {
		t.Fatalf("inspect after replay:\n%s", out)
	}
	r.mu.Lock()
	runs := r.runs["pay-1"]
	r.mu.Unlock()
	if runs != 1 {
		t.Fatalf("pay-1 ran %d times after the fix, want 1", runs)
	}

	// forget: refuses a live lease unless --force, deletes what it read.
	r.publish("slow")
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, _, code := r.cli("inspect", "slow", "--queue", r.queue, "--json")
		if code == 0 && strings.Contains(out, `"live": true`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("slow never held: %d %s", code, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, errOut, code = r.cli("forget", "slow", "--queue", r.queue)
	if code != 4 || !strings.Contains(errOut, "live") {
		t.Fatalf("forget of a live lease: exit %d, %s", code, errOut)
	}
	r.mustCLI(0, "forget", "slow", "--queue", r.queue, "--force")
	out = r.mustCLI(0, "forget", "pay-1", "--queue", r.queue, "--dry-run")
	if !strings.Contains(out, "would forget the completed record") || !strings.Contains(out, "nothing changed") {
		t.Fatalf("forget --dry-run:\n%s", out)
	}
	r.mustCLI(0, "inspect", "pay-1", "--queue", r.queue) // still there
	out = r.mustCLI(0, "forget", "pay-1", "--queue", r.queue)
	if !strings.Contains(out, "forgot the completed record") {
		t.Fatalf("forget:\n%s", out)
	}
	r.mustCLI(3, "inspect", "pay-1", "--queue", r.queue)
	r.mustCLI(2, "inspect", "pay-1") // no --queue
}

// A replay of 1,000 dead letters killed with SIGKILL at a random point, then
// run again, loses none: every operation completes, each executed once.
func TestReplayKilledLosesNothing(t *testing.T) {
	const n = 1000
	r := newRig(t, 16)
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("op-%04d", i)
	}
	r.publish(ids...)
	r.waitOutcomes(amqpidem.DeadLettered, n)
	r.broken.Store(false)

	killAt := 1 + rand.IntN(n-100) // dead letters gone from the queue before the kill
	cmd := exec.Command(bin, append([]string{"dlq", "replay", r.queue, "--all", "--forget", "--yes"}, r.flags...)...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	killed := false
	for !killed {
		select {
		case err := <-exited:
			t.Fatalf("replay exited (%v) before the kill at %d dead letters", err, killAt)
		default:
		}
		if r.dlqLen() <= n-killAt {
			_ = cmd.Process.Signal(syscall.SIGKILL)
			<-exited
			killed = true
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("killed after %d of %d dead letters were removed", n-r.dlqLen(), n)
	// The dead letters the killed run had been delivered and not acked go
	// back to the queue once the broker sees its connection gone (its
	// consumer with it): a second run started before that would find
	// only the rest, and the others would stay dead letters (under load,
	// CI saw "258 of 1000 operations executed": 742 still held).
	for deadline := time.Now().Add(30 * time.Second); r.dlq().Consumers > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the killed replay's consumer is still on the dead-letter queue after 30 s")
		}
	}

	// Run again until nothing is left to replay: a second run leaves the
	// dead letters whose copy the killed run published (their work is done).
	out, errOut, code := r.cli("dlq", "replay", r.queue, "--all", "--forget", "--yes", "--json")
	if code != 0 && code != 4 {
		t.Fatalf("second replay: exit %d\n%s\n%s", code, out, errOut)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		r.mu.Lock()
		done := len(r.runs)
		r.mu.Unlock()
		if done == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d operations executed after the replays", done, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // let duplicates in flight settle
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range ids {
		if r.runs[id] != 1 {
			t.Errorf("%s executed %d times after the fix, want 1", id, r.runs[id])
		}
	}
	var left []struct {
		Key, Action, Why string
	}
	if err := json.Unmarshal([]byte(out), &left); err != nil {
		t.Fatal(err)
	}
	for _, l := range left {
		if l.Action == "left" && !strings.Contains(l.Why, "completed") {
			t.Errorf("second replay left %s: %s", l.Key, l.Why)
		}
	}
}
