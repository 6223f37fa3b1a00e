//go:build !linux

package testenv

import (
	"errors"
	"os"
	"syscall"
)

// sysProcAttr returns nil: outside Linux, child processes are only killed by
// t.Cleanup.
func sysProcAttr() *syscall.SysProcAttr { return nil }

// signalStop is not available here.
func signalStop(p *os.Process, stop bool) error {
	return errors.New("testenv: pausing a process needs SIGSTOP (Linux)")
}
