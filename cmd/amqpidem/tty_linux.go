package main

import (
	"os"

	"golang.org/x/sys/unix"
)

// isTerminalFile reports whether f is a terminal: whether it has terminal
// attributes. (A mode of character device is not enough: /dev/null, the
// stdin of cron jobs and of exec.Command, is one.)
func isTerminalFile(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
