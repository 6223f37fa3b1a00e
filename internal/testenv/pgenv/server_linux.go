//go:build linux

package pgenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// Server is a PostgreSQL server private to one test, for the tests that
// restart PostgreSQL (chaos scenarios, linearizability runs): the shared
// server (127.0.0.1:5432) is never restarted, since other packages' tests
// use it at the same time.
//
// Its cluster is made by initdb in a directory of its own under the
// system's temporary directory (owned by the postgres user when the test
// runs as root, since PostgreSQL refuses to run as root), and the
// postmaster runs as a child of the test binary (`postgres -D ...`, not
// daemonized by pg_ctl) with Pdeathsig, so that a test binary killed
// before its cleanup (by -timeout, say) leaves no server behind. It
// listens on a free port of 127.0.0.1 only, with its Unix socket in its
// own directory, with fsync=off (see launch). Stops are pg_ctl's: SIGQUIT
// for "immediate" (a crash: no checkpoint, recovery from the WAL at the
// next start), SIGINT for "fast".
// t.Cleanup stops it (immediate, then SIGKILL) and removes the directory,
// whether the test passed or not.
type Server struct {
	t       *testing.T
	dir     string // the cluster's directory: data/, the socket, the log
	data    string
	logPath string
	cred    *syscall.Credential
	// Bin is the directory holding initdb, postgres and the other
	// programs of the server's version (pg_dump, pg_restore).
	Bin string
	// Port is the server's port on 127.0.0.1, and DSN a URL to its
	// database postgres as the user postgres.
	Port int
	DSN  string

	mu   sync.Mutex
	proc *testenv.Process // the postmaster; nil while stopped
}

const (
	// pgStartTimeout bounds a start until the server accepts connections
	// (crash recovery included).
	pgStartTimeout = 60 * time.Second
	// pgStopTimeout bounds a stop before the postmaster is killed.
	pgStopTimeout = 30 * time.Second
)

var errPGPortInUse = errors.New("pgenv: PostgreSQL could not bind its port")

// pgBinDir finds the directory of initdb and postgres: PATH, else the
// newest /usr/lib/postgresql/<version>/bin (Debian keeps them there).
func pgBinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		dir := filepath.Dir(p)
		if _, err := os.Stat(filepath.Join(dir, "postgres")); err == nil {
			return dir, nil
		}
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	sort.Slice(matches, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(matches[i]))))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(matches[j]))))
		return vi > vj
	})
	for _, m := range matches {
		dir := filepath.Dir(m)
		if _, err := os.Stat(filepath.Join(dir, "postgres")); err == nil {
			return dir, nil
		}
	}
	return "", errors.New("no initdb and postgres on PATH or in /usr/lib/postgresql/*/bin")
}

// StartServer makes a new cluster and starts it; t.Cleanup stops it and
// removes its directory.
func StartServer(t *testing.T) *Server {
	t.Helper()
	bin, err := pgBinDir()
	if err != nil {
		t.Fatalf("pgenv: a test that restarts PostgreSQL starts a private server and needs PostgreSQL's programs installed: %v", err)
	}
	s := &Server{t: t, Bin: bin}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("pgenv: running as root, and PostgreSQL refuses to run as root: it needs a user named postgres to run as: %v", err)
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil {
			t.Fatalf("pgenv: user postgres: uid %q gid %q", u.Uid, u.Gid)
		}
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}
	}
	// Not t.TempDir(): its parent is private to root, and the postgres
	// user must reach the cluster's directory.
	s.dir, err = os.MkdirTemp("", "amqpidem-pg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.cleanup)
	if s.cred != nil {
		if err := os.Chown(s.dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	s.data = filepath.Join(s.dir, "data")
	s.logPath = filepath.Join(s.dir, "postgres.log")

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"), "-D", s.data, "-U", "postgres", "-A", "trust",
		"-E", "UTF8", "--locale=C", "--no-sync")
	initdb.SysProcAttr = s.sysProcAttr()
	initdb.Dir = s.dir
	if out, err := initdb.CombinedOutput(); err != nil {
		t.Fatalf("pgenv: initdb: %v\n%s", err, out)
	}

	deadline := time.Now().Add(pgStartTimeout)
	for attempt := 1; ; attempt++ {
		port, err := freeLoopbackPort()
		if err != nil {
			t.Fatal(err)
		}
		s.Port = port
		s.DSN = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
		err = s.launch(deadline)
		if err == nil {
			break
		}
		if !errors.Is(err, errPGPortInUse) || attempt == 10 || time.Now().After(deadline) {
			t.Fatalf("pgenv: starting the private PostgreSQL: %v\n%s", err, s.logTail())
		}
	}
	t.Logf("pgenv: private PostgreSQL (pid %d) at 127.0.0.1:%d in %s", s.PID(), s.Port, s.dir)
	return s
}

func (s *Server) sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Credential: s.cred, Pdeathsig: syscall.SIGKILL}
}

