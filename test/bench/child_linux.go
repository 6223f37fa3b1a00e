package main

import "syscall"

// childAttr makes a child process (the replica) die with the bench.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
