//go:build !linux

package main

import "syscall"

// childAttr is nil here: the replica is killed when the run ends.
func childAttr() *syscall.SysProcAttr { return nil }
