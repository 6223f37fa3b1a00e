package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// callContext bounds one command's service calls by --timeout.
func callContext(c *cobra.Command, o *options) (context.Context, context.CancelFunc) {
	return context.WithTimeout(c.Context(), o.timeout)
}

// dlqFlags name a dead-letter queue.
type dlqFlags struct {
	dlq string
}

func (f *dlqFlags) add(c *cobra.Command) {
	c.Flags().StringVar(&f.dlq, "dlq", "", "the dead-letter `queue`, when it is not QUEUE.dlq (Config.DeadLetterRoutingKey)")
}

func (f *dlqFlags) name(queue string) string {
	if f.dlq != "" {
		return f.dlq
	}
	return queue + ".dlq"
}

func newDLQ(o *options) *cobra.Command {
	c := &cobra.Command{
		Use:   "dlq",
		Short: "List and replay the dead letters of a queue",
		Long: `dlq works on the dead letters amqpidem published for a queue (by default to
the queue QUEUE.dlq), with the fault headers amqpidem gives them.`,
	}
	c.AddCommand(newDLQList(o), newDLQReplay(o))
	return c
}

// deadLetter is one dead letter as dlq list and replay report it.
type deadLetter struct {
	Index              int        `json:"index"`
	Key                string     `json:"key"`
	MessageID          string     `json:"message_id,omitempty"`
	Reason             string     `json:"reason"`
	Error              string     `json:"error"`
	Attempts           int64      `json:"attempts"`
	FirstSeen          *time.Time `json:"first_seen,omitempty"`
	OriginalExchange   string     `json:"original_exchange"`
	OriginalRoutingKey string     `json:"original_routing_key"`
	Consumer           string     `json:"consumer,omitempty"`
	BodyBytes          int        `json:"body_bytes"`
}

func describe(i int, d *amqp.Delivery) deadLetter {
	h := d.Headers
	dl := deadLetter{Index: i, MessageID: d.MessageId, Reason: text(h, amqpidem.HeaderReason), Error: text(h, amqpidem.HeaderError),
		Attempts: number(h, amqpidem.HeaderAttempt), OriginalExchange: text(h, amqpidem.HeaderOriginalExchange),
		OriginalRoutingKey: text(h, amqpidem.HeaderOriginalRoutingKey), Consumer: text(h, amqpidem.HeaderConsumer),
		BodyBytes: len(d.Body)}
	dl.Key = text(h, amqpidem.HeaderKey)
	if t, ok := h[amqpidem.HeaderFirstSeen].(time.Time); ok {
		dl.FirstSeen = timePtr(t)
	}
	return dl
}

// text reads a string header ("" when absent or of another type).
func text(h amqp.Table, name string) string {
	switch v := h[name].(type) {
	case string:
		return v
	case []byte:
		return string(v)
	}
	return ""
}

// number reads an integer header of any AMQP integer type.
func number(h amqp.Table, name string) int64 {
	switch v := h[name].(type) {
	case int8:
		return int64(v)
	case int16:
		return int64(v)
	case int32:
		return int64(v)
	case int64:
		return v
	case uint8:
		return int64(v)
	case uint16:
		return int64(v)
	case uint32:
		return int64(v)
	}
	return 0
}

// dlqSession is a connection and a channel that peeks at a dead-letter
// queue: basic.get without ack, so that every message not acked goes back
// to the queue, in its place, when the channel closes (or the process
// dies).
type dlqSession struct {
	conn  *amqp.Connection
	ch    *amqp.Channel
	queue string
	count int // messages in the queue when the session began
}

func (o *options) openDLQ(queue string) (*dlqSession, error) {
	conn, err := amqp.DialConfig(o.amqpURL, amqp.Config{Properties: amqp.Table{"connection_name": "amqpidem cli"}})
	if err != nil {
		return nil, withCode(exitFailed, "RabbitMQ at %s: %w", redactURL(o.amqpURL), err)
	}
	ch, err := conn.Channel()
	if err != nil {
		conn.Close()
		return nil, withCode(exitFailed, "RabbitMQ: opening a channel: %w", err)
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		conn.Close()
		var ae *amqp.Error
		if errors.As(err, &ae) && ae.Code == amqp.NotFound {
			return nil, withCode(exitNotFound, "queue %q does not exist (no dead letters yet, or see --dlq)", queue)
		}
		return nil, withCode(exitFailed, "queue %q: %w", queue, err)
	}
	return &dlqSession{conn: conn, ch: ch, queue: queue, count: q.Messages}, nil
}

