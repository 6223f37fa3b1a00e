package testenv

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The Docker fallback is a program of its own, containers/, in a nested
// module: testcontainers-go and the Docker client it needs must not appear in
// this module's go.mod and go.sum, where every module importing amqpidem
// would inherit them. This file only uses the standard library: it checks
// that a Docker engine answers, and only then runs `go run . <service>` in
// containers/, reads the address it prints, and keeps it running for the
// life of the test binary.

var docker struct {
	once sync.Once
	err  error
}

// dockerAvailable reports, once per test binary, whether a Docker engine
// answers; nil means the containers program can be tried.
func dockerAvailable() error {
	docker.once.Do(func() { docker.err = probeDocker(dockerProbeTimeout) })
	return docker.err
}

// probeDocker reports whether a Docker engine answers GET /_ping at one of
// the places testcontainers-go looks, in its order (see dockerHosts), within
// timeout for all of them. Hosts it cannot check with the standard library
// (npipe://, ssh://, TLS) count as answering: the containers program checks
// them itself.
func probeDocker(timeout time.Duration) error {
	hosts, looked := dockerHosts()
	if len(hosts) == 0 {
		return fmt.Errorf("DOCKER_HOST is not set and there is no Docker socket (looked for %s)", strings.Join(looked, ", "))
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var errs []error
	for _, h := range hosts {
		err := pingDocker(ctx, h)
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", h, err))
	}
	return errors.Join(errs...)
}

// dockerHosts returns the Docker hosts to try, in the order testcontainers-go
// tries them: tc.host in ~/.testcontainers.properties, DOCKER_HOST, the
// default socket /var/run/docker.sock, docker.host in
// ~/.testcontainers.properties, then the rootless and Docker Desktop sockets
// ($XDG_RUNTIME_DIR/docker.sock, ~/.docker/run/docker.sock,
// ~/.docker/desktop/docker.sock, /run/user/<uid>/docker.sock). Sockets are
// listed only if the file exists; looked lists the sockets looked for.
func dockerHosts() (hosts, looked []string) {
	add := func(h string) {
		if h != "" && !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	socket := func(path string) {
		looked = append(looked, path)
		if _, err := os.Stat(path); err == nil {
			add("unix://" + path)
		}
	}
	props := testcontainersProperties()
	add(props["tc.host"])
	add(os.Getenv("DOCKER_HOST"))
	socket("/var/run/docker.sock")
	add(props["docker.host"])
	if dir := os.Getenv("XDG_RUNTIME_DIR"); dir != "" {
		socket(filepath.Join(dir, "docker.sock"))
	}
	if home, err := os.UserHomeDir(); err == nil {
		socket(filepath.Join(home, ".docker", "run", "docker.sock"))
		socket(filepath.Join(home, ".docker", "desktop", "docker.sock"))
	}
	if uid := os.Getuid(); uid >= 0 {
		socket(filepath.Join("/run/user", strconv.Itoa(uid), "docker.sock"))
	}
	return hosts, looked
}

// testcontainersProperties reads the key=value lines of
// ~/.testcontainers.properties, if there is one.
func testcontainersProperties() map[string]string {
	m := map[string]string{}
	home, err := os.UserHomeDir()
	if err != nil {
		return m
	}
	b, err := os.ReadFile(filepath.Join(home, ".testcontainers.properties"))
	if err != nil {
		return m
	}
	for line := range strings.Lines(string(b)) {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' || line[0] == '!' {
			continue
		}
		if k, v, ok := strings.Cut(line, "="); ok {
			m[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	return m
}

// pingDocker sends GET /_ping to the Docker engine at host (unix:///path or
// tcp://host:port) and expects 200 OK. A TLS endpoint is only dialled, and a
// host of another scheme is not checked.
func pingDocker(ctx context.Context, host string) error {
	u, err := url.Parse(host)
	if err != nil {
		return err
	}
	var network, address string
	switch u.Scheme {
	case "unix":
		network, address = "unix", u.Path
	case "tcp", "http", "https":
		network, address = "tcp", u.Host
		if u.Scheme == "https" || os.Getenv("DOCKER_TLS_VERIFY") != "" || u.Port() == "2376" {
			var d net.Dialer
			conn, err := d.DialContext(ctx, network, address)
			if err != nil {
				return err
			}
			return conn.Close()
		}
	default:
		return nil // npipe://, ssh://: left to the containers program
	}
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, address)
		},
		DisableKeepAlives: true,
	}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://docker/_ping", nil)
	if err != nil {
		return err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("no answer from the Docker engine in time: %w", err)
		}
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET /_ping: %s %q", resp.Status, body)
	}
	return nil
}

