package main

import (
	"bytes"
	"context"
	"strconv"
	"time"

	"github.com/amqpidem/amqpidem/console"
	"github.com/amqpidem/amqpidem/pgstore"
)

// outboxRelay is the console's view of pgstore's producer outbox, read
// as "relay status" and "relay list" read it.
type outboxRelay struct{ ob *pgstore.Outbox }

// Backlog is the outbox's pending rows and the oldest one's age.
func (r outboxRelay) Backlog(ctx context.Context) (int64, time.Duration, error) {
	return r.ob.Backlog(ctx)
}

// Dead is how many rows are dead.
func (r outboxRelay) Dead(ctx context.Context) (int64, error) { return r.ob.Dead(ctx) }

// Rows lists the rows in state after the row with ID after.
func (r outboxRelay) Rows(ctx context.Context, state string, after int64, limit int) ([]console.RelayRow, error) {
	rows, err := r.ob.List(ctx, state, after, limit)
	if err != nil {
		return nil, err
	}
	out := make([]console.RelayRow, len(rows))
	for i, row := range rows {
		out[i] = console.RelayRow{ID: row.ID, MessageID: row.MessageID, Exchange: row.Exchange, RoutingKey: row.RoutingKey,
			Attempts: row.Attempts, LastError: row.LastError, CreatedAt: row.CreatedAt}
		if row.Err != nil {
			out[i].Unreadable = row.Err.Error()
		}
	}
	return out, nil
}

// Redrive runs "relay redrive ID [--dry-run]" in this process, with the
// console's flags: the command's rules (only a dead row is made pending)
// and exit codes (3, none was dead: refused).
func (a *consoleActions) Redrive(ctx context.Context, req console.RedriveRequest) console.Outcome {
	args := []string{"relay", "redrive"}
	if a.outboxTable != "" {
		args = append(args, "--outbox-table="+a.outboxTable)
	}
	if req.DryRun {
		args = append(args, "--dry-run")
	}
	return a.run(ctx, append(args, "--", strconv.FormatInt(req.ID, 10)))
}

// run runs the command of args in this process with the console's
// flags, its report what it printed.
func (a *consoleActions) run(ctx context.Context, args []string) console.Outcome {
	var report bytes.Buffer
	o := a.o.here(&report)
	root := newRoot(o)
	*o = *a.o.here(&report) // newRoot set the flags' defaults from the environment: this process's flags instead
	root.SetArgs(args)
	root.SetOut(&report)
	root.SetErr(&report)
	return outcome(&report, root.ExecuteContext(ctx))
}
