package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// stagedPublisher publishes one staged message, confirmed. A *leftError
// means that the broker did not take the message (it is left; the next
// can be tried); any other error stops the run.
type stagedPublisher interface {
	publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error
}

// leftError says why the broker did not take a message.
type leftError struct{ why string }

func (e *leftError) Error() string { return e.why }

func left(format string, args ...any) error { return &leftError{fmt.Sprintf(format, args...)} }

// redriver re-drives the staged messages of one record.
type redriver struct {
	o       *options
	k       *keyFlags
	key     string // the message key
	skey    string // its store key
	admin   lock.Admin
	amender lock.Amender
	f       *redriveFlags
	// pub publishes; nil until the first publish, which dials --amqp.
	pub stagedPublisher
	// note is said after the summary (a record read again meanwhile).
	note string
	// until is when the claim this run took on publishing the staged
	// messages ends; zero until it took one.
	until time.Time
}

// run reads the record, publishes what is selected, marks what was
// confirmed, and reports.
func (r *redriver) run(ctx context.Context) error {
	rec, msgs, err := r.read(ctx)
	if err != nil {
		return err
	}
	defer func() {
		if p, ok := r.pub.(*amqpPublisher); ok {
			p.close()
		}
	}()
	out, err := r.selected(msgs)
	if err != nil {
		return err
	}
	if err := r.consent(out); err != nil {
		return err
	}
	if !r.f.dryRun && slices.ContainsFunc(out, func(d redriven) bool { return d.Action == "" }) {
		if rec, err = r.claim(ctx, rec, out); err != nil {
			return err
		}
	}
	var published []int // indexes confirmed, to mark
	var stopped error   // the run stopped early
	for i := range out {
		d := &out[i]
		if d.Action != "" {
			continue // left: not allowed in its state
		}
		if r.f.dryRun {
			d.Action = "would redrive"
			continue
		}
		if err := ctx.Err(); err != nil {
			stopped = withCode(exitFailed, "interrupted: %w", err)
			break
		}
		if time.Until(r.until) < r.o.timeout {
			// A publish confirmed after the claim passed may be a copy's
			// too: leave the rest to the next run.
			d.Action, d.Why = "left", "not published: this run's claim on the staged messages would pass first"
			stopped = withCode(exitRefused, "key %q: the claim on its staged messages (until %s) would pass before the next publish is confirmed: run again",
				r.key, r.until.Format(time.RFC3339))
			break
		}
		err := r.publish(ctx, msgs[d.Index])
		var le *leftError
		switch {
		case err == nil:
			d.Action = "published, not marked"
			published = append(published, d.Index)
		case errors.As(err, &le):
			d.Action, d.Why = "left", le.why
		default:
			d.Action, d.Why = "left", "not published: the run stopped here"
			stopped = err
		}
		if stopped != nil {
			break
		}
	}
	// Unmarked, what was published would be published again: harmless,
	// but mark it even when interrupted.
	var markErr error
	if len(published) > 0 || !r.until.IsZero() {
		mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.o.timeout)
		markErr = r.mark(mctx, rec, published)
		cancel()
		if markErr != nil && len(published) == 0 {
			// Nothing to mark: only the claim is left held, and it
			// passes by itself.
			r.note = fmt.Sprintf("the claim on the staged messages could not be given up (%v): it passes at %s", markErr, r.until.Format(time.RFC3339))
			markErr = nil
		}
		for i := range out {
			if out[i].Action != "published, not marked" {
				continue
			}
			if markErr == nil {
				out[i].Action = "redriven"
			} else {
				out[i].Why = markErr.Error()
			}
		}
	}
	var trimmed []redriven // what was looked at: all but those not reached
	for _, d := range out {
		if d.Action != "" {
			trimmed = append(trimmed, d)
		}
	}
	if err := r.report(trimmed); err != nil {
		return err
	}
	left := 0
	for _, d := range trimmed {
		if d.Action == "left" {
			left++
		}
	}
	switch {
	case stopped != nil:
		return stopped
	case markErr != nil:
		return markErr
	case left > 0:
		return withCode(exitRefused, "%s of key %q left unpublished (see why above)", plural(left, "staged message"), r.key)
	}
	return nil
}

