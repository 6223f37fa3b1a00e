//go:build !unix

package main

import "time"

// machineCPU is not measured on this system: it reports 0.
func machineCPU() time.Duration { return 0 }

// postmasterOf is not known on this system: it reports 0.
func postmasterOf(int) int { return 0 }

// treeCPU is not measured on this system: it reports 0.
func treeCPU(int) time.Duration { return 0 }

// brokerPID is not known on this system: it reports 0.
func brokerPID(string) int { return 0 }

// pidCPU is not measured on this system: it reports 0, false.
func pidCPU(int) (time.Duration, bool) { return 0, false }

// selfSyscalls is not measured on this system: it reports 0, 0.
func selfSyscalls() (reads, writes int64) { return 0, 0 }
