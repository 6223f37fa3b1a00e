package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/amqpidem/amqpidem/internal/secret"
	"github.com/amqpidem/amqpidem/pgstore"
)

// relayOptions are the flags of relay and its subcommands.
type relayOptions struct {
	table string // pgstore Config.OutboxTable

	// relay (run)
	name        string
	ordered     bool
	batch       int
	concurrency int
	retention   time.Duration
	maxAttempts int

	// list
	state string
	after int64
	limit int

	// redrive
	all    bool
	dryRun bool
	yes    bool
}

// rowJSON is one outbox row, as relay list --json prints it.
type rowJSON struct {
	ID         int64      `json:"id"`
	State      string     `json:"state"`
	MessageID  string     `json:"message_id"`
	OrderKey   string     `json:"order_key,omitempty"`
	Exchange   string     `json:"exchange"`
	RoutingKey string     `json:"routing_key"`
	Attempts   int        `json:"attempts"`
	LastError  string     `json:"last_error,omitempty"`
	CreatedAt  time.Time  `json:"created_at"`
	SentAt     *time.Time `json:"sent_at,omitempty"`
	BodyBytes  int        `json:"body_bytes"`
	Unreadable string     `json:"unreadable,omitempty"`
}

func newRelay(o *options) *cobra.Command {
	ro := &relayOptions{}
	c := &cobra.Command{
		Use:   "relay",
		Short: "Publish the messages of pgstore's producer outbox (and list, re-drive them)",
		Long: `relay runs a pgstore.Relay on the producer outbox of the PostgreSQL
database --postgres names: it publishes, confirmed and mandatory, the
messages that transactions wrote with pgstore's Outbox.Write once they
committed, and marks them sent. Several relays may run at once, each with a
--name of its own: one started with the name of a relay running on the
same table logs an error and publishes nothing until that one stops (then
it takes over). It stops on SIGINT or SIGTERM, finishing the publishes in
flight (for up to 30 s; it says every 5 s that it still waits, and exits
with code 1 after 35 s whatever it waits for); a second signal ends it at
once. --timeout bounds each dial of the broker.

A message the broker refuses (no queue bound to take it, an exchange that
does not exist) is tried again with backoff and, after --max-attempts
refusals, is dead: "relay list --state dead" shows it with the broker's
reason, "relay redrive" publishes it again once the cause is fixed.`,
		Args: exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, _ []string) error { return runRelay(c.Context(), o, ro) },
	}
	c.PersistentFlags().StringVar(&ro.table, "outbox-table", "", "pgstore Config.OutboxTable (default amqpidem_outbox)")
	f := c.Flags()
	f.StringVar(&ro.name, "name", "", "the relay's name in its logs and claims (each relay's claims carry a random suffix of their own) (default host-pid-random)")
	f.BoolVar(&ro.ordered, "ordered", false, "publish each order key's messages one at a time, in the order their transactions committed (RelayConfig.Ordered)")
	f.IntVar(&ro.batch, "batch", 0, "rows per claim (default 128)")
	f.IntVar(&ro.concurrency, "concurrency", 0, "publishes waiting for their confirm at once, at most 64 (default 64)")
	f.DurationVar(&ro.retention, "retention", 0, "keep sent rows this long; negative deletes them at once (default 1h)")
	f.IntVar(&ro.maxAttempts, "max-attempts", 0, "refusals before a message is dead (default 10)")

	list := &cobra.Command{
		Use:   "list",
		Short: "List the outbox's rows in a state",
		Long: `list prints the outbox's rows in --state (pending, sent or dead), in the
order they were written, --limit at a time: --after the last ID shown
gives the next page.`,
		Args: exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, _ []string) error { return runRelayList(c.Context(), o, ro) },
	}
	list.Flags().StringVar(&ro.state, "state", "dead", "pending, sent or dead")
	list.Flags().Int64Var(&ro.after, "after", 0, "list the rows after this `ID`")
	list.Flags().IntVar(&ro.limit, "limit", 100, "list at most this many rows (at least 1)")

	redrive := &cobra.Command{
		Use:   "redrive [ID...]",
		Short: "Make dead rows pending again, for a relay to publish",
		Long: `redrive makes the dead rows with the IDs given (or every dead row, with
--all) pending again, their attempts reset: a running relay publishes them
at once. Fix what made the broker refuse them first (bind the queue,
declare the exchange), or they are dead again after --max-attempts tries.

--all says how many dead rows it would re-drive and asks first when stdin
is a terminal; when it is not (a script), --all needs --yes, else it
changes nothing and exits with code 2. --dry-run lists the dead rows it
would re-drive and changes nothing. It names the IDs given whose rows were
not dead (left as they were; --json: not_dead).
Exit code 3 when no row given was dead.`,
		Example: `  amqpidem relay redrive --all --dry-run
  amqpidem relay redrive --all
  amqpidem relay redrive 17 18`,
		RunE: func(c *cobra.Command, args []string) error { return runRelayRedrive(c.Context(), o, ro, args) },
	}
	redrive.Flags().BoolVar(&ro.all, "all", false, "re-drive every dead row")
	redrive.Flags().BoolVar(&ro.dryRun, "dry-run", false, "list the dead rows that would be re-driven, change nothing")
	redrive.Flags().BoolVar(&ro.yes, "yes", false, "re-drive --all without asking (needed when stdin is not a terminal)")

	status := &cobra.Command{
		Use:   "status",
		Short: "Say how many rows wait, how old the oldest is, and how many are dead",
		Args:  exactArgs(0, "no arguments"),
		RunE:  func(c *cobra.Command, _ []string) error { return runRelayStatus(c.Context(), o, ro) },
	}
	c.AddCommand(list, redrive, status)
	return c
}

