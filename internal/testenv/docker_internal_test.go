package testenv

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// isolateDocker points the Docker discovery at nothing but what the test
// sets: no DOCKER_HOST, a HOME without ~/.testcontainers.properties or
// Docker Desktop sockets, no XDG_RUNTIME_DIR. /var/run/docker.sock and
// /run/user/<uid>/docker.sock stay: tests that must not find an engine skip
// when one answers there.
func isolateDocker(t *testing.T) (home string) {
	t.Helper()
	home = t.TempDir()
	t.Setenv("HOME", home)
	t.Setenv("DOCKER_HOST", "")
	t.Setenv("XDG_RUNTIME_DIR", "")
	return home
}

// shortTempDir returns a directory whose paths are short enough for a unix
// socket (at most 104 bytes on macOS).
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "te")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// listenUnix listens on a new unix socket and returns its unix:// URL.
func listenUnix(t *testing.T) (net.Listener, string) {
	t.Helper()
	sock := filepath.Join(shortTempDir(t), "d.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Skipf("no unix sockets here: %v", err)
	}
	t.Cleanup(func() { l.Close() })
	return l, "unix://" + sock
}

// TestProbeDockerDoesNotHang points the probe at a socket that accepts
// connections and never answers: it must give up on time.
func TestProbeDockerDoesNotHang(t *testing.T) {
	isolateDocker(t)
	l, host := listenUnix(t)
	var mu sync.Mutex
	var conns []net.Conn
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-accepted
		for _, c := range conns {
			c.Close()
		}
	})
	t.Setenv("DOCKER_HOST", host)

	start := time.Now()
	err := probeDocker(300 * time.Millisecond)
	if got, max := time.Since(start), 2*time.Second; got > max {
		t.Fatalf("probeDocker took %v, want at most %v", got, max)
	}
	if err == nil {
		t.Skip("a Docker engine answered at the default socket")
	}
	if !strings.Contains(err.Error(), host) || !strings.Contains(err.Error(), "in time") {
		t.Fatalf("probeDocker: got %v, want it to name %s and say it got no answer in time", err, host)
	}
	t.Logf("probeDocker: %v", err)
}

// TestProbeDockerAnswers serves the engine's /_ping on a unix socket.
func TestProbeDockerAnswers(t *testing.T) {
	isolateDocker(t)
	l, host := listenUnix(t)
	status := http.StatusOK
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/_ping" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(status)
		fmt.Fprint(w, "OK")
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	t.Setenv("DOCKER_HOST", host)

	if err := probeDocker(5 * time.Second); err != nil {
		t.Fatalf("probeDocker with an engine at %s: %v", host, err)
	}
	status = http.StatusInternalServerError
	if err := probeDocker(5 * time.Second); err == nil {
		t.Skip("a Docker engine answered at the default socket")
	} else if !strings.Contains(err.Error(), "500") {
		t.Fatalf("probeDocker with an engine answering 500: got %v, want the status", err)
	}
}

func TestProbeDockerNoSocket(t *testing.T) {
	isolateDocker(t)
	t.Setenv("DOCKER_HOST", "unix:///nonexistent/testenv/docker.sock")
	err := probeDocker(time.Second)
	if err == nil {
		t.Skip("a Docker engine answered at the default socket")
	}
	if !strings.Contains(err.Error(), "/nonexistent/testenv/docker.sock") {
		t.Fatalf("probeDocker: got %v, want it to name DOCKER_HOST's socket", err)
	}

	t.Setenv("DOCKER_HOST", "")
	if hosts, _ := dockerHosts(); len(hosts) > 0 {
		t.Skipf("Docker sockets exist here: %v", hosts)
	}
	err = probeDocker(time.Second)
	if err == nil || !strings.Contains(err.Error(), "DOCKER_HOST is not set and there is no Docker socket (looked for /var/run/docker.sock") {
		t.Fatalf("probeDocker without any socket: got %v, want the sockets looked for", err)
	}
}