// consent asks before publishing the messages selected by state rather
// than named by --index: how many, of which key, to which routing keys.
func (r *redriver) consent(out []redriven) error {
	if r.f.dryRun || len(r.f.indexes) > 0 {
		return nil
	}
	n := 0
	var to []string
	for _, d := range out {
		if d.Action == "" {
			n++
			if t := fmt.Sprintf("exchange %q routing key %q", d.Exchange, d.RoutingKey); !slices.Contains(to, t) {
				to = append(to, t)
			}
		}
	}
	if n == 0 {
		return nil
	}
	return r.o.consent(r.f.yes, fmt.Sprintf("outbox redrive: publish again %s of key %q on %s, to %s",
		plural(n, "staged message"), r.key, r.k.name(), strings.Join(to, "; ")))
}

// claim takes the claim on publishing the record rec's staged messages,
// as a copy of their message does (amqpidem.ClaimOutbox, compare-and-set):
// so that neither a consumer's copy of the message nor another redrive
// publishes them meanwhile, and that this run publishes nothing while one
// of them holds it. It lasts as long as this run's publishes and mark may
// take (--timeout each, and one for the dial). It returns the record as
// claimed; an error, nothing published, when the claim is held, or when
// the record changed so that out, the messages selected, is no longer
// what it would select.
func (r *redriver) claim(ctx context.Context, rec lock.Record, out []redriven) (lock.Record, error) {
	n := 0
	for _, d := range out {
		if d.Action == "" {
			n++
		}
	}
	for try := 1; ; try++ {
		held, err := amqpidem.OutboxClaim(rec.Value)
		if err != nil {
			return rec, withCode(exitFailed, "key %q of %s: the staged messages cannot be read: %w", r.key, r.k.name(), err)
		}
		if now := time.Now(); held.After(now) {
			return rec, withCode(exitRefused, "key %q of %s: its staged messages are being published by another outbox redrive or by a copy of their message (claimed until %s, %v from now): nothing published; inspect the record after that, and run again if some are left",
				r.key, r.k.name(), held.Format(time.RFC3339), held.Sub(now).Round(time.Second))
		}
		until := time.Now().Add(r.o.timeout * time.Duration(n+2))
		taken, err := amqpidem.ClaimOutbox(rec.Value, until)
		if err != nil {
			return rec, withCode(exitFailed, "key %q of %s: %w", r.key, r.k.name(), err)
		}
		cctx, cancel := context.WithTimeout(ctx, r.o.timeout)
		err = r.amender.Amend(cctx, r.skey, rec.Fence, rec.Value, taken)
		cancel()
		switch {
		case err == nil:
			r.until, rec.Value = until, taken
			return rec, nil
		case !errors.Is(err, lock.ErrChanged):
			return rec, withCode(exitFailed, "%s: claiming the staged messages of key %q: %w (nothing published)", r.o.storeName(), r.key, keyFree(err, r.skey))
		case try == maxMarks:
			return rec, withCode(exitRefused, "key %q of %s: the record kept changing while claiming its staged messages (%d tries): nothing published; run again", r.key, r.k.name(), try)
		}
		now, msgs, err := r.read(ctx)
		if err != nil {
			return rec, err
		}
		again, err := r.selected(msgs)
		if err != nil {
			return rec, err
		}
		if now.Fence != rec.Fence || !slices.Equal(again, out) {
			return rec, withCode(exitRefused, "key %q of %s: the record changed since it was read (another redrive or a consumer published staged messages): nothing published; inspect it, and run again",
				r.key, r.k.name())
		}
		rec = now
	}
}

// read reads the record and its staged messages; an error unless it is
// completed with some.
func (r *redriver) read(ctx context.Context) (lock.Record, []amqpidem.OutboxMessage, error) {
	cctx, cancel := context.WithTimeout(ctx, r.o.timeout)
	defer cancel()
	rec, err := r.admin.Inspect(cctx, r.skey)
	if err != nil {
		return rec, nil, r.o.storeError(r.key, r.k, err)
	}
	if rec.State != lock.StateCompleted {
		why := "only a completed record keeps staged messages"
		if rec.State == lock.StateInProgress {
			why = "its handler may be running: once the outcome is stored, its consumer publishes what it staged"
		}
		return rec, nil, withCode(exitRefused, "key %q of %s: the record is %s, not completed: %s", r.key, r.k.name(), rec.State, why)
	}
	msgs, err := amqpidem.StoredOutbox(rec.Value)
	switch {
	case err != nil:
		return rec, nil, withCode(exitFailed, "key %q of %s: the staged messages cannot be read: %w (%s)", r.key, r.k.name(), err, rec.Location)
	case len(msgs) == 0:
		return rec, nil, withCode(exitNotFound, "key %q of %s: its handler staged no messages", r.key, r.k.name())
	}
	return rec, msgs, nil
}