// openOutbox connects to the database of --postgres; close releases it.
func (o *options) openOutbox(ctx context.Context, ro *relayOptions) (*pgstore.Outbox, *pgxpool.Pool, error) {
	if o.pgDSN == "" {
		return nil, nil, withCode(exitUsage, "relay needs --postgres (or AMQPIDEM_POSTGRES_DSN): the database of the outbox")
	}
	pool, err := pgxpool.New(ctx, o.pgDSN)
	if err != nil {
		return nil, nil, withCode(exitUsage, "--postgres: %v", err) // as openStore
	}
	ob, err := pgstore.NewOutbox(pool, pgstore.Config{Schema: o.pgSchema, OutboxTable: ro.table})
	if err != nil {
		pool.Close()
		return nil, nil, withCode(exitUsage, "%w", err)
	}
	return ob, pool, nil
}

// withOutbox runs fn with the outbox of --postgres and a context bounded
// by --timeout, then releases the connections.
func (o *options) withOutbox(ctx context.Context, ro *relayOptions, fn func(ctx context.Context, ob *pgstore.Outbox) error) error {
	ob, pool, err := o.openOutbox(ctx, ro)
	if err != nil {
		return err
	}
	defer pool.Close()
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	return fn(ctx, ob)
}

// relayStopTimeout is how long a stopping relay lets the publishes in
// flight finish (relay's help says 30 s), relayStopGrace how much longer
// it waits for them to give up before the command exits anyway, and
// relayStopLog how often it says meanwhile that it still waits.
const (
	relayStopTimeout = 30 * time.Second
	relayStopGrace   = 5 * time.Second
	relayStopLog     = 5 * time.Second
)

func runRelay(ctx context.Context, o *options, ro *relayOptions) error {
	if _, err := amqp.ParseURI(o.amqpURL); err != nil {
		return withCode(exitUsage, "%w", secret.ParseError("--amqp", o.amqpURL, err))
	}
	ob, pool, err := o.openOutbox(ctx, ro)
	if err != nil {
		return err
	}
	defer pool.Close()
	log := slog.New(slog.NewTextHandler(o.stderr, nil))
	// The relay's own dial would take amqp091-go's 30 s to give up on a
	// broker that accepts and never answers, and log nothing meanwhile:
	// --timeout bounds it, as every dial of the command.
	url, timeout := o.amqpURL, o.timeout
	dial := func() (*amqp.Connection, error) {
		conn, err := amqp.DialConfig(url, amqp.Config{Properties: amqp.Table{"connection_name": "amqpidem relay"},
			Locale: "en_US", Dial: boundedDial(timeout)})
		if err != nil && isTimeout(err) {
			err = fmt.Errorf("RabbitMQ at %s: no connection within --timeout %v: %w", secret.URL(url), timeout, err)
		}
		return conn, err
	}
	r, err := pgstore.NewRelay(ob, pgstore.RelayConfig{URL: o.amqpURL, Dial: dial, Name: ro.name, Ordered: ro.ordered,
		Batch: ro.batch, Concurrency: ro.concurrency, Retention: ro.retention, MaxAttempts: ro.maxAttempts, Logger: log})
	if err != nil {
		return withCode(exitUsage, "%w", err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(context.WithoutCancel(ctx)) }()
	log.Info("amqpidem relay: running", "amqp", secret.URL(o.amqpURL))
	select {
	case err := <-done:
		return withCode(exitFailed, "%w", err)
	case <-ctx.Done():
	}
	log.Info("amqpidem relay: stopping: finishing the publishes in flight", "up_to", relayStopTimeout)
	sctx, cancel := context.WithTimeout(context.Background(), relayStopTimeout)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- r.Shutdown(sctx) }()
	// Shutdown waits for Run, which waits for what its publishes and
	// marks are blocked in once sctx ends: bounded here, and said.
	began := time.Now()
	hard := time.NewTimer(relayStopTimeout + relayStopGrace)
	defer hard.Stop()
	tick := time.NewTicker(relayStopLog)
	defer tick.Stop()
	var serr error
wait:
	for {
		select {
		case serr = <-stopped:
			break wait
		case <-tick.C:
			log.Warn("amqpidem relay: still stopping", "waited", time.Since(began).Round(time.Second), "up_to", relayStopTimeout+relayStopGrace)
		case <-hard.C:
			// Its rows stay claimed until their claim ends, then another
			// relay (or the next run) publishes them.
			return withCode(exitFailed, "the relay did not stop within %v: exiting with its publishes in flight (their rows are published again once their claim ends)",
				relayStopTimeout+relayStopGrace)
		}
	}
	<-done
	pub, refused, dead := r.Counts()
	log.Info("amqpidem relay: stopped", "published", pub, "refused", refused, "dead", dead)
	if serr != nil {
		return withCode(exitFailed, "shutdown cut the publishes in flight short (their rows are published again): %w", serr)
	}
	return nil
}

