package testenv

import (
	"os"
	"syscall"
)

// sysProcAttr makes a child process die with the test binary, so that a
// binary killed before t.Cleanup runs (by -timeout, say) leaves no child
// behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// signalStop sends p SIGSTOP (stop) or SIGCONT.
func signalStop(p *os.Process, stop bool) error {
	if stop {
		return p.Signal(syscall.SIGSTOP)
	}
	return p.Signal(syscall.SIGCONT)
}