// helpers are the containers programs started by this test binary. They
// are never stopped by it: when the binary exits, their standard input
// closes and they remove their containers.
var helpers struct {
	mu   sync.Mutex
	list []*helper
}

// startContainer runs the containers program for tg and returns the address
// it prints, once the service there answers.
func startContainer(tg target) (string, error) {
	dir, err := containersDir()
	if err != nil {
		return "", err
	}
	h, addr, err := startHelper(dir, tg.envVar, containerTimeout, tg.service)
	if err != nil {
		return "", err
	}
	helpers.mu.Lock()
	helpers.list = append(helpers.list, h)
	helpers.mu.Unlock()
	if err := retry(containerReadyTimeout, func() error { return tg.probe(addr) }); err != nil {
		return "", fmt.Errorf("the containers program reported %s=%s, but %s%s: %w", tg.envVar, addr, addr, tg.failure, err)
	}
	return addr, nil
}

// containersDir returns the directory of the containers program, next to
// this file's source.
func containersDir() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("cannot find the containers program: runtime.Caller failed")
	}
	dir := filepath.Join(filepath.Dir(file), "containers")
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		return "", fmt.Errorf("cannot find the containers program (%v): the Docker fallback needs a checkout of "+
			"github.com/amqpidem/amqpidem, tests built without -trimpath", err)
	}
	return dir, nil
}

// A helper is a running `go run . <service>` of a containers program.
type helper struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *tailBuffer
	exited chan struct{} // closed once cmd has exited and been waited for
}

// startHelper runs `go run . args...` in dir and waits, for at most timeout,
// for the line "key=value" on its standard output. It returns the helper,
// still running, and value. On failure the helper is stopped and the error
// holds the end of its standard error.
func startHelper(dir, key string, timeout time.Duration, args ...string) (*helper, string, error) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		return nil, "", fmt.Errorf("the go command runs the containers program in %s: %w", dir, err)
	}
	cmd := exec.Command(goBin, append([]string{"run", "."}, args...)...)
	cmdline := strings.Join(append([]string{"go run ."}, args...), " ")
	cmd.Dir = dir
	// Only this module's go.mod and go.sum: no workspace, no vendoring.
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly -buildvcs=false")
	h := &helper{cmd: cmd, stderr: &tailBuffer{max: 8 << 10}, exited: make(chan struct{})}
	cmd.Stderr = h.stderr
	if h.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, "", err
	}
	stdout, w, err := os.Pipe()
	if err != nil {
		return nil, "", err
	}
	cmd.Stdout = w
	err = cmd.Start()
	w.Close() // the child has its own copy
	if err != nil {
		stdout.Close()
		return nil, "", err
	}
	go func() {
		_ = cmd.Wait()
		close(h.exited)
	}()

	found := make(chan string, 1)
	go func() {
		defer stdout.Close()
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), key+"="); ok {
				select {
				case found <- v:
				default:
				}
			}
		}
		// Keep reading until the program exits, so that it never blocks
		// writing to a full pipe.
		_, _ = io.Copy(io.Discard, stdout)
	}()

	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case v := <-found:
		return h, v, nil
	case <-h.exited:
		return nil, "", fmt.Errorf("%s in %s: %v, before printing %s=...:\n%s",
			cmdline, dir, cmd.ProcessState, key, h.stderr)
	case <-timer.C:
		h.stop()
		return nil, "", fmt.Errorf("%s in %s: no %s=... line within %v:\n%s",
			cmdline, dir, key, timeout, h.stderr)
	}
}

// stop closes the helper's standard input, which makes the containers
// program remove its containers and exit, and waits for it, killing it after
// 30 seconds.
func (h *helper) stop() {
	_ = h.stdin.Close()
	select {
	case <-h.exited:
	case <-time.After(30 * time.Second):
		_ = h.cmd.Process.Kill()
		<-h.exited
	}
}

// tailBuffer is an io.Writer that keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if over := len(t.b) - t.max; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.b))
}

// retry calls f until it succeeds or d has passed, and returns its last error.
func retry(d time.Duration, f func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
}
