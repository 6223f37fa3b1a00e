//go:build !unix

// Package proccpu reads the CPU time this process has used; outside Unix
// it is not measured.
package proccpu

import "time"

// Self returns 0: this process's CPU time is read on Unix only.
func Self() time.Duration { return 0 }
