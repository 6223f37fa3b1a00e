package testenv

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// serverStartTimeout bounds starting one redis-server until it answers.
	serverStartTimeout = 10 * time.Second
	// maxPortAttempts bounds how many free ports a start tries when another
	// process takes the port between picking it and redis-server binding it.
	maxPortAttempts = 10
	// logTailBytes is how much of a server's log a failure shows.
	logTailBytes = 4 << 10
)

// errPortInUse means redis-server could not bind its port.
var errPortInUse = errors.New("testenv: port in use")

// Server is a redis-server process owned by one test, listening on a free
// port of 127.0.0.1, with persistence off unless its args turn it on. It is
// killed and waited for in t.Cleanup, and its log is printed if the test
// failed.
//
// Stop may be called from any goroutine, for example to crash Redis while the
// code under test is using it. Start, like t.Fatalf, must be called from the
// goroutine running the test.
type Server struct {
	// Addr is the server's 127.0.0.1:port. It stays the same across Stop and
	// Start.
	Addr string
	// Dir is the server's working directory (its --dir), a t.TempDir() where
	// it writes RDB, AOF and nodes.conf files and its log,
	// redis-server.log. Dir survives Stop and Start, so whatever the server
	// persisted before Stop is loaded again by Start.
	Dir string

	t       testing.TB
	bin     string
	conf    string   // config file, given before all other arguments; "" for none
	args    []string // all arguments but the config file and --port
	logPath string
	port    int

	mu   sync.Mutex
	proc *Process // nil while stopped
}

// RedisServer starts a standalone redis-server from PATH for this test alone,
// for tests that restart, kill, pause or reconfigure Redis. It runs with
// --bind 127.0.0.1 --save "" --appendonly no followed by args, so args can
// override those (for example "--appendonly", "yes") and add others
// ("--maxmemory", "1mb", "--maxmemory-policy", "allkeys-lru"); args must not
// set --port, --bind, --dir or --daemonize. If redis-server is not on PATH the
// test fails, or is skipped under -short without CI=true.
func RedisServer(t testing.TB, args ...string) *Server {
	t.Helper()
	bin := lookPath(t, "redis-server")
	s := newServer(t, bin, args)
	if err := s.launchFree(false, time.Now().Add(serverStartTimeout)); err != nil {
		t.Fatalf("testenv: starting redis-server: %v (its log follows)", err)
	}
	return s
}

// newServer prepares, without starting it, a server in a new t.TempDir() that
// is killed in t.Cleanup.
func newServer(t testing.TB, bin string, args []string) *Server {
	dir := t.TempDir()
	s := &Server{
		Dir:     dir,
		t:       t,
		bin:     bin,
		logPath: filepath.Join(dir, "redis-server.log"),
	}
	s.args = append([]string{
		"--bind", "127.0.0.1",
		"--dir", dir,
		"--daemonize", "no",
		"--save", "",
		"--appendonly", "no",
	}, args...)
	// Registered after t.TempDir, so it runs before the directory is removed.
	t.Cleanup(s.cleanup)
	return s
}

// Stop kills the server with SIGKILL, like a crash: nothing is flushed beyond
// what its persistence settings already wrote, and clients see their
// connections reset. Stop waits for the process to exit. Stopping a stopped
// server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.kill()
}

// Start starts a stopped server again on the same Addr, Dir and arguments,
// and waits until it answers. Starting a running server does nothing. If the
// server cannot start within 10 seconds, the test fails.
func (s *Server) Start() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		return
	}
	deadline := time.Now().Add(serverStartTimeout)
	for {
		err := s.launch(deadline)
		if err == nil {
			return
		}
		// While the server was down, the kernel may have handed its port to
		// an outgoing connection; such ports are soon released.
		if !errors.Is(err, errPortInUse) || time.Now().After(deadline) {
			s.t.Fatalf("testenv: restarting redis-server: %v (its log follows)", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Client returns a client of the server, closed in t.Cleanup. It reconnects
// by itself after Stop and Start, though after failed dials go-redis may wait
// about a second before dialing again.
func (s *Server) Client(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// launchFree starts the server on a free port, trying other ports while the
// chosen one turns out to be taken. With bus set, the port 10000 above it,
// the Redis Cluster bus port, must be free too.
func (s *Server) launchFree(bus bool, deadline time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for attempt := 1; ; attempt++ {
		port, err := freePort(bus)
		if err != nil {
			return err
		}
		s.port = port
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		err = s.launch(deadline)
		if err == nil || !errors.Is(err, errPortInUse) || attempt == maxPortAttempts || time.Now().After(deadline) {
			return err
		}
	}
}

// launch starts redis-server on s.port and waits, until deadline, for it to
// answer as itself: a reply from another process that took the port does not
// count. s.mu must be held.
func (s *Server) launch(deadline time.Time) error {
	var args []string
	if s.conf != "" {
		args = append(args, s.conf) // redis-server reads a config file only as its first argument
	}
	args = append(args, "--port", strconv.Itoa(s.port))
	args = append(args, s.args...)
	cmd := exec.Command(s.bin, args...)
	cmd.Dir = s.Dir
	p, err := StartProcess(cmd, s.logPath, "")
	if err != nil {
		return err
	}
	s.proc = p

	want := strconv.Itoa(p.Pid())
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if info, err := command(s.Addr, time.Second, "INFO", "server"); err == nil && infoField(info, "process_id") == want {
			return nil
		}
		select {
		case <-p.Exited():
			s.proc = nil
			if strings.Contains(p.Output(), "Address already in use") {
				return fmt.Errorf("%w: %s: redis-server %v", errPortInUse, s.Addr, p.State())
			}
			return fmt.Errorf("redis-server on %s exited: %v", s.Addr, p.State())
		case <-tick.C:
		}
		if time.Now().After(deadline) {
			s.kill()
			return fmt.Errorf("redis-server on %s did not answer in time", s.Addr)
		}
	}
}

// Pause stops the server with SIGSTOP, as a stalled host would: it takes
// connections but answers nothing, and a replica applies no more of its
// master's stream, until Resume. t.Cleanup resumes it. Pausing a stopped
// server does nothing. Only on Linux: elsewhere the test fails.
func (s *Server) Pause() {
	s.t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return
	}
	if err := s.proc.Pause(); err != nil {
		s.t.Fatalf("testenv: pausing redis-server %s: %v", s.Addr, err)
	}
	s.t.Cleanup(s.Resume)
}

// Resume continues a server that Pause stopped.
func (s *Server) Resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		_ = s.proc.Resume()
	}
}

