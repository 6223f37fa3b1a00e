package testenv

import "syscall"

// sysProcAttr makes a child process die with the test binary, so that a
// binary killed before t.Cleanup runs (by -timeout, say) leaves no
// redis-server behind.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