// freeLoopbackPort returns a port of 127.0.0.1 that was free a moment ago.
func freeLoopbackPort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// launch starts the postmaster on s.Port and waits until it accepts
// connections. s.mu must not be held.
func (s *Server) launch(deadline time.Time) error {
	cmd := exec.Command(filepath.Join(s.Bin, "postgres"), "-D", s.data, "-p", strconv.Itoa(s.Port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories="+s.dir,
		"-c", "max_connections=100",
		"-c", "shared_buffers=16MB",
		// The scenario kills the server process, never the machine: what a
		// commit wrote to the WAL is in the kernel's page cache before the
		// commit is acknowledged (synchronous_commit stays on), with or
		// without fsync. fsync=off spares the fsync of every file of the
		// data directory that a start after a crash does first (about 2 s
		// here).
		"-c", "fsync=off",
		"-c", "logging_collector=off")
	cmd.Dir = s.dir
	cmd.SysProcAttr = s.sysProcAttr()
	p, err := testenv.StartProcess(cmd, s.logPath, "")
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.proc = p
	s.mu.Unlock()

	for {
		select {
		case <-p.Exited():
			s.mu.Lock()
			s.proc = nil
			s.mu.Unlock()
			out := p.Output()
			if strings.Contains(out, "could not bind") || strings.Contains(out, "Address already in use") {
				return errPGPortInUse
			}
			return fmt.Errorf("postgres exited at start: %v", p.State())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, s.DSN)
		if err == nil {
			err = conn.Ping(ctx)
			_ = conn.Close(ctx)
		}
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			s.Stop(syscall.SIGKILL)
			return fmt.Errorf("postgres did not accept connections within %v: %v", pgStartTimeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// PID returns the postmaster's process id, 0 when stopped.
func (s *Server) PID() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return 0
	}
	return s.proc.Pid()
}

// Stop sends sig to the postmaster (SIGQUIT: pg_ctl's immediate mode,
// SIGINT: fast, SIGKILL) and waits for it to exit, killing it after
// pgStopTimeout. Stopping a stopped server does nothing.
func (s *Server) Stop(sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return
	}
	_ = s.proc.Stop(sig, pgStopTimeout)
	s.proc = nil
}

// Restart stops the server with sig, waits down, and starts it again on
// the same port, failing the test if it does not come back.
func (s *Server) Restart(sig syscall.Signal, down time.Duration) {
	s.t.Helper()
	t0 := time.Now()
	s.Stop(sig)
	stopped := time.Since(t0)
	time.Sleep(down)
	took := s.Start()
	s.t.Logf("pgenv: private PostgreSQL stopped (%v) in %v, down %v, accepting connections again %v after its start (pid %d)",
		sig, stopped.Round(time.Millisecond), down, took.Round(time.Millisecond), s.PID())
}

// Start starts the stopped server again on its port and returns how long
// it took until it accepted connections (crash recovery included),
// failing the test if it does not come back. A scenario that does more
// while the server is down calls Stop, then Start.
func (s *Server) Start() time.Duration {
	s.t.Helper()
	t1 := time.Now()
	deadline := time.Now().Add(pgStartTimeout)
	for {
		err := s.launch(deadline)
		if err == nil {
			return time.Since(t1)
		}
		// While the server was down, the kernel may have given its port to
		// an outgoing connection for a moment.
		if !errors.Is(err, errPGPortInUse) || time.Now().After(deadline) {
			s.t.Fatalf("pgenv: restarting the private PostgreSQL: %v\n%s", err, s.logTail())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// logTail returns the end of the server's log.
func (s *Server) logTail() string {
	return testenv.LogTail(s.logPath, 4<<10)
}

// cleanup stops the server at once and removes its directory; the log's
// end is shown if the test failed.
func (s *Server) cleanup() {
	s.Stop(syscall.SIGQUIT)
	if s.t.Failed() && s.logPath != "" {
		s.t.Logf("private PostgreSQL log (%s):\n%s", s.logPath, s.logTail())
	}
	if os.Getenv("CHAOS_KEEP") == "1" {
		s.t.Logf("pgenv: CHAOS_KEEP=1: private PostgreSQL cluster kept in %s", s.dir)
		return
	}
	if err := os.RemoveAll(s.dir); err != nil {
		s.t.Errorf("removing the private PostgreSQL's directory: %v", err)
	}
}