// close gives back every message not acked: they return to the queue.
func (s *dlqSession) close() { s.conn.Close() }

// get takes the next message without acking it; ok is false when the queue
// has no more.
func (s *dlqSession) get() (amqp.Delivery, bool, error) {
	d, ok, err := s.ch.Get(s.queue, false)
	if err != nil {
		return d, false, withCode(exitFailed, "reading %q: %w", s.queue, err)
	}
	return d, ok, nil
}

func newDLQList(o *options) *cobra.Command {
	var f dlqFlags
	limit := 100
	c := &cobra.Command{
		Use:   "list QUEUE",
		Short: "List the dead letters of QUEUE without consuming them",
		Long: `list shows the dead letters of QUEUE (in QUEUE.dlq unless --dlq says
otherwise): key, reason, attempts, when first seen, the original exchange and
routing key, and the error. It reads them without acknowledging them and
gives them all back when done, so they stay in the queue, in order, even if
list is killed; RabbitMQ marks them redelivered.

Exit code 3 when the dead-letter queue does not exist.`,
		Example: `  amqpidem dlq list orders
  amqpidem dlq list orders --limit 1000 --json | jq '.[] | .key'`,
		Args: exactArgs(1, "one QUEUE"),
		RunE: func(c *cobra.Command, args []string) error {
			if limit < 1 {
				return withCode(exitUsage, "--limit must be at least 1")
			}
			s, err := o.openDLQ(f.name(args[0]))
			if err != nil {
				return err
			}
			defer s.close()
			p := &progress{w: o.stderr, on: o.progress && !o.json && s.count > 200, verb: "reading", total: min(limit, s.count)}
			var list []deadLetter
			for len(list) < min(limit, s.count) {
				d, ok, err := s.get()
				if err != nil {
					return err
				}
				if !ok {
					break
				}
				list = append(list, describe(len(list)+1, &d))
				p.step(len(list))
			}
			p.end()
			if o.json {
				if list == nil {
					list = []deadLetter{}
				}
				return printJSON(o.stdout, list)
			}
			fmt.Fprintf(o.stdout, "%s: %s", s.queue, plural(s.count, "dead letter"))
			if len(list) < s.count {
				fmt.Fprintf(o.stdout, ", the first %d shown (--limit)", len(list))
			}
			fmt.Fprintln(o.stdout)
			if len(list) == 0 {
				return nil
			}
			rows := [][]string{{"#", "KEY", "REASON", "ATTEMPTS", "FIRST SEEN", "EXCHANGE", "ROUTING KEY", "ERROR"}}
			for _, dl := range list {
				first := "-"
				if dl.FirstSeen != nil {
					first = dl.FirstSeen.Format(time.RFC3339)
				}
				rows = append(rows, []string{strconv.Itoa(dl.Index), oneLine(orDash(dl.Key), 40), dl.Reason, strconv.FormatInt(dl.Attempts, 10),
					first, orDash(dl.OriginalExchange), orDash(dl.OriginalRoutingKey), oneLine(dl.Error, 60)})
			}
			table(o.stdout, rows)
			return nil
		},
	}
	f.add(c)
	c.Flags().IntVar(&limit, "limit", limit, "list at most this many")
	return c
}