// selected lists the messages --index, --all and --force pick, those
// named but not allowed in their state already "left".
func (r *redriver) selected(msgs []amqpidem.OutboxMessage) ([]redriven, error) {
	describe := func(i int) redriven {
		m := msgs[i]
		return redriven{Index: i, State: m.State.String(), Tries: m.Tries, Exchange: m.Exchange, RoutingKey: m.RoutingKey,
			MessageID: m.Msg.MessageId}
	}
	var out []redriven
	if len(r.f.indexes) == 0 {
		for i, m := range msgs {
			if ok, _ := r.f.allowed(m.State); ok {
				out = append(out, describe(i))
			}
		}
		if len(out) == 0 {
			return nil, withCode(exitNotFound, "key %q of %s: nothing to redrive: %s (pending ones with --all, published ones with --force)",
				r.key, r.k.name(), outboxCounts(msgs))
		}
		return out, nil
	}
	seen := map[int]bool{}
	for _, i := range r.f.indexes {
		if i >= len(msgs) {
			return nil, withCode(exitNotFound, "key %q of %s: no staged message %d: the record has %s (0 to %d)",
				r.key, r.k.name(), i, plural(len(msgs), "staged message"), len(msgs)-1)
		}
		if seen[i] {
			continue
		}
		seen[i] = true
		d := describe(i)
		if ok, why := r.f.allowed(msgs[i].State); !ok {
			d.Action, d.Why = "left", why
		}
		out = append(out, d)
	}
	slices.SortFunc(out, func(a, b redriven) int { return a.Index - b.Index })
	return out, nil
}

// publish publishes m as stored.
func (r *redriver) publish(ctx context.Context, m amqpidem.OutboxMessage) error {
	if r.pub == nil {
		p, err := r.o.dialPublisher()
		if err != nil {
			return err
		}
		r.pub = p
	}
	return r.pub.publish(ctx, m.Exchange, m.RoutingKey, m.Msg)
}

// maxMarks bounds how often mark reads the record again after another
// writer changed it first.
const maxMarks = 5

// mark amends the record rec, whose messages of indexes published were
// confirmed, so that they are OutboxPublished: compare-and-set on the
// value read; when another writer (a consumer recording its own
// publishes) changed it first, on the value the record then holds, as
// long as it is the same completion (same fence).
func (r *redriver) mark(ctx context.Context, rec lock.Record, published []int) error {
	old := rec.Value
	for try := 1; ; try++ {
		value := old
		for _, i := range published {
			v, err := amqpidem.SetOutboxState(value, i, amqpidem.OutboxPublished)
			if err != nil {
				return withCode(exitFailed, "marking staged message %d: %w", i, err)
			}
			value = v
		}
		if held, err := amqpidem.OutboxClaim(value); err == nil && !r.until.IsZero() && held.Equal(time.UnixMilli(r.until.UnixMilli())) {
			// Still this run's claim (to the ms; another's of that same
			// ms would be given up early: its copy then finds the
			// messages published, or publishes one again): give it up.
			if v, err := amqpidem.ClaimOutbox(value, time.Time{}); err == nil {
				value = v
			}
		}
		if bytes.Equal(value, old) {
			if len(published) > 0 {
				// Only after this run's claim passed and another took
				// it: that one published them too.
				r.note = "they were marked published already, by a copy of their message or another redrive that took the claim once this run's passed: published twice (a duplicate downstream)"
			}
			return nil
		}
		err := r.amender.Amend(ctx, r.skey, rec.Fence, old, value)
		switch {
		case err == nil:
			return nil
		case !errors.Is(err, lock.ErrChanged):
			return withCode(exitFailed, "%s: marking them published: %w (they are published again by the next redrive)", r.o.storeName(), keyFree(err, r.skey))
		case try == maxMarks:
			return withCode(exitRefused, "the record kept changing while marking them published (%d tries); inspect it, and redrive again", try)
		}
		now, err := r.admin.Inspect(ctx, r.skey)
		switch {
		case errors.Is(err, lock.ErrNotFound):
			return withCode(exitRefused, "the record is gone (expired or forgotten) since it was read: nothing to mark")
		case err != nil:
			return withCode(exitFailed, "%s: reading the record again: %w (they are published again by the next redrive)", r.o.storeName(), keyFree(err, r.skey))
		case now.State != lock.StateCompleted || now.Fence != rec.Fence:
			return withCode(exitRefused, "the record was made again since it was read (now %s, fence %d, was %d): nothing to mark", now.State, now.Fence, rec.Fence)
		}
		r.note = "the record changed while this ran (a consumer recorded its own publishes): read again, and marked there"
		old = now.Value
	}
}