// TestDockerHosts checks the order of testcontainers-go: tc.host, DOCKER_HOST,
// the default socket, docker.host, the rootless sockets.
func TestDockerHosts(t *testing.T) {
	home := isolateDocker(t)
	props := "# comment\n tc.host = tcp://tc.example:2375 \ndocker.host=unix:///from/properties.sock\nother=x\n"
	if err := os.WriteFile(filepath.Join(home, ".testcontainers.properties"), []byte(props), 0o644); err != nil {
		t.Fatal(err)
	}
	desktop := filepath.Join(home, ".docker", "run", "docker.sock")
	if err := os.MkdirAll(filepath.Dir(desktop), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(desktop, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_HOST", "unix:///from/env.sock")

	hosts, looked := dockerHosts()
	want := []string{"tcp://tc.example:2375", "unix:///from/env.sock"}
	if _, err := os.Stat("/var/run/docker.sock"); err == nil {
		want = append(want, "unix:///var/run/docker.sock")
	}
	want = append(want, "unix:///from/properties.sock", "unix://"+desktop)
	if got := hosts[:min(len(hosts), len(want))]; !slices.Equal(got, want) {
		t.Fatalf("dockerHosts: got %q, want it to start with %q", hosts, want)
	}
	if !slices.Contains(looked, "/var/run/docker.sock") || !slices.Contains(looked, desktop) {
		t.Fatalf("dockerHosts looked for %q, want /var/run/docker.sock and %s among them", looked, desktop)
	}
}

func TestMissingOutcome(t *testing.T) {
	tests := []struct {
		short    bool
		ci       string
		wantSkip bool
		wantNote string
	}{
		{short: false, ci: "", wantSkip: false, wantNote: "go test -short skips"},
		{short: true, ci: "", wantSkip: true, wantNote: "skipped because of -short"},
		{short: true, ci: "true", wantSkip: false, wantNote: "CI=true: a missing service or program is a failure"},
		{short: false, ci: "true", wantSkip: false, wantNote: "CI=true: a missing service or program is a failure"},
	}
	for _, tt := range tests {
		skip, note := missingOutcome(tt.short, tt.ci)
		if skip != tt.wantSkip || !strings.Contains(note, tt.wantNote) {
			t.Errorf("missingOutcome(%v, %q): got %v, %q; want %v and a note with %q", tt.short, tt.ci, skip, note, tt.wantSkip, tt.wantNote)
		}
	}
}

// recordingTB records how a test ended instead of ending it.
type recordingTB struct {
	testing.TB
	mu      sync.Mutex
	skipped bool
	failed  bool
	msg     string
}

func (r *recordingTB) Helper() {}

func (r *recordingTB) Skipf(format string, args ...any) {
	r.mu.Lock()
	r.skipped, r.msg = true, fmt.Sprintf(format, args...)
	r.mu.Unlock()
	runtime.Goexit()
}

func (r *recordingTB) Fatalf(format string, args ...any) {
	r.mu.Lock()
	r.failed, r.msg = true, fmt.Sprintf(format, args...)
	r.mu.Unlock()
	runtime.Goexit()
}

// ending runs f with r on a goroutine of its own, as f may call
// runtime.Goexit.
func (r *recordingTB) ending(f func(testing.TB)) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
}

// TestLookPathMissing checks what a test that needs a missing Redis program
// is told.
func TestLookPathMissing(t *testing.T) {
	for _, ci := range []string{"", "true"} {
		t.Run("CI="+ci, func(t *testing.T) {
			t.Setenv("CI", ci)
			r := &recordingTB{TB: t}
			r.ending(func(tb testing.TB) { lookPath(tb, "testenv-no-such-redis-server") })
			if testing.Short() && ci != "true" {
				if !r.skipped {
					t.Fatalf("lookPath of a missing program under -short: not skipped")
				}
			} else if !r.failed {
				t.Fatalf("lookPath of a missing program: got skipped %v, want a failure", r.skipped)
			}
			for _, want := range []string{
				t.Name() + " needs the testenv-no-such-redis-server program on PATH",
				"runs only on a host with Redis installed",
				"cannot stand in for it",
				"apt-get install redis-server",
				"brew install redis",
			} {
				if !strings.Contains(r.msg, want) {
					t.Errorf("message lacks %q:\n%s", want, r.msg)
				}
			}
			if ci == "true" && !strings.Contains(r.msg, "CI=true: a missing service or program is a failure") {
				t.Errorf("message under CI=true lacks why it fails:\n%s", r.msg)
			}
		})
	}
}

// fakeTarget is a service found by the probe only at "good".
func fakeTarget() target {
	tg := redisTarget
	tg.envVar = "TESTENV_FAKE_ADDR"
	tg.local = "local:1"
	tg.probe = func(addr string) error {
		if addr == "good" {
			return nil
		}
		return errors.New("connection refused")
	}
	return tg
}

func TestResolve(t *testing.T) {
	noDocker := func() error { return errors.New("no socket here") }
	dockerCalled := func() error { t.Fatal("Docker probed although the environment variable is set"); return nil }

	t.Run("env", func(t *testing.T) {
		t.Setenv("TESTENV_FAKE_ADDR", "good")
		if addr, missing := resolve(fakeTarget(), dockerCalled); addr != "good" || missing != "" {
			t.Fatalf("resolve: got %q, %q; want good", addr, missing)
		}
	})
	t.Run("env unreachable: no fallback", func(t *testing.T) {
		t.Setenv("TESTENV_FAKE_ADDR", "bad")
		tg := fakeTarget()
		tg.local = "good" // answers, and must not be used
		addr, missing := resolve(tg, dockerCalled)
		if addr != "" {
			t.Fatalf("resolve: got %q, want nothing: TESTENV_FAKE_ADDR is set", addr)
		}
		for _, want := range []string{"TESTENV_FAKE_ADDR=bad does not answer PING: connection refused", "unset TESTENV_FAKE_ADDR"} {
			if !strings.Contains(missing, want) {
				t.Errorf("message lacks %q:\n%s", want, missing)
			}
		}
	})
	t.Run("local", func(t *testing.T) {
		t.Setenv("TESTENV_FAKE_ADDR", "")
		tg := fakeTarget()
		tg.local = "good"
		if addr, missing := resolve(tg, dockerCalled); addr != "good" || missing != "" {
			t.Fatalf("resolve: got %q, %q; want the local default", addr, missing)
		}
	})
	t.Run("no Docker", func(t *testing.T) {
		t.Setenv("TESTENV_FAKE_ADDR", "")
		addr, missing := resolve(fakeTarget(), noDocker)
		if addr != "" {
			t.Fatalf("resolve: got %q, want nothing", addr)
		}
		for _, want := range []string{
			"no Redis for the integration tests",
			"TESTENV_FAKE_ADDR is not set; local:1 does not answer PING (connection refused)",
			"no Docker engine for testcontainers (no socket here)",
			"make services",
			"docker compose up -d --wait",
			"set REDIS_ADDR=host:port", // the help is Redis's: the fake only renames the variable
		} {
			if !strings.Contains(missing, want) {
				t.Errorf("message lacks %q:\n%s", want, missing)
			}
		}
	})
}

// TestResolveRealNoDocker runs the real probes against addresses where
// nothing listens and a DOCKER_HOST where no engine is.
func TestResolveRealNoDocker(t *testing.T) {
	isolateDocker(t)
	t.Setenv("DOCKER_HOST", "unix:///nonexistent/testenv/docker.sock")
	if probeDocker(time.Second) == nil {
		t.Skip("a Docker engine answers here")
	}
	closed := closedAddr(t)
	for _, tt := range []struct {
		tg    target
		local string
		want  []string
	}{
		{redisTarget, closed, []string{"no Redis", "REDIS_ADDR is not set; " + closed + " does not answer PING", "redis-server --daemonize yes"}},
		{amqpTarget, "amqp://guest:guest@" + closed + "/", []string{"no RabbitMQ", "AMQP_URL is not set; amqp://guest:guest@" + closed + "/: cannot connect", "rabbitmq-server -detached"}},
	} {
		t.Setenv(tt.tg.envVar, "")
		tt.tg.local = tt.local
		addr, missing := resolve(tt.tg, func() error { return probeDocker(time.Second) })
		if addr != "" {
			t.Fatalf("resolve %s: got %q, want nothing", tt.tg.name, addr)
		}
		want := append(tt.want, "no Docker engine for testcontainers", "/nonexistent/testenv/docker.sock", "docker compose up -d --wait")
		for _, w := range want {
			if !strings.Contains(missing, w) {
				t.Errorf("%s: message lacks %q:\n%s", tt.tg.name, w, missing)
			}
		}
		t.Logf("%s:\n%s", tt.tg.name, missing)
	}
}

// TestResolveRealEnv sets REDIS_ADDR and AMQP_URL to where nothing listens:
// the tests must fail rather than use the local defaults.
func TestResolveRealEnv(t *testing.T) {
	closed := closedAddr(t)
	t.Setenv("REDIS_ADDR", closed)
	t.Setenv("AMQP_URL", "amqp://guest:guest@"+closed+"/")
	fail := func() error { t.Fatal("Docker probed although the environment variable is set"); return nil }
	if addr, missing := resolve(redisTarget, fail); addr != "" || !strings.Contains(missing, "REDIS_ADDR="+closed+" does not answer PING") {
		t.Errorf("resolve Redis: got %q, %q", addr, missing)
	}
	if addr, missing := resolve(amqpTarget, fail); addr != "" || !strings.Contains(missing, "AMQP_URL=amqp://guest:guest@"+closed+"/: cannot connect") {
		t.Errorf("resolve RabbitMQ: got %q, %q", addr, missing)
	}
}

// closedAddr returns a loopback address where nothing listens.
func closedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

func needGo(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skipf("the go command is not on PATH: %v", err)
	}
}

