package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// sysProcAttr makes a child process die with the test binary, so that a
// binary killed before t.Cleanup runs (by -timeout, say) leaves no child
// behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// stopWait bounds how long signalStop waits for a process to stop.
const stopWait = 10 * time.Second

// signalStop sends p SIGSTOP (stop) or SIGCONT. After SIGSTOP it waits
// until every thread of p has stopped: the kernel stops them as each next
// runs, and on a loaded machine one may still run for a while after the
// signal was sent. (A paused DynamoDB server answered a request sent after
// Pause returned, its state still R.)
func signalStop(p *os.Process, stop bool) error {
	if !stop {
		return p.Signal(syscall.SIGCONT)
	}
	if err := p.Signal(syscall.SIGSTOP); err != nil {
		return err
	}
	deadline := time.Now().Add(stopWait)
	for {
		running := runningThreads(p.Pid)
		if running == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("testenv: process %d not stopped %v after SIGSTOP: %s", p.Pid, stopWait, running)
		}
		time.Sleep(time.Millisecond)
	}
}

// runningThreads lists the threads of process pid that have not stopped
// (state R, S or D in /proc/pid/task/*/stat), "" when none has, or when
// /proc cannot tell (the process is gone).
func runningThreads(pid int) string {
	stats, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	var running []string
	for _, path := range stats {
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		// tid (comm) state ...; comm may hold spaces and parentheses.
		s := string(b)
		i := strings.LastIndex(s, ") ")
		if i < 0 || i+2 >= len(s) {
			continue
		}
		switch st := s[i+2]; st {
		case 'R', 'S', 'D':
			running = append(running, fmt.Sprintf("thread %s in state %c", filepath.Base(filepath.Dir(path)), st))
		}
	}
	return strings.Join(running, ", ")
}
