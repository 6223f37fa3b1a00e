package main

import (
	"bytes"
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// stdio is the stdin run is given: a terminal answering answer, or not
// a terminal.
type stdio struct {
	terminal bool
	answer   string
}

// runWith runs the command line args with stdin in; it returns stdout,
// stderr and the exit code.
func runWith(in stdio, args ...string) (string, string, int) {
	var stdout, stderr bytes.Buffer
	code := runWithStdin(context.Background(), args, strings.NewReader(in.answer), in.terminal, &stdout, &stderr)
	return stdout.String(), stderr.String(), code
}

// relay redrive --all asks on a terminal and needs --yes otherwise;
// --dry-run lists what it would re-drive. Nothing changes unless the
// operator said yes.
func TestRelayRedriveConsent(t *testing.T) {
	pool := pgenv.Pool(t, 2)
	ctx := context.Background()
	cfg := pgstore.Config{Schema: strings.ToLower(testenv.Name(t)), CleanupInterval: -1}
	if err := pgstore.Migrate(ctx, pool, cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	})
	ob, err := pgstore.NewOutbox(pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"nowhere-1", "nowhere-2"} {
		if _, err := ob.Write(ctx, tx, pgstore.Message{RoutingKey: key, Publishing: amqp.Publishing{MessageId: key}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Dead, as a relay leaves what the broker refused MaxAttempts times.
	if _, err := pool.Exec(ctx, "UPDATE "+pgx.Identifier{cfg.Schema, "amqpidem_outbox"}.Sanitize()+" SET state = 'd', attempts = 1"); err != nil {
		t.Fatal(err)
	}
	rows, err := ob.List(ctx, "dead", 0, 10)
	if err != nil || len(rows) != 2 {
		t.Fatalf("dead rows: %v %v", rows, err)
	}
	flags := []string{"--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema}
	dead := func() int64 {
		t.Helper()
		n, err := ob.Dead(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	tests := []struct {
		name string
		in   stdio
		args []string
		code int
		out  []string // in stdout and stderr
		dead int64    // dead rows afterwards
	}{
		{name: "not a terminal, no --yes", args: []string{"--all"}, code: exitUsage, dead: 2,
			out: []string{"make all 2 dead rows of outbox table " + cfg.Schema + ".amqpidem_outbox pending again", "add --yes", "--dry-run"}},
		{name: "terminal, answered n", in: stdio{terminal: true, answer: "n\n"}, args: []string{"--all"}, code: exitRefused, dead: 2,
			out: []string{"2 dead rows", "Go ahead? [y/N]", "not confirmed: nothing changed"}},
		{name: "terminal, no answer", in: stdio{terminal: true}, args: []string{"--all"}, code: exitRefused, dead: 2,
			out: []string{"not confirmed"}},
		{name: "terminal, answered yess", in: stdio{terminal: true, answer: "yess\n"}, args: []string{"--all"}, code: exitRefused, dead: 2},
		{name: "--dry-run --all", args: []string{"--all", "--dry-run"}, dead: 2,
			out: []string{"nowhere-1", "nowhere-2", "2 dead rows of " + cfg.Schema + ".amqpidem_outbox would be pending again (--dry-run: nothing changed)"}},
		{name: "--dry-run ID", args: []string{"--dry-run", itoa(rows[1].ID), "999999"}, dead: 2,
			out: []string{"nowhere-2", "1 dead row of"}},
		{name: "--dry-run ID not dead", args: []string{"--dry-run", "999999"}, code: exitNotFound, dead: 2,
			out: []string{"0 dead rows of", "no dead row to re-drive"}},
		{name: "an ID: not asked", args: []string{itoa(rows[0].ID)}, dead: 1, out: []string{"1 dead row pending again"}},
		{name: "terminal, answered yes", in: stdio{terminal: true, answer: "Yes\n"}, args: []string{"--all"}, dead: 0,
			out: []string{"1 dead row of outbox table", "1 dead row pending again"}},
		{name: "nothing dead: nothing asked", args: []string{"--all"}, code: exitNotFound, dead: 0,
			out: []string{"no dead row to re-drive"}},
	}
	for _, tt := range tests {
		stdout, stderr, code := runWith(tt.in, append(append([]string{"relay", "redrive"}, tt.args...), flags...)...)
		if code != tt.code {
			t.Fatalf("%s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", tt.name, code, tt.code, stdout, stderr)
		}
		for _, want := range tt.out {
			if !strings.Contains(stdout+stderr, want) {
				t.Errorf("%s: no %q in\nstdout:\n%s\nstderr:\n%s", tt.name, want, stdout, stderr)
			}
		}
		if got := dead(); got != tt.dead {
			t.Fatalf("%s: %d dead rows afterwards, want %d", tt.name, got, tt.dead)
		}
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// dlq replay --all --forget asks before it takes a dead letter, or needs
// --yes; answered no, every dead letter stays and nothing is published.
func TestDLQReplayAllForgetConsent(t *testing.T) {
	queue := testenv.Name(t)
	url := testenv.AMQPURL(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { testenv.DeleteQueues(t, url, queue, queue+".dlq") })
	for _, q := range []string{queue, queue + ".dlq"} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, id := range []string{"a-1", "a-2", "a-3"} {
		if err := ch.Publish("", queue+".dlq", false, false, amqp.Publishing{MessageId: id, Body: []byte(id)}); err != nil {
			t.Fatal(err)
		}
	}
	prefix := "cli-" + queue
	flags := []string{"--amqp", url, "--redis", "redis://" + testenv.RedisAddr(t) + "/0", "--prefix", prefix}
	count := func(q string) int {
		t.Helper()
		deadline := time.Now().Add(2 * time.Second)
		for {
			st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			if st.Messages == 3 || time.Now().After(deadline) {
				return st.Messages
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	for _, tt := range []struct {
		name string
		in   stdio
		code int
		out  []string
	}{
		{name: "not a terminal", code: exitUsage,
			out: []string{"replay the 3 dead letters in " + queue + ".dlq to " + queue, "deleting the failed record", "add --yes"}},
		{name: "terminal, answered n", in: stdio{terminal: true, answer: "n\n"}, code: exitRefused,
			out: []string{"3 dead letters", "Go ahead? [y/N]", "not confirmed"}},
	} {
		stdout, stderr, code := runWith(tt.in, append([]string{"dlq", "replay", queue, "--all", "--forget"}, flags...)...)
		if code != tt.code {
			t.Fatalf("%s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", tt.name, code, tt.code, stdout, stderr)
		}
		for _, want := range tt.out {
			if !strings.Contains(stdout+stderr, want) {
				t.Errorf("%s: no %q in\nstdout:\n%s\nstderr:\n%s", tt.name, want, stdout, stderr)
			}
		}
		if n := count(queue + ".dlq"); n != 3 {
			t.Fatalf("%s: %d dead letters left, want 3", tt.name, n)
		}
		if st, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err != nil || st.Messages != 0 {
			t.Fatalf("%s: %d messages replayed to %s (%v)", tt.name, st.Messages, queue, err)
		}
	}
	// --dry-run asks nothing, changes nothing.
	stdout, stderr, code := runWith(stdio{}, append([]string{"dlq", "replay", queue, "--all", "--forget", "--dry-run"}, flags...)...)
	if code != exitOK || !strings.Contains(stdout, "0 replayed, 3 would replay, 0 left") {
		t.Fatalf("--dry-run: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if n := count(queue + ".dlq"); n != 3 {
		t.Fatalf("--dry-run: %d dead letters left, want 3", n)
	}
}

// outbox redrive without --index asks, or needs --yes; answered no, it
// publishes nothing and the record stays as it was.
func TestOutboxRedriveConsent(t *testing.T) {
	values := stagedValues(t)
	for _, tt := range []struct {
		name    string
		in      stdio
		f       redriveFlags
		code    int
		out     string
		sent    string
		actions string
	}{
		{name: "not a terminal", f: redriveFlags{}, code: exitUsage,
			out: `publish again 2 staged messages of key "k" on q, to exchange "" routing key`},
		{name: "terminal, answered n", in: stdio{terminal: true, answer: "no\n"}, code: exitRefused, out: "Go ahead? [y/N]"},
		{name: "terminal, answered y", in: stdio{terminal: true, answer: "y\n"}, sent: "m1 m3", actions: "1:redriven 3:redriven"},
		{name: "--yes", f: redriveFlags{yes: true}, sent: "m1 m3", actions: "1:redriven 3:redriven"},
		{name: "--index: named, not asked", f: redriveFlags{indexes: []int{3}}, sent: "m3", actions: "3:redriven"},
		{name: "--dry-run: not asked", f: redriveFlags{dryRun: true}, actions: "1:would redrive 3:would redrive"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, skey := completedWith(t, withStates(t, values[4], published, returned, pending, returned))
			var stdout, stderr bytes.Buffer
			o := &options{stdout: &stdout, stderr: &stderr, timeout: 5 * time.Second, json: true, redisURL: "redis://test",
				stdin: strings.NewReader(tt.in.answer), stdinTerminal: tt.in.terminal}
			pub := &fakePublisher{}
			r := &redriver{o: o, k: &keyFlags{queue: "q"}, key: "k", skey: skey, admin: s, amender: s, f: &tt.f, pub: pub}
			err := r.run(context.Background())
			if got := exitCode(err); got != tt.code {
				t.Fatalf("exit code %d, want %d (%v)", got, tt.code, err)
			}
			if !strings.Contains(stderr.String()+" "+errString(err), tt.out) {
				t.Fatalf("no %q in %q / %v", tt.out, stderr.String(), err)
			}
			if got := strings.Join(pub.sent, " "); got != tt.sent {
				t.Fatalf("published %q, want %q", got, tt.sent)
			}
			want := "published,returned,pending,returned"
			if tt.sent != "" {
				want = "published,published,pending,published"
				if tt.sent == "m3" {
					want = "published,returned,pending,published"
				}
			}
			if got := statesOf(t, s, skey); got != want {
				t.Fatalf("record: %s, want %s", got, want)
			}
		})
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
