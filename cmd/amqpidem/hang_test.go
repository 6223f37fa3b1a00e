package main_test

import (
	"bytes"
	"errors"
	"net"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// silentServer is a TCP server on loopback that accepts connections and
// never answers: a RabbitMQ node, or a Redis, that hangs.
type silentServer struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func newSilentServer(t *testing.T) *silentServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &silentServer{ln: ln}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns = append(s.conns, c)
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-done
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, c := range s.conns {
			_ = c.Close()
		}
	})
	return s
}

func (s *silentServer) addr() string { return s.ln.Addr().String() }

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
	s := newSilentServer(t)
	const timeout = 2 * time.Second
	bound := 3*timeout + 2*time.Second
	t.Run("rabbitmq", func(t *testing.T) {
		_, errOut, code, took := runBin(t, "dlq", "list", "q", "--timeout", timeout.String(),
			"--amqp", "amqp://guest:guest@"+s.addr()+"/")
		if code != 1 || took > bound {
			t.Fatalf("dlq list against a silent broker: exit %d after %v, want 1 within %v\n%s", code, took, bound, errOut)
		}
		if !strings.Contains(errOut, "RabbitMQ at") || !strings.Contains(errOut, "--timeout") {
			t.Errorf("the error does not say that RabbitMQ timed out:\n%s", errOut)
		}
	})
	t.Run("redis", func(t *testing.T) {
		_, errOut, code, took := runBin(t, "inspect", "k", "--queue", "q", "--timeout", timeout.String(),
			"--redis", "redis://"+s.addr()+"/0")
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
	s := newSilentServer(t)
	cmd := exec.Command(bin, "dlq", "list", "q", "--timeout", "60s", "--amqp", "amqp://guest:guest@"+s.addr()+"/")
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