// report prints what redrive did.
func (r *redriver) report(out []redriven) error {
	if r.o.json {
		if out == nil {
			out = []redriven{}
		}
		return printJSON(r.o.stdout, out)
	}
	counts := map[string]int{}
	rows := [][]string{{"INDEX", "STATE", "TRIES", "EXCHANGE", "ROUTING KEY", "MESSAGE ID", "ACTION", "WHY"}}
	for _, d := range out {
		counts[d.Action]++
		rows = append(rows, []string{strconv.Itoa(d.Index), d.State, strconv.Itoa(d.Tries), oneLine(orDash(d.Exchange), 40),
			oneLine(orDash(d.RoutingKey), 60), oneLine(orDash(d.MessageID), 60), d.Action, d.Why})
	}
	if len(out) > 0 {
		table(r.o.stdout, rows)
	}
	summary := fmt.Sprintf("key %s of %s: %d redriven, %d would redrive, %d left", r.key, r.k.name(),
		counts["redriven"], counts["would redrive"], counts["left"])
	if n := counts["published, not marked"]; n > 0 {
		summary += fmt.Sprintf(", %d published but not marked", n)
	}
	fmt.Fprintln(r.o.stdout, escapeText(summary))
	if r.note != "" {
		fmt.Fprintln(r.o.stdout, escapeText(r.note))
	}
	return nil
}

// amqpPublisher is a stagedPublisher on RabbitMQ.
type amqpPublisher struct {
	c       *confirmer
	timeout time.Duration
}

// dialPublisher connects to RabbitMQ for outbox redrive.
func (o *options) dialPublisher() (*amqpPublisher, error) {
	conn, err := o.dial()
	if err != nil {
		return nil, err
	}
	c, err := newConfirmer(conn)
	if err != nil {
		conn.Close()
		return nil, err
	}
	return &amqpPublisher{c: c, timeout: o.timeout}, nil
}

func (p *amqpPublisher) publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	err := p.c.publish(ctx, exchange, key, msg, p.timeout)
	var cc *channelClosed
	switch {
	case err == nil:
		return nil
	case ctx.Err() != nil || p.c.conn.IsClosed():
		return withCode(exitFailed, "RabbitMQ: publishing to %s routing key %q: %w (not published)", exchangeName(exchange), key, err)
	case errors.As(err, &cc):
		if rerr := p.c.reopen(); rerr != nil {
			return rerr
		}
		if cc.code == amqp.NotFound {
			return left("%s does not exist (%d %s): declare it, and bind a queue to it for routing key %q", exchangeName(exchange), cc.code, amqpText(cc.reason), key)
		}
		return left("%v", err)
	case errors.Is(err, errUnroutable) && exchange == "":
		return left("returned again (%v): there is no queue %q", err, key)
	case errors.Is(err, errUnroutable):
		return left("returned again (%v): no queue is bound to %s for routing key %q", err, exchangeName(exchange), key)
	}
	return left("%v", err)
}

// close closes the connection.
func (p *amqpPublisher) close() { p.c.conn.Close() }

// amqpText is the name at the start of a broker's reply text: NOT_FOUND of
// "NOT_FOUND - no exchange 'x' in vhost '/'".
func amqpText(reason string) string {
	name, _, _ := strings.Cut(reason, " ")
	return name
}

// exchangeName names an exchange for messages.
func exchangeName(exchange string) string {
	if exchange == "" {
		return "the default exchange"
	}
	return fmt.Sprintf("exchange %q", exchange)
}
