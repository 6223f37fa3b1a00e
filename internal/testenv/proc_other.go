//go:build !linux

package testenv

import "syscall"

// sysProcAttr returns nil: outside Linux, child processes are only killed by
// t.Cleanup.
func sysProcAttr() *syscall.SysProcAttr { return nil }