func runRelayList(ctx context.Context, o *options, ro *relayOptions) error {
	if ro.limit < 1 || ro.after < 0 {
		return withCode(exitUsage, "relay list: --limit %d --after %d: list at least one row, after an ID of 0 or more", ro.limit, ro.after)
	}
	return o.withOutbox(ctx, ro, func(ctx context.Context, ob *pgstore.Outbox) error {
		rows, err := ob.List(ctx, ro.state, ro.after, ro.limit)
		if err != nil {
			if errors.Is(err, pgstore.ErrOutboxState) {
				return withCode(exitUsage, "--state: %w", err)
			}
			return withCode(exitFailed, "%w", err)
		}
		if o.json {
			out := make([]rowJSON, 0, len(rows))
			for _, r := range rows {
				j := rowJSON{ID: r.ID, State: r.State, MessageID: r.MessageID, OrderKey: r.OrderKey, Exchange: r.Exchange,
					RoutingKey: r.RoutingKey, Attempts: r.Attempts, LastError: r.LastError, CreatedAt: r.CreatedAt,
					SentAt: timePtr(r.SentAt), BodyBytes: len(r.Publishing.Body)}
				if r.Err != nil {
					j.Unreadable = r.Err.Error()
				}
				out = append(out, j)
			}
			return printJSON(o.stdout, out)
		}
		if len(rows) == 0 {
			fmt.Fprintf(o.stdout, "no %s rows\n", ro.state)
			return nil
		}
		t := [][]string{{"ID", "MESSAGE ID", "EXCHANGE", "ROUTING KEY", "ATTEMPTS", "CREATED", "LAST ERROR"}}
		for _, r := range rows {
			last := r.LastError
			if r.Err != nil {
				last = "unreadable: " + r.Err.Error()
			}
			t = append(t, []string{strconv.FormatInt(r.ID, 10), oneLine(r.MessageID, 40), oneLine(orDash(r.Exchange), 30),
				oneLine(orDash(r.RoutingKey), 40), strconv.Itoa(r.Attempts), when(r.CreatedAt), oneLine(orDash(last), 200)})
		}
		table(o.stdout, t)
		if len(rows) == ro.limit {
			fmt.Fprintf(o.stdout, "more may follow: --after %d\n", rows[len(rows)-1].ID)
		}
		return nil
	})
}

func runRelayRedrive(ctx context.Context, o *options, ro *relayOptions, args []string) error {
	if ro.all == (len(args) > 0) {
		return withCode(exitUsage, "relay redrive takes the IDs of dead rows, or --all (see relay list --state dead)")
	}
	ids := make([]int64, 0, len(args))
	for _, a := range args {
		id, err := strconv.ParseInt(a, 10, 64)
		if err != nil || id <= 0 {
			return withCode(exitUsage, "relay redrive: %q is not a row ID", a)
		}
		ids = append(ids, id)
	}
	if ro.dryRun {
		return runRelayRedriveDry(ctx, o, ro, ids)
	}
	ob, pool, err := o.openOutbox(ctx, ro)
	if err != nil {
		return err
	}
	defer pool.Close()
	if ro.all {
		cctx, cancel := context.WithTimeout(ctx, o.timeout)
		dead, err := ob.Dead(cctx)
		cancel()
		if err != nil {
			return withCode(exitFailed, "%w", err)
		}
		if dead > 0 {
			if err := o.consent(ro.yes, fmt.Sprintf("relay redrive --all: make all %s of outbox table %s pending again (a running relay publishes them at once)",
				plural(int(dead), "dead row"), o.outboxTable(ro))); err != nil {
				return err
			}
		}
	}
	// --timeout starts once the operator said yes.
	cctx, cancel := context.WithTimeout(ctx, o.timeout)
	var n int64
	var notDead []int64 // of ids: those that were not dead rows
	if ro.all {
		n, err = ob.Redrive(cctx)
	} else {
		var done []int64
		done, err = ob.RedriveIDs(cctx, ids...)
		n = int64(len(done))
		for _, id := range ids {
			if !slices.Contains(done, id) && !slices.Contains(notDead, id) {
				notDead = append(notDead, id)
			}
		}
	}
	cancel()
	if err != nil {
		return withCode(exitFailed, "%w", err)
	}
	if o.json {
		out := struct {
			Redriven int64   `json:"redriven"`
			NotDead  []int64 `json:"not_dead,omitempty"`
		}{n, notDead}
		if err := printJSON(o.stdout, out); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(o.stdout, "%s pending again\n", plural(int(n), "dead row"))
		if len(notDead) > 0 {
			fmt.Fprintf(o.stdout, "not dead, left as they were: %s (see relay list --state pending, sent or dead)\n", idList(notDead))
		}
	}
	if n == 0 {
		return withCode(exitNotFound, "no dead row to re-drive")
	}
	return nil
}

