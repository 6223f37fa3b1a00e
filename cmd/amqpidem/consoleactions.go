package main

import (
	"bytes"
	"context"
	"strings"

	"github.com/amqpidem/amqpidem/console"
	"github.com/amqpidem/amqpidem/lock"
)

// consoleActions are the console's forget, replay and redrive, carried out by the
// command's own code: forget's rules (forgetRecord) and dlq replay run in
// this process, with this process's store and broker flags, their report
// what the command would print, their exit code the outcome's status.
type consoleActions struct {
	o     *options
	admin lock.Admin
	// keyFile is the console's --signing-key-file, given to dlq replay.
	keyFile string
	// outboxTable is the console's --outbox-table, given to relay
	// redrive.
	outboxTable string
}

// outcome is the console's Outcome of a command that returned err,
// having printed report: done for exit code 0, refused for 3 (nothing
// found) and 4 (refused, left undone), failed otherwise.
func outcome(report *bytes.Buffer, err error) console.Outcome {
	out := console.Outcome{Status: console.Failed}
	switch codeOf(err, report) {
	case exitOK:
		out.Status = console.Done
	case exitNotFound, exitRefused:
		out.Status = console.Refused
	}
	out.Report = report.String()
	return out
}

// Forget forgets the failed record with req.Fence of req.Key, by forget's
// rules; any other record (not failed, or changed since the operator saw
// it) is refused.
func (a *consoleActions) Forget(ctx context.Context, req console.ForgetRequest) console.Outcome {
	var report bytes.Buffer
	o := a.o.here(&report)
	k := &keyFlags{endpoint: req.Endpoint}
	skey, err := k.storeKey(req.Key)
	if err != nil {
		return outcome(&report, err)
	}
	r, err := a.admin.Inspect(ctx, skey)
	switch {
	case err != nil:
		err = o.storeError(req.Key, k, err)
	case r.State != lock.StateFailed:
		err = withCode(exitRefused, "key %q of %s: the record is %s now, not failed: the console forgets only failed records; nothing forgotten",
			req.Key, k.name(), r.State)
	case r.Fence != req.Fence:
		err = withCode(exitRefused, "key %q of %s: the record changed since it was shown (fence %d, now %d): nothing forgotten; look at it again",
			req.Key, k.name(), req.Fence, r.Fence)
	default:
		err = o.forgetRecord(ctx, a.admin, k, req.Key, skey, r, false, req.DryRun)
	}
	return outcome(&report, err)
}

// Replay runs "dlq replay QUEUE --key KEY [--dlq D] [--forget] [--dry-run]"
// in this process, with the console's flags.
func (a *consoleActions) Replay(ctx context.Context, req console.ReplayRequest) console.Outcome {
	args := []string{"dlq", "replay", "--key=" + req.Key}
	if req.DLQ != "" {
		args = append(args, "--dlq="+req.DLQ)
	}
	if req.Forget {
		args = append(args, "--forget")
	}
	if req.DryRun {
		args = append(args, "--dry-run")
	}
	if a.keyFile != "" {
		args = append(args, "--signing-key-file="+a.keyFile)
	}
	return a.run(ctx, append(args, "--", req.Queue)) // a queue named "-x" is not a flag
}

// here is a copy of o's service flags for a command run in this process,
// printing text to out, asking nothing (bulk actions then need --yes,
// which the console never gives).
func (o *options) here(out *bytes.Buffer) *options {
	c := *o
	c.stdout, c.stderr, c.json, c.progress = out, out, false, false
	c.stdin, c.stdinTerminal = strings.NewReader(""), false
	return &c
}
