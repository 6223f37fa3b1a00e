package testenv_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// procState returns the state letter of process pid in /proc: R, S, T...
func procState(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// pid (comm) state ...; comm may hold spaces and parentheses.
	_, rest, ok := strings.Cut(string(b), ") ")
	if !ok || rest == "" {
		t.Fatalf("/proc/%d/stat: %q", pid, b)
	}
	return rest[:1]
}

// waitState waits until process pid is in state want, for at most 10 s.
func waitState(t *testing.T, pid int, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := procState(t, pid)
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("state of process %d: got %s, want %s", pid, got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestProcessPauseResume(t *testing.T) {
	t.Parallel()
	p := startProcess(t, filepath.Join(t.TempDir(), "p.log"), "", "exec sleep 60")
	if err := p.Pause(); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	waitState(t, p.Pid(), "T")
	if err := p.Resume(); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	waitState(t, p.Pid(), "S")
	p.Kill()
	if err := p.Pause(); err == nil {
		t.Fatalf("Pause after Kill: got nil error, want one")
	}
}

func TestProcessDiesWithTestBinary(t *testing.T) {
	t.Parallel()
	cmd := exec.Command("sh", "-c", "true")
	p, err := testenv.StartProcess(cmd, filepath.Join(t.TempDir(), "p.log"), "")
	if err != nil {
		t.Fatalf("StartProcess: %v", err)
	}
	p.Kill()
	if cmd.SysProcAttr == nil || cmd.SysProcAttr.Pdeathsig != syscall.SIGKILL {
		t.Fatalf("SysProcAttr: got %+v, want Pdeathsig SIGKILL", cmd.SysProcAttr)
	}
}