// plural is "n thing", with an s unless n is 1.
func plural(n int, thing string) string {
	if n == 1 {
		return "1 " + thing
	}
	return fmt.Sprintf("%d %ss", n, thing)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// replayed is what dlq replay did with one dead letter.
type replayed struct {
	deadLetter
	// Action: "replayed", "would replay" (--dry-run), or "left" (kept in
	// the dead-letter queue; Why says why).
	Action string `json:"action"`
	// Forgot is the state of the record forgotten first (--forget).
	Forgot string `json:"forgot,omitempty"`
	Why    string `json:"why,omitempty"`
}

func newDLQReplay(o *options) *cobra.Command {
	var f dlqFlags
	var k keyFlags
	var key string
	var all, forget, dryRun bool
	c := &cobra.Command{
		Use:   "replay QUEUE (--key KEY | --all) [--forget] [--dry-run]",
		Short: "Publish dead letters again to where they were first sent",
		Long: `replay republishes dead letters of QUEUE to their original exchange and
routing key (the headers amqpidem put on them), with publisher confirms, and
removes each dead letter only once its copy is confirmed. Killed at any point
it loses nothing: a dead letter not yet removed stays in the dead-letter
queue; one republished but not yet removed may be replayed twice, and the
record makes the second copy a duplicate.

A message that failed for good has a failed record: replayed as it is, it
would be dead-lettered again as a failed duplicate. --forget deletes that
failed record first (only a failed one, and only if it is still the one
read), so that the replay runs the handler again: fix the cause first.
Without --forget such dead letters are left in place and reported.
Dead letters whose record says completed (the work was done) are left too.

The header counting attempts is kept: a replayed message starts a fresh
count, since amqpidem ignores the count of a message that was dead-lettered.

Exit code 3 when no dead letter matched, 4 when some were left in place.`,
		Example: `  amqpidem dlq replay orders --key order-1042 --forget
  amqpidem dlq replay orders --all --forget --dry-run
  amqpidem dlq replay orders --all --forget`,
		Args: exactArgs(1, "one QUEUE"),
		RunE: func(c *cobra.Command, args []string) error {
			if all == (key != "") {
				return withCode(exitUsage, "give exactly one of --key KEY and --all")
			}
			k.queue = args[0]
			ctx, cancel := callContext(c, o)
			admin, closeStore, err := o.openStore(ctx)
			cancel()
			if err != nil {
				return err
			}
			defer closeStore()
			return o.replay(c.Context(), f.name(args[0]), &k, admin, key, forget, dryRun)
		},
	}
	f.add(c)
	c.Flags().StringVar(&k.endpoint, "endpoint", "", "the consumer's Config.Endpoint, when it is not QUEUE")
	c.Flags().StringVar(&key, "key", "", "replay the dead letters of this message `key` only")
	c.Flags().BoolVar(&all, "all", false, "replay every dead letter")
	c.Flags().BoolVar(&forget, "forget", false, "forget a failed record before replaying its message")
	c.Flags().BoolVar(&dryRun, "dry-run", false, "say what would be done, change nothing")
	return c
}

// replay goes once through the dead letters in dlq at the start, replaying
// those that match key (all when key is ""); those not replayed go back
// to the queue, in order, when the session closes.
func (o *options) replay(ctx context.Context, dlq string, k *keyFlags, admin lock.Admin, key string, forget, dryRun bool) error {
	s, err := o.openDLQ(dlq)
	if err != nil {
		return err
	}
	defer s.close()
	pub, err := newConfirmer(s.conn)
	if err != nil {
		return err
	}
	var out []replayed
	left, done := 0, 0
	p := &progress{w: o.stderr, on: o.progress && !o.json, verb: "replaying", total: s.count}
	for i := 1; i <= s.count; i++ {
		if err := ctx.Err(); err != nil {
			return withCode(exitFailed, "interrupted after %d of %d dead letters (the others stay in %s): %w", i-1, s.count, dlq, err)
		}
		d, ok, err := s.get()
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		p.step(i)
		dl := describe(i, &d)
		msgKey := dl.Key
		if msgKey == "" {
			msgKey = d.MessageId
		}
		if key != "" && msgKey != key {
			continue // not acked: it goes back when the session closes
		}
		r := replayed{deadLetter: dl}
		r.Action, r.Forgot, r.Why, err = o.replayOne(ctx, pub, &d, k, admin, msgKey, forget, dryRun)
		if err != nil {
			p.end()
			return err
		}
		switch r.Action {
		case "left":
			left++
		default:
			done++
		}
		out = append(out, r)
	}
	p.end()
	if err := o.report(out, dlq, dryRun); err != nil {
		return err
	}
	switch {
	case len(out) == 0 && key != "":
		return withCode(exitNotFound, "no dead letter of key %q in %s", key, dlq)
	case left > 0:
		return withCode(exitRefused, "%s left in %s (see why above)", plural(left, "dead letter"), dlq)
	}
	return nil
}

// replayOne replays d unless its record says not to; it returns what it
// did. An error is one that ends the whole replay.
func (o *options) replayOne(ctx context.Context, pub *confirmer, d *amqp.Delivery, k *keyFlags, admin lock.Admin, key string, forget, dryRun bool) (action, forgot, why string, err error) {
	h := d.Headers
	exchange, rk := text(h, amqpidem.HeaderOriginalExchange), text(h, amqpidem.HeaderOriginalRoutingKey)
	if _, ok := h[amqpidem.HeaderOriginalRoutingKey]; !ok {
		return "left", "", "no " + amqpidem.HeaderOriginalRoutingKey + " header: not a dead letter of amqpidem", nil
	}
	if key != "" {
		skey, err := k.storeKey(key)
		if err != nil {
			return "", "", "", err
		}
		cctx, cancel := context.WithTimeout(ctx, o.timeout)
		defer cancel()
		r, err := admin.Inspect(cctx, skey)
		switch {
		case errors.Is(err, lock.ErrNotFound):
		case err != nil:
			return "", "", "", withCode(exitFailed, "inspecting key %q: %w", key, err)
		case r.State == lock.StateCompleted:
			return "left", "", "record completed: the work was done", nil
		case r.State == lock.StateFailed && !forget:
			return "left", "", "record failed: it would be dead-lettered again; fix the cause and use --forget", nil
		case r.State == lock.StateFailed && dryRun:
			forgot = "failed"
		case r.State == lock.StateFailed:
			if err := admin.Forget(cctx, skey, r.State, r.Fence); err != nil && !errors.Is(err, lock.ErrNotFound) {
				if errors.Is(err, lock.ErrChanged) {
					return "left", "", "record changed while replaying; run replay again", nil
				}
				return "", "", "", withCode(exitFailed, "forgetting key %q: %w", key, err)
			}
			forgot = "failed"
		}
	}
	if dryRun {
		return "would replay", forgot, "", nil
	}
	if err := pub.publish(ctx, exchange, rk, replayCopy(d), o.timeout); err != nil {
		return "", forgot, "", withCode(exitFailed, "republishing the dead letter of key %q to exchange %q routing key %q: %w (it stays in the dead-letter queue)", key, exchange, rk, err)
	}
	if err := d.Ack(false); err != nil {
		return "", forgot, "", withCode(exitFailed, "removing the dead letter of key %q after its copy was confirmed: %w (it may be replayed again; the record makes that a duplicate)", key, err)
	}
	return "replayed", forgot, "", nil
}

// replayCopy is what replay publishes for dead letter d: d's properties,
// headers and body, without the broker's dead-lettering headers, and
// without an expiration: a replayed message must not expire on its way
// (amqpidem keeps the original one in HeaderOriginalExpiration).
func replayCopy(d *amqp.Delivery) amqp.Publishing {
	h := make(amqp.Table, len(d.Headers)+1)
	for k, v := range d.Headers {
		h[k] = v
	}
	for _, k := range []string{"x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
		"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", amqpidem.HeaderDeadLetterPending} {
		delete(h, k)
	}
	h["x-amqpidem-replayed-at"] = time.Now().UTC().Truncate(time.Second)
	return amqp.Publishing{Headers: h, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp.Persistent, Priority: d.Priority, CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo,
		MessageId: d.MessageId, Timestamp: d.Timestamp,
		Type: d.Type, AppId: d.AppId, Body: d.Body}
}

// report prints what replay did.
func (o *options) report(out []replayed, dlq string, dryRun bool) error {
	if o.json {
		if out == nil {
			out = []replayed{}
		}
		return printJSON(o.stdout, out)
	}
	counts := map[string]int{}
	var rows [][]string
	for _, r := range out {
		counts[r.Action]++
		if r.Action == "left" || dryRun || len(out) <= 50 {
			action := r.Action
			if r.Forgot != "" {
				action += " (forgot " + r.Forgot + " record)"
			}
			rows = append(rows, []string{strconv.Itoa(r.Index), oneLine(orDash(r.Key), 40), r.Reason, action, r.Why})
		}
	}
	if len(rows) > 0 {
		table(o.stdout, append([][]string{{"#", "KEY", "REASON", "ACTION", "WHY"}}, rows...))
	}
	fmt.Fprintf(o.stdout, "%s: %d replayed, %d would replay, %d left\n", dlq, counts["replayed"], counts["would replay"], counts["left"])
	return nil
}