// fakeProgram writes a module holding main.go into a new directory.
func fakeProgram(t *testing.T, main string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module fake\n\ngo 1.22\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(main), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestStartHelper runs a stand-in for the containers program: it prints
// its address among other lines, and cleans up when its standard input
// closes.
func TestStartHelper(t *testing.T) {
	needGo(t)
	dir := fakeProgram(t, `package main

import (
	"fmt"
	"io"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "fake: starting")
	fmt.Println("something else")
	fmt.Println("FAKE_ADDR=127.0.0.1:4242")
	io.Copy(io.Discard, os.Stdin)
	os.WriteFile(os.Args[1], []byte("removed"), 0o644)
}
`)
	marker := filepath.Join(t.TempDir(), "removed")
	h, addr, err := startHelper(dir, "FAKE_ADDR", 2*time.Minute, marker)
	if err != nil {
		t.Fatalf("startHelper: %v", err)
	}
	if addr != "127.0.0.1:4242" {
		t.Fatalf("startHelper: got address %q, want 127.0.0.1:4242", addr)
	}
	select {
	case <-h.exited:
		t.Fatalf("the program exited while its standard input was open: %v\n%s", h.cmd.ProcessState, h.stderr)
	case <-time.After(200 * time.Millisecond):
	}
	if _, err := os.Stat(marker); err == nil {
		t.Fatal("the program cleaned up while its standard input was open")
	}
	h.stop()
	if b, err := os.ReadFile(marker); err != nil || string(b) != "removed" {
		t.Fatalf("after stop: marker %q, %v; want the program to have cleaned up", b, err)
	}
	if !h.cmd.ProcessState.Success() {
		t.Fatalf("after stop: %v\n%s", h.cmd.ProcessState, h.stderr)
	}
}

func TestStartHelperFails(t *testing.T) {
	needGo(t)
	dir := fakeProgram(t, `package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "containers: no Docker engine: nothing here")
	os.Exit(3)
}
`)
	_, _, err := startHelper(dir, "FAKE_ADDR", 2*time.Minute)
	if err == nil || !strings.Contains(err.Error(), "containers: no Docker engine: nothing here") ||
		!strings.Contains(err.Error(), "before printing FAKE_ADDR=") {
		t.Fatalf("startHelper: got %v, want the program's standard error", err)
	}
	t.Logf("startHelper: %v", err)
}

// TestContainersProgramNoDocker builds and runs the real containers program
// (a nested module that uses testcontainers-go) where no Docker engine
// answers: it must say so.
func TestContainersProgramNoDocker(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the containers program and testcontainers-go: skipped under -short")
	}
	needGo(t)
	dir, err := containersDir()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_HOST", "unix:///nonexistent/testenv/docker.sock")
	if probeDocker(time.Second) == nil {
		t.Skip("a Docker engine answers here")
	}
	_, _, err = startHelper(dir, "REDIS_ADDR", containerTimeout, "redis")
	if err == nil || !strings.Contains(err.Error(), "containers: no Docker engine:") {
		t.Fatalf("containers program without Docker: got %v, want it to report no Docker engine", err)
	}
	t.Logf("containers program: %v", err)
}

