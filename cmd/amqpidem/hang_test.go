package main_test

import (
	"bytes"
	"context"
	"errors"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/internal/testenv/pgenv"
	"github.com/amqpidem/amqpidem/pgstore"
)

// runBin runs the binary with args; it returns stdout, stderr, the exit
// code and how long it took.
func runBin(t *testing.T, args ...string) (string, string, int, time.Duration) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	took := time.Since(start)
	code := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return stdout.String(), stderr.String(), code, took
}

// TestTimeoutBoundsDials: --timeout bounds the dial of a RabbitMQ node
// and of a Redis that accept the connection and never answer, and the
// error says which service timed out.
func TestTimeoutBoundsDials(t *testing.T) {
	s := testenv.NewSilentServer(t)
	const timeout = 2 * time.Second
	bound := 3*timeout + 2*time.Second
	t.Run("rabbitmq", func(t *testing.T) {
		_, errOut, code, took := runBin(t, "dlq", "list", "q", "--timeout", timeout.String(),
			"--amqp", "amqp://guest:guest@"+s.Addr()+"/")
		if code != 1 || took > bound {
			t.Fatalf("dlq list against a silent broker: exit %d after %v, want 1 within %v\n%s", code, took, bound, errOut)
		}
		if !strings.Contains(errOut, "RabbitMQ at") || !strings.Contains(errOut, "--timeout") {
			t.Errorf("the error does not say that RabbitMQ timed out:\n%s", errOut)
		}
	})
	t.Run("redis", func(t *testing.T) {
		_, errOut, code, took := runBin(t, "inspect", "k", "--queue", "q", "--timeout", timeout.String(),
			"--redis", "redis://"+s.Addr()+"/0")
		// Tighter than bound: go-redis's own dial timeout is 5 s.
		if bound := timeout + 2*time.Second; code != 1 || took > bound {
			t.Fatalf("inspect against a silent Redis: exit %d after %v, want 1 within %v\n%s", code, took, bound, errOut)
		}
		if !strings.Contains(errOut, "Redis at") {
			t.Errorf("the error does not say that Redis failed:\n%s", errOut)
		}
	})
}

// TestSecondInterruptExits: a second SIGINT ends the command at once,
// whatever it waits for.
func TestSecondInterruptExits(t *testing.T) {
	s := testenv.NewSilentServer(t)
	cmd := exec.Command(bin, "dlq", "list", "q", "--timeout", "60s", "--amqp", "amqp://guest:guest@"+s.Addr()+"/")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	time.Sleep(500 * time.Millisecond) // the dial is under way
	_ = cmd.Process.Signal(syscall.SIGINT)
	time.Sleep(200 * time.Millisecond)
	_ = cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		_ = cmd.Process.Kill()
		<-exited
		t.Fatalf("still running 5 s after a second SIGINT\n%s", stderr.String())
	}
}

// TestRelaySilentBroker: a relay whose broker accepts and never answers
// says so while it waits, and a SIGINT stops it within the 30 s its help
// promises (here much sooner: the publish in flight gives up with it).
// TestRelaySilentBroker: a relay whose broker accepts and never answers
// gives up on the dial within --timeout and says so, logs that it stops
// on SIGINT, and stops soon, the row still pending.
func TestRelaySilentBroker(t *testing.T) {
	pool := pgenv.Pool(t, 4)
	ctx := context.Background()
	cfg, ob := outboxSchema(t, pool)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ob.Write(ctx, tx, pgstore.Message{RoutingKey: "nowhere", Publishing: amqp.Publishing{Body: []byte("x")}}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	s := testenv.NewSilentServer(t)
	const timeout = 2 * time.Second
	cmd := exec.Command(bin, "relay", "--timeout", timeout.String(), "--postgres", pgenv.DSN(t), "--pg-schema", cfg.Schema,
		"--amqp", "amqp://guest:guest@"+s.Addr()+"/")
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	// The dial gives up after --timeout, and the relay says why: before,
	// nothing was said until the publish's own 10 s ran out.
	for !strings.Contains(stderr.String(), "--timeout") {
		if time.Since(start) > 2*timeout+2*time.Second {
			t.Fatalf("after %v, the relay has not said that the broker did not answer within --timeout:\n%s", time.Since(start), stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	// SIGINT in the middle of the next round's dial (after a backoff
	// of about a second).
	time.Sleep(1500 * time.Millisecond)
	sig := time.Now()
	_ = cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-exited:
	case <-time.After(40 * time.Second):
		t.Fatalf("still running 40 s after SIGINT:\n%s", stderr.String())
	}
	took := time.Since(sig)
	t.Logf("stopped %v after SIGINT:\n%s", took, stderr.String())
	if bound := 2*timeout + time.Second; took > bound {
		t.Errorf("SIGINT took %v to stop the relay, want under %v", took, bound)
	}
	if !strings.Contains(stderr.String(), "stopping") {
		t.Errorf("the relay did not say that it was stopping:\n%s", stderr.String())
	}
	if n, _, err := ob.Backlog(ctx); err != nil || n != 1 {
		t.Errorf("backlog after the relay stopped: %d %v, want the row still pending", n, err)
	}
}

// lockedBuffer is a bytes.Buffer safe to read while a process writes it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
