//go:build unix

package main

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// processCPU is the CPU time this process used so far (user + system).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// machineCPU is the busy CPU time of the whole machine so far (every
// process: RabbitMQ, Redis and this one), from /proc/stat on Linux, or 0
// elsewhere.
func machineCPU() time.Duration {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	fields := strings.Fields(line)
	if len(fields) < 8 || fields[0] != "cpu" {
		return 0
	}
	// user nice system idle iowait irq softirq steal ...: all but idle
	// and iowait are busy.
	var busy int64
	for i, f := range fields[1:] {
		if i == 3 || i == 4 {
			continue
		}
		n, _ := strconv.ParseInt(f, 10, 64)
		busy += n
	}
	// /proc/stat counts in USER_HZ, 100 per second on every Linux port.
	return time.Duration(busy) * 10 * time.Millisecond
}
