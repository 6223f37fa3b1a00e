package testenv

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

func TestSkipMissing(t *testing.T) {
	tests := []struct {
		short bool
		ci    string
		want  bool
	}{
		{short: false, ci: "", want: false},
		{short: false, ci: "true", want: false},
		{short: true, ci: "", want: true},
		{short: true, ci: "false", want: true},
		{short: true, ci: "true", want: false},
	}
	for _, tt := range tests {
		if got := skipMissing(tt.short, tt.ci); got != tt.want {
			t.Errorf("skipMissing(%v, %q): got %v, want %v", tt.short, tt.ci, got, tt.want)
		}
	}
}

// TestProbeDockerDoesNotHang points testcontainers at a socket that accepts
// connections and never answers: the probe must give up on time. It runs the
// probe in a child process, because testcontainers caches the Docker host it
// finds for the life of the process.
func TestProbeDockerDoesNotHang(t *testing.T) {
	if os.Getenv("TESTENV_HANGING_DOCKER") == "1" {
		start := time.Now()
		err := probeDocker(300 * time.Millisecond)
		if got, max := time.Since(start), 2*time.Second; got > max {
			t.Fatalf("probeDocker took %v, want at most %v", got, max)
		}
		if err == nil {
			t.Skip("a Docker engine answered: testcontainers is configured to use another host than DOCKER_HOST")
		}
		t.Logf("probeDocker: %v", err)
		return
	}

	sock := filepath.Join(t.TempDir(), "docker.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Skipf("no unix sockets here: %v", err)
	}
	var conns []net.Conn
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-accepted
		for _, c := range conns {
			c.Close()
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	child := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestProbeDockerDoesNotHang$", "-test.v", "-test.count=1")
	child.Env = append(os.Environ(), "TESTENV_HANGING_DOCKER=1", "DOCKER_HOST=unix://"+sock)
	out, err := child.CombinedOutput()
	if err != nil {
		t.Fatalf("probe in child process: %v\n%s", err, out)
	}
	t.Logf("child process:\n%s", out)
}

func TestCommand(t *testing.T) {
	addr := RedisAddr(t)
	tests := []struct {
		args    []string
		want    string
		wantErr bool
	}{
		{args: []string{"PING"}, want: "PONG"},
		{args: []string{"ECHO", "a b\r\nc"}, want: "a b\r\nc"},
		{args: []string{"EXISTS", Name(t)}, want: "0"},
		{args: []string{"NOSUCHCOMMAND"}, wantErr: true},
	}
	for _, tt := range tests {
		got, err := command(addr, time.Second, tt.args...)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("command(%q): got %q, %v; want %q, error %v", tt.args, got, err, tt.want, tt.wantErr)
		}
	}
}