// idList is ids as a person reads them: "3, 4 and 99999".
func idList(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	if len(s) == 1 {
		return s[0]
	}
	return strings.Join(s[:len(s)-1], ", ") + " and " + s[len(s)-1]
}

// runRelayRedriveDry lists the dead rows relay redrive would make pending
// (those of ids, or every one when ids is empty), and changes nothing.
func runRelayRedriveDry(ctx context.Context, o *options, ro *relayOptions, ids []int64) error {
	want := map[int64]bool{}
	for _, id := range ids {
		want[id] = true
	}
	var rows []pgstore.OutboxRow
	err := o.withOutbox(ctx, ro, func(ctx context.Context, ob *pgstore.Outbox) error {
		const page = 1000
		for after := int64(0); ; {
			got, err := ob.List(ctx, "dead", after, page)
			if err != nil {
				return withCode(exitFailed, "%w", err)
			}
			for _, r := range got {
				if len(want) == 0 || want[r.ID] {
					rows = append(rows, r)
				}
			}
			if len(got) < page {
				return nil
			}
			after = got[len(got)-1].ID
		}
	})
	if err != nil {
		return err
	}
	if o.json {
		out := struct {
			WouldRedrive int     `json:"would_redrive"`
			IDs          []int64 `json:"ids"`
		}{len(rows), []int64{}}
		for _, r := range rows {
			out.IDs = append(out.IDs, r.ID)
		}
		if err := printJSON(o.stdout, out); err != nil {
			return err
		}
	} else {
		if len(rows) > 0 {
			t := [][]string{{"ID", "MESSAGE ID", "EXCHANGE", "ROUTING KEY", "ATTEMPTS", "LAST ERROR"}}
			for _, r := range rows {
				t = append(t, []string{strconv.FormatInt(r.ID, 10), oneLine(r.MessageID, 40), oneLine(orDash(r.Exchange), 30),
					oneLine(orDash(r.RoutingKey), 40), strconv.Itoa(r.Attempts), oneLine(orDash(r.LastError), 200)})
			}
			table(o.stdout, t)
		}
		fmt.Fprintf(o.stdout, "%s of %s would be pending again (--dry-run: nothing changed)\n", plural(len(rows), "dead row"), o.outboxTable(ro))
	}
	if len(rows) == 0 {
		return withCode(exitNotFound, "no dead row to re-drive")
	}
	return nil
}

// outboxTable names the outbox table of --pg-schema and --outbox-table,
// as a person reads it.
func (o *options) outboxTable(ro *relayOptions) string {
	t := ro.table
	if t == "" {
		t = "amqpidem_outbox"
	}
	if o.pgSchema != "" {
		t = o.pgSchema + "." + t
	}
	return t
}

func runRelayStatus(ctx context.Context, o *options, ro *relayOptions) error {
	return o.withOutbox(ctx, ro, func(ctx context.Context, ob *pgstore.Outbox) error {
		n, oldest, err := ob.Backlog(ctx)
		if err != nil {
			return withCode(exitFailed, "%w", err)
		}
		dead, err := ob.Dead(ctx)
		if err != nil {
			return withCode(exitFailed, "%w", err)
		}
		if o.json {
			return printJSON(o.stdout, map[string]any{"pending": n, "oldest_pending_seconds": oldest.Seconds(), "dead": dead})
		}
		fmt.Fprintf(o.stdout, "pending: %d (oldest %v)\ndead: %d\n", n, oldest.Round(time.Millisecond), dead)
		if dead > 0 {
			fmt.Fprintln(o.stdout, "list the dead rows with: amqpidem relay list --state dead")
		}
		return nil
	})
}
