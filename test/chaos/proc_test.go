//go:build linux

package chaos_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// program is a command of cmd/ built once per test binary (with -race when
// buildRace says so) into a temporary directory that TestMain removes.
type program struct {
	pkg  string // such as "./cmd/consumer"
	once sync.Once
	dir  string
	path string // set once built
	err  error
}

// The programs the scenarios run as processes.
var (
	consumerBin = &program{pkg: "./cmd/consumer"}
	relayBin    = &program{pkg: "./cmd/relay"}
)

func TestMain(m *testing.M) {
	code := m.Run()
	for _, p := range []*program{consumerBin, relayBin, cliBin} {
		if p.dir != "" {
			os.RemoveAll(p.dir)
		}
	}
	os.Exit(code)
}

// buildRace says whether the programs are built with the race detector:
// when the tests are (make test), unless CHAOS_RACE=0; always with
// CHAOS_RACE=1.
func buildRace() bool {
	switch os.Getenv("CHAOS_RACE") {
	case "0":
		return false
	case "1":
		return true
	}
	return raceEnabled
}

// build returns the path of p's binary, building it on first use; a
// failed build fails t.
func (p *program) build(t *testing.T) string {
	t.Helper()
	p.once.Do(func() {
		dir, err := os.MkdirTemp("", "amqpidem-chaos-")
		if err != nil {
			p.err = err
			return
		}
		p.dir = dir
		path := filepath.Join(dir, filepath.Base(p.pkg))
		args := []string{"build", "-o", path}
		if buildRace() {
			args = append(args, "-race")
		}
		args = append(args, p.pkg)
		// go test puts its own go command first on PATH.
		out, err := exec.Command("go", args...).CombinedOutput()
		if err != nil {
			p.err = fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
			return
		}
		p.path = path
	})
	if p.err != nil {
		t.Fatalf("building %s: %v", p.pkg, p.err)
	}
	return p.path
}

// consumerBinary returns the path of the consumer program, building it on
// first use.
func consumerBinary(t *testing.T) string {
	t.Helper()
	return consumerBin.build(t)
}

// proc is one consumer process.
type proc struct {
	name    string // logical consumer name (connection_name)
	process *testenv.Process
}

// consumer starts a consumer process named name with the env's services
// and extra flags. Its output goes to files in the env's directory
// (<name>.<n>.stdout, and <name>.<n>.stderr after a line with its command
// line), its events to <name>.<n>.events.
func (e *env) consumer(name string, extra ...string) *proc {
	e.t.Helper()
	consumerBinary(e.t)
	p, err := e.startConsumer(name, extra...)
	if err != nil {
		e.t.Fatal(err)
	}
	return p
}

// startConsumer is consumer for any goroutine, once the binary is built:
// it returns the error.
func (e *env) startConsumer(name string, extra ...string) (*proc, error) {
	bin := consumerBin.path
	if bin == "" {
		return nil, fmt.Errorf("consumer binary not built")
	}
	e.mu.Lock()
	n := e.starts[name]
	e.starts[name] = n + 1
	e.mu.Unlock()
	base := filepath.Join(e.dir, fmt.Sprintf("%s.%d", name, n))
	args := append([]string{
		"-name", name,
		"-amqp", e.amqp,
		"-redis", e.redis.Addr,
		"-pg", e.dsn,
		"-schema", e.schema,
		"-queue", e.queue,
		"-prefix", e.name,
		"-events", base + ".events",
	}, append(e.historyFlags(base), extra...)...)
	cmd := exec.Command(bin, args...)
	stdout, err := os.Create(base + ".stdout")
	if err != nil {
		return nil, err
	}
	cmd.Stdout = stdout
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if buildRace() {
		// Report races and go on: a race fails the test at cleanup.
		cmd.Env = append(os.Environ(), "GORACE=halt_on_error=0")
	}
	process, err := testenv.StartProcess(cmd, base+".stderr", "")
	stdout.Close()
	if err != nil {
		return nil, fmt.Errorf("starting consumer %s: %w", name, err)
	}
	p := &proc{name: name, process: process}
	e.mu.Lock()
	e.procs = append(e.procs, p)
	e.mu.Unlock()
	return p, nil
}

// pid returns the process id.
func (p *proc) pid() int { return p.process.Pid() }

// alive reports whether the process has not exited.
func (p *proc) alive() bool { return p.process.Running() }

// kill sends SIGKILL and waits for the process to exit.
func (p *proc) kill() { p.process.Kill() }

// pause sends SIGSTOP; resume sends SIGCONT.
func (p *proc) pause() { _ = p.process.Pause() }

func (p *proc) resume() { _ = p.process.Resume() }

// terminate sends SIGTERM (a graceful Shutdown) and waits up to timeout,
// then kills. It returns an error unless the process exited by itself with
// status 0.
func (p *proc) terminate(timeout time.Duration) error {
	p.resume()
	if err := p.process.Stop(syscall.SIGTERM, timeout); err != nil {
		return fmt.Errorf("consumer %s (pid %d) did not stop within %v of SIGTERM; killed", p.name, p.pid(), timeout)
	}
	if st := p.process.State(); !st.Success() {
		return fmt.Errorf("consumer %s (pid %d) exited with %v after SIGTERM", p.name, p.pid(), st)
	}
	return nil
}

// exitedWith waits up to timeout for the process to exit by itself and
// returns its exit code (-1 when killed by a signal).
func (p *proc) exitedWith(timeout time.Duration) (code int, ok bool) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.process.Exited():
		return p.process.State().ExitCode(), true
	case <-t.C:
		return 0, false
	}
}

// output returns the process's stderr so far.
func (p *proc) output() string { return p.process.Output() }

// live returns the running processes of the env.
func (e *env) live() []*proc {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*proc
	for _, p := range e.procs {
		if p.alive() {
			out = append(out, p)
		}
	}
	return out
}

// terminateAll shuts every running consumer down gracefully, at once, and
// fails the test if one does not stop cleanly.
func (e *env) terminateAll() {
	e.t.Helper()
	procs := e.live()
	errs := make([]error, len(procs))
	var wg sync.WaitGroup
	for i, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = p.terminate(45 * time.Second)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			e.t.Error(err)
		}
	}
}

// stopProcs kills every process the env started and fails the test if any
// of them reported a panic or a data race. On failure it shows the end of
// each consumer's stderr.
func (e *env) stopProcs() {
	e.mu.Lock()
	procs := append([]*proc(nil), e.procs...)
	e.mu.Unlock()
	for _, p := range procs {
		p.resume()
		p.kill()
	}
	for _, p := range procs {
		out := p.output()
		for _, bad := range []string{"panic:", "fatal error:", "WARNING: DATA RACE"} {
			if strings.Contains(out, bad) {
				e.t.Errorf("consumer %s (pid %d) reported %q:\n%s", p.name, p.pid(), bad, tail(out, 8<<10))
				break
			}
		}
	}
	if e.t.Failed() {
		for _, p := range procs {
			e.t.Logf("consumer %s (pid %d, %v) stderr:\n%s", p.name, p.pid(), p.process.State(), tail(p.output(), 3<<10))
		}
	}
}

// tail returns the last n bytes of s.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "..." + s[len(s)-n:]
}

// grepAll counts the occurrences of sub in every consumer's stderr.
func (e *env) grepAll(sub string) int {
	e.mu.Lock()
	procs := append([]*proc(nil), e.procs...)
	e.mu.Unlock()
	n := 0
	for _, p := range procs {
		n += strings.Count(p.output(), sub)
	}
	return n
}
