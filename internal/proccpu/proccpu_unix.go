//go:build unix

// Package proccpu reads the CPU time this process has used, for the
// benchmarks and make bench, which report CPU per message: a pipelined
// client spends much of its time waiting, so wall time says little of its
// cost.
package proccpu

import (
	"syscall"
	"time"
)

// Self returns the CPU time (user and system) this process has used so
// far, or 0 when it cannot be read.
func Self() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
