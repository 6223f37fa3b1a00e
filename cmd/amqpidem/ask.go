package main

import (
	"bufio"
	"fmt"
	"strings"
)

// consent decides whether a bulk action that changes things (what says
// which, and how many) may go ahead. --yes (yes) says so beforehand. On
// a terminal stdin the operator is asked, and only "y" or "yes" goes
// ahead: anything else, or end of input, leaves everything as it was
// (exit code 4). When stdin is not a terminal (a script, CI) nobody can
// be asked: without --yes it fails with exit code 2 before changing
// anything.
func (o *options) consent(yes bool, what string) error {
	if yes {
		return nil
	}
	if !o.stdinTerminal {
		return withCode(exitUsage, "%s: not done: stdin is not a terminal to ask on; add --yes to do it (or --dry-run to see what would happen)", what)
	}
	fmt.Fprintf(o.stderr, "amqpidem: %s.\nGo ahead? [y/N] ", escapeText(what))
	line, _ := bufio.NewReader(o.stdin).ReadString('\n')
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		return nil
	}
	return withCode(exitRefused, "not confirmed: nothing changed")
}