// TestStartHelperTimeout runs a stand-in that never prints its address: it
// is stopped, through its standard input, when the time is up.
func TestStartHelperTimeout(t *testing.T) {
	needGo(t)
	dir := fakeProgram(t, `package main

import (
	"fmt"
	"io"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "fake: pulling forever")
	io.Copy(io.Discard, os.Stdin)
	fmt.Fprintln(os.Stderr, "fake: standard input closed")
}
`)
	start := time.Now()
	_, _, err := startHelper(dir, "FAKE_ADDR", 5*time.Second)
	if err == nil || !strings.Contains(err.Error(), "no FAKE_ADDR=... line within 5s") {
		t.Fatalf("startHelper: got %v, want a timeout", err)
	}
	if got, max := time.Since(start), 30*time.Second; got > max {
		t.Fatalf("startHelper took %v, want at most %v", got, max)
	}
	t.Logf("startHelper: %v", err)
}

// TestContainersImages checks that the images named in the messages are
// those the containers program runs.
func TestContainersImages(t *testing.T) {
	dir, err := containersDir()
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile(filepath.Join(dir, "main.go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, img := range []string{redisImage, rabbitImage} {
		if !strings.Contains(string(src), `image: "`+img+`"`) {
			t.Errorf("containers/main.go does not run %s", img)
		}
	}
}
