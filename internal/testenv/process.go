package testenv

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"time"
)

// Process is one child process of the test binary, started by
// [StartProcess] with its output appended to a log file. It is the one
// process of one start: a server that is stopped and started again is a
// new Process writing to the same log.
//
// The process is waited for by a goroutine of its own, which ends when the
// process exits; whoever starts a Process must end it with Kill or Stop
// (typically in t.Cleanup) so that neither the process nor that goroutine
// outlives the test.
//
// A Process is safe for concurrent use: Kill and Stop in particular may be
// called from any goroutine, at the same time, and again once the process
// has exited, when they do nothing.
type Process struct {
	cmd     *exec.Cmd
	logPath string
	offset  int64
	done    chan struct{} // closed once cmd has exited and been waited for
}

// StartProcess starts cmd with its standard output and standard error, if
// nil, appended to the file at logPath (created if need be), after a line
// "--- testenv <time>: <note>" that marks the start in the log. An empty
// note stands for cmd's command line. If cmd.SysProcAttr is nil, the
// process is made to die with the test binary on Linux (Pdeathsig), so that
// a test binary killed before t.Cleanup runs (by -timeout, say) leaves no
// process behind; a caller that sets SysProcAttr sets Pdeathsig itself.
func StartProcess(cmd *exec.Cmd, logPath, note string) (*Process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the child has its own copy
	var offset int64
	if fi, err := logf.Stat(); err == nil {
		offset = fi.Size()
	}
	if note == "" {
		note = cmd.Args[0] + " " + quoteArgs(cmd.Args[1:])
	}
	fmt.Fprintf(logf, "--- testenv %s: %s\n", time.Now().Format(time.RFC3339Nano), note)
	if cmd.Stdout == nil {
		cmd.Stdout = logf
	}
	if cmd.Stderr == nil {
		cmd.Stderr = logf
	}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = sysProcAttr()
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Process{cmd: cmd, logPath: logPath, offset: offset, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// Pid returns the process id, also once the process has exited.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Exited returns a channel closed once the process has exited and been
// waited for.
func (p *Process) Exited() <-chan struct{} { return p.done }

// Running reports whether the process has not exited yet.
func (p *Process) Running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// State returns how the process exited, or nil while it runs.
func (p *Process) State() *os.ProcessState {
	if p.Running() {
		return nil
	}
	return p.cmd.ProcessState
}

// Signal sends sig to the process. Once Exited is closed it sends nothing
// and returns [os.ErrProcessDone].
func (p *Process) Signal(sig os.Signal) error {
	return p.cmd.Process.Signal(sig)
}

// Kill kills the process with SIGKILL and waits for it to exit. Killing an
// exited process does nothing.
func (p *Process) Kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// Stop sends sig to the process (SIGTERM, say, for a graceful stop) and
// waits for it to exit, killing it with SIGKILL after timeout. It returns
// an error if it had to be killed; stopping an exited process does nothing
// and returns nil.
func (p *Process) Stop(sig os.Signal, timeout time.Duration) error {
	_ = p.Signal(sig)
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.done:
		return nil
	case <-t.C:
		p.Kill()
		return fmt.Errorf("testenv: process %d did not exit within %v of %v; killed", p.Pid(), timeout, sig)
	}
}

// Pause stops the process with SIGSTOP, as a stalled host would, until
// Resume, and returns once every thread of it has stopped (so that
// nothing sent after Pause returns is served before Resume). Only on
// Linux (proc_linux.go); elsewhere it returns an error.
func (p *Process) Pause() error { return signalStop(p.cmd.Process, true) }

// Resume continues the process with SIGCONT after Pause.
func (p *Process) Resume() error { return signalStop(p.cmd.Process, false) }

// LogPath returns the path of the log file the process's output goes to.
func (p *Process) LogPath() string { return p.logPath }

// Output returns the log from the line StartProcess wrote on: what this
// process has written to it so far, without what earlier processes
// started with the same log wrote.
func (p *Process) Output() string {
	f, err := os.Open(p.logPath)
	if err != nil {
		return ""
	}
	defer f.Close()
	if _, err := f.Seek(p.offset, io.SeekStart); err != nil {
		return ""
	}
	b, _ := io.ReadAll(f)
	return string(b)
}

// LogTail returns the last n bytes of the log file at path, such as a
// Process's LogPath, or "" if it cannot be read. It serves to show a log
// when a test fails, also after the process was stopped.
func LogTail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > n {
		_, _ = f.Seek(-n, io.SeekEnd)
	}
	b, _ := io.ReadAll(f)
	return string(b)
}
