package testenv_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// startProcess starts sh -c script with its output in log, killed in
// t.Cleanup.
func startProcess(t *testing.T, log, note, script string) *testenv.Process {
	t.Helper()
	p, err := testenv.StartProcess(exec.Command("sh", "-c", script), log, note)
	if err != nil {
		t.Fatalf("StartProcess: %v", err)
	}
	t.Cleanup(p.Kill)
	return p
}

// waitExited waits for p to exit, for at most 10 seconds.
func waitExited(t *testing.T, p *testenv.Process) {
	t.Helper()
	select {
	case <-p.Exited():
	case <-time.After(10 * time.Second):
		t.Fatalf("process %d did not exit", p.Pid())
	}
}

// waitOutput waits until p's output contains want, for at most 10 seconds.
func waitOutput(t *testing.T, p *testenv.Process, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(p.Output(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("output of process %d: got %q, want it to contain %q", p.Pid(), p.Output(), want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestProcessLogAcrossStarts(t *testing.T) {
	t.Parallel()
	log := filepath.Join(t.TempDir(), "p.log")

	first := startProcess(t, log, "", "echo first; echo oops >&2")
	waitExited(t, first)
	if first.Running() {
		t.Fatalf("Running after exit: got true, want false")
	}
	if st := first.State(); st == nil || !st.Success() {
		t.Fatalf("State after exit: got %v, want exit status 0", st)
	}
	out := first.Output()
	for _, want := range []string{"--- testenv ", `: sh -c "echo first; echo oops >&2"` + "\n", "first\n", "oops\n"} {
		if !strings.Contains(out, want) {
			t.Fatalf("Output of the first start: got %q, want it to contain %q", out, want)
		}
	}

	second := startProcess(t, log, "second run", "echo second")
	waitExited(t, second)
	out = second.Output()
	if !strings.HasPrefix(out, "--- testenv ") || !strings.Contains(out, ": second run\n") || !strings.HasSuffix(out, "second\n") {
		t.Fatalf("Output of the second start: got %q, want its header line (note %q) and %q", out, "second run", "second\n")
	}
	if strings.Contains(out, "first") {
		t.Fatalf("Output of the second start: got %q, want nothing of the first", out)
	}
	if got, want := second.LogPath(), log; got != want {
		t.Fatalf("LogPath: got %q, want %q", got, want)
	}
	if got := testenv.LogTail(log, 1<<20); !strings.Contains(got, "first\n") || !strings.HasSuffix(got, "second\n") {
		t.Fatalf("LogTail(1 MiB): got %q, want both starts", got)
	}
	if got, want := testenv.LogTail(log, 7), "second\n"; got != want {
		t.Fatalf("LogTail(7): got %q, want %q", got, want)
	}
	if got, want := testenv.LogTail(filepath.Join(t.TempDir(), "none"), 7), ""; got != want {
		t.Fatalf("LogTail of a missing file: got %q, want %q", got, want)
	}
}

func TestProcessKeepsCallersOutput(t *testing.T) {
	t.Parallel()
	log := filepath.Join(t.TempDir(), "p.log")
	var stdout strings.Builder
	cmd := exec.Command("sh", "-c", "echo out; echo err >&2")
	cmd.Stdout = &stdout
	p, err := testenv.StartProcess(cmd, log, "")
	if err != nil {
		t.Fatalf("StartProcess: %v", err)
	}
	t.Cleanup(p.Kill)
	waitExited(t, p)
	if got, want := stdout.String(), "out\n"; got != want {
		t.Fatalf("caller's Stdout: got %q, want %q", got, want)
	}
	if out := p.Output(); strings.Contains(out, "out\n") || !strings.HasSuffix(out, "err\n") {
		t.Fatalf("Output: got %q, want standard error only", out)
	}
}

func TestProcessStartFails(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	if _, err := testenv.StartProcess(exec.Command(filepath.Join(dir, "nosuchprogram")), filepath.Join(dir, "p.log"), ""); err == nil {
		t.Fatalf("StartProcess of a missing program: got nil error, want one")
	}
	if _, err := testenv.StartProcess(exec.Command("sh", "-c", "true"), filepath.Join(dir, "no", "p.log"), ""); err == nil {
		t.Fatalf("StartProcess with a log in a missing directory: got nil error, want one")
	}
}

func TestProcessStop(t *testing.T) {
	t.Parallel()
	log := filepath.Join(t.TempDir(), "p.log")
	p := startProcess(t, log, "", "echo ready; exec sleep 60")
	waitOutput(t, p, "ready\n")
	if !p.Running() || p.State() != nil {
		t.Fatalf("before Stop: Running %v, State %v; want true, nil", p.Running(), p.State())
	}
	start := time.Now()
	if err := p.Stop(syscall.SIGTERM, 10*time.Second); err != nil {
		t.Fatalf("Stop(SIGTERM): %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Stop(SIGTERM) took %v, want the process to exit at once", d)
	}
	if p.Running() {
		t.Fatalf("Running after Stop: got true, want false")
	}
	if st, ok := p.State().Sys().(syscall.WaitStatus); !ok || !st.Signaled() || st.Signal() != syscall.SIGTERM {
		t.Fatalf("State after Stop(SIGTERM): got %v, want killed by SIGTERM", p.State())
	}
	// Everything is idempotent once the process has exited.
	if err := p.Stop(syscall.SIGTERM, time.Minute); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	p.Kill()
	if err := p.Signal(syscall.SIGTERM); !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("Signal after exit: got %v, want os.ErrProcessDone", err)
	}
}

func TestProcessStopKillsAfterTimeout(t *testing.T) {
	t.Parallel()
	log := filepath.Join(t.TempDir(), "p.log")
	// SIGTERM stays ignored across exec.
	p := startProcess(t, log, "", `trap "" TERM; echo ready; exec sleep 60`)
	waitOutput(t, p, "ready\n")
	if err := p.Stop(syscall.SIGTERM, 200*time.Millisecond); err == nil {
		t.Fatalf("Stop of a process ignoring SIGTERM: got nil error, want one saying it was killed")
	}
	if st, ok := p.State().Sys().(syscall.WaitStatus); !ok || !st.Signaled() || st.Signal() != syscall.SIGKILL {
		t.Fatalf("State after Stop: got %v, want killed by SIGKILL", p.State())
	}
}

func TestProcessKillConcurrent(t *testing.T) {
	t.Parallel()
	p := startProcess(t, filepath.Join(t.TempDir(), "p.log"), "", "exec sleep 60")
	pid := p.Pid()
	done := make(chan struct{})
	for range 3 {
		go func() {
			p.Kill()
			done <- struct{}{}
		}()
	}
	for range 3 {
		<-done
	}
	if p.Running() {
		t.Fatalf("Running after Kill: got true, want false")
	}
	if got, want := p.Pid(), pid; got != want {
		t.Fatalf("Pid after Kill: got %d, want %d", got, want)
	}
}