// kill kills the process, if any, and waits for it. s.mu must be held.
func (s *Server) kill() {
	if s.proc != nil {
		s.proc.Kill()
		s.proc = nil
	}
}

func (s *Server) cleanup() {
	s.Stop()
	if s.t.Failed() {
		s.t.Logf("testenv: log of redis-server %s (%s):\n%s", s.Addr, s.logPath, LogTail(s.logPath, logTailBytes))
	}
}

// poll calls check every interval until it returns nil or ctx ends, and then
// returns ctx's error with check's last error.
func poll(ctx context.Context, interval time.Duration, check func() error) error {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		err := check()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w; last check: %v", ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// freePort returns a port of 127.0.0.1 that was free a moment ago. With bus
// set, port+10000 was free too.
func freePort(bus bool) (int, error) {
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		if !bus {
			l.Close()
			return port, nil
		}
		if port+10000 > 65535 {
			l.Close()
			continue
		}
		l2, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		l.Close()
		if err != nil {
			continue
		}
		l2.Close()
		return port, nil
	}
	return 0, errors.New("testenv: no free pair of ports for a cluster node")
}

// lookPath finds a program of Redis, or ends the test with what to install.
func lookPath(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		unavailable(t, "testenv: %s needs the %s program on PATH (%v).\n"+
			"It starts its own throwaway redis-server processes (a standalone server, a Redis Cluster or a Sentinel setup) "+
			"on free loopback ports, so it runs only on a host with Redis installed: "+
			"the shared Redis of REDIS_ADDR, make services or docker compose cannot stand in for it.\n"+
			"Install Redis so that redis-server and redis-cli are on PATH "+
			"(Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis).",
			t.Name(), name, err)
	}
	return p
}

func quoteArgs(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \t\"'") {
			a = strconv.Quote(a)
		}
		q[i] = a
	}
	return strings.Join(q, " ")
}

// pingRedis sends PING to addr and expects PONG.
func pingRedis(addr string, timeout time.Duration) error {
	if strings.Contains(addr, "://") {
		return fmt.Errorf("%q is a URL; want host:port", addr)
	}
	reply, err := command(addr, timeout, "PING")
	if err != nil {
		return err
	}
	if reply != "PONG" {
		return fmt.Errorf("PING replied %q", reply)
	}
	return nil
}

// command sends one command to the Redis at addr on a new connection and
// returns its reply, which must be a simple string, an integer or a bulk
// string. It speaks RESP2 directly so that probing a server costs one
// connection and leaves no client or goroutine behind.
func command(addr string, timeout time.Duration, args ...string) (string, error) {
	reply, err := commandReply(addr, timeout, args...)
	if err != nil {
		return "", err
	}
	s, ok := reply.(string)
	if !ok {
		return "", fmt.Errorf("unexpected reply %v", reply)
	}
	return s, nil
}

// commandReply is command for any reply: a string (simple string, integer or
// bulk string), nil (a null bulk string or array) or an []any of replies. An
// error reply is a replyError.
func commandReply(addr string, timeout time.Duration, args ...string) (any, error) {
	conn, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return nil, err
	}
	var req strings.Builder
	fmt.Fprintf(&req, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&req, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := io.WriteString(conn, req.String()); err != nil {
		return nil, err
	}
	return readReply(bufio.NewReader(conn), 0)
}

// replyError is an error reply from Redis, such as "NOGOODSLAVE No suitable
// replica to promote".
type replyError string

func (e replyError) Error() string { return "redis: " + string(e) }

// maxReplyDepth bounds how deeply readReply follows nested arrays.
const maxReplyDepth = 8

// readReply reads one RESP2 reply; see commandReply. An error reply nested
// in an array is returned as the array's error.
func readReply(r *bufio.Reader, depth int) (any, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimSuffix(line, "\r\n")
	if line == "" {
		return nil, errors.New("empty reply")
	}
	switch line[0] {
	case '+', ':':
		return line[1:], nil
	case '-':
		return nil, replyError(line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < -1 {
			return nil, fmt.Errorf("unexpected reply %q", line)
		}
		if n == -1 {
			return nil, nil
		}
		b := make([]byte, n+2)
		if _, err := io.ReadFull(r, b); err != nil {
			return nil, err
		}
		return string(b[:n]), nil
	case '*':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < -1 || depth == maxReplyDepth {
			return nil, fmt.Errorf("unexpected reply %q", line)
		}
		if n == -1 {
			return nil, nil
		}
		elems := make([]any, n)
		for i := range elems {
			if elems[i], err = readReply(r, depth+1); err != nil {
				return nil, err
			}
		}
		return elems, nil
	default:
		return nil, fmt.Errorf("unexpected reply %q", line)
	}
}

// infoField returns the value of field in the output of INFO or CLUSTER INFO.
func infoField(info, field string) string {
	for line := range strings.Lines(info) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ":"); ok && k == field {
			return v
		}
	}
	return ""
}
