package main

import (
	"context"
	"errors"
	"fmt"
	"io"
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
	Endpoint           string     `json:"endpoint,omitempty"`
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

// printDeadLetters writes the text output of dlq list: how many dead
// letters queue holds, then list as a table. Every value from a dead
// letter is escaped (table, oneLine): its headers are whatever a
// publisher or a consumer put there.
func printDeadLetters(w io.Writer, queue string, count int, list []deadLetter) {
	fmt.Fprintf(w, "%s: %s", escapeText(queue), plural(count, "dead letter"))
	if len(list) < count {
		fmt.Fprintf(w, ", the first %d shown (--limit)", len(list))
	}
	fmt.Fprintln(w)
	if len(list) == 0 {
		return
	}
	rows := [][]string{{"#", "KEY", "REASON", "ATTEMPTS", "FIRST SEEN", "EXCHANGE", "ROUTING KEY", "ERROR"}}
	for _, dl := range list {
		first := "-"
		if dl.FirstSeen != nil {
			first = dl.FirstSeen.Format(time.RFC3339)
		}
		rows = append(rows, []string{strconv.Itoa(dl.Index), oneLine(orDash(dl.Key), 40), oneLine(dl.Reason, 40), strconv.FormatInt(dl.Attempts, 10),
			first, oneLine(orDash(dl.OriginalExchange), 40), oneLine(orDash(dl.OriginalRoutingKey), 60), oneLine(dl.Error, 60)})
	}
	table(w, rows)
}

func describe(i int, d *amqp.Delivery) deadLetter {
	h := d.Headers
	dl := deadLetter{Index: i, MessageID: d.MessageId, Reason: text(h, amqpidem.HeaderReason), Error: text(h, amqpidem.HeaderError),
		Attempts: number(h, amqpidem.HeaderAttempt), OriginalExchange: text(h, amqpidem.HeaderOriginalExchange),
		OriginalRoutingKey: text(h, amqpidem.HeaderOriginalRoutingKey), Consumer: text(h, amqpidem.HeaderConsumer),
		BodyBytes: len(d.Body)}
	dl.Endpoint = text(h, amqpidem.HeaderEndpoint)
	if _, ok := h[amqpidem.HeaderKey]; ok {
		dl.Key = text(h, amqpidem.HeaderKey)
	} else {
		dl.Key = d.MessageId // a dead letter of an older amqpidem: the default key
	}
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
	conn, err := o.dial()
	if err != nil {
		return nil, err
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
list is killed; RabbitMQ marks them redelivered. On a quorum dead-letter
queue with a delivery limit (x-delivery-limit; RabbitMQ 4 sets 20 by
default), each look counts as a delivery of each message read: one looked at
more often than the limit is dropped. amqpidem's own QUEUE.dlq is classic
unless Config.DeadLetterQueueArgs says otherwise.

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
			printDeadLetters(o.stdout, s.queue, s.count, list)
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
	var all, forget, dryRun, original, yes bool
	c := &cobra.Command{
		Use:   "replay QUEUE (--key KEY | --all) [--forget] [--dry-run] [--yes]",
		Short: "Publish dead letters of QUEUE back to QUEUE",
		Long: `replay publishes dead letters of QUEUE (in QUEUE.dlq unless --dlq says
otherwise) back to QUEUE, with publisher confirms, and removes each dead
letter only once its copy is confirmed. Killed at any point it loses
nothing: a dead letter not yet removed stays in the dead-letter queue; one
republished but not yet removed may be replayed twice, and the record makes
the second copy a duplicate.

A message that failed for good has a failed record: replayed as it is, it
would be dead-lettered again as a failed duplicate. --forget deletes that
failed record first (only a failed one, and only if it is still the one
read), so that the replay runs the handler again: fix the cause first.
Without --forget such dead letters are left in place and reported. Left in
place too, with the reason: dead letters whose record says completed (the
work was done), those of messages without a usable key or with a key
conflict (a replay would be dead-lettered again), and those whose copy the
broker did not take.

Records are looked up under QUEUE's own endpoint, or --endpoint when the
consumer sets Config.Endpoint: a dead letter naming another endpoint in its
header is left, with the flag that would act on it (a header can be written
by whoever published the message, and is never enough to touch another
endpoint's records).

The copy goes to QUEUE through the default exchange, not to the exchange the
message was first published to: that exchange may route it to other queues
too, whose consumers would see it again. --to-original-exchange publishes
it to the original exchange and routing key instead.

The header counting attempts is kept: a replayed message starts a fresh
count, since amqpidem ignores the count of a message that was dead-lettered.

--all --forget says how many dead letters it would go through and asks
first when stdin is a terminal; when it is not (a script), it needs --yes,
else it changes nothing and exits with code 2. --dry-run says what would be
done with each dead letter and changes nothing.

Exit code 3 when no dead letter matched, 4 when some were left in place, 1
when the run stopped early (what was done is reported first).`,
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
			r := &replayer{o: o, queue: args[0], k: &k, admin: admin, forget: forget, dryRun: dryRun, original: original,
				ask: all && forget && !dryRun, yes: yes}
			return r.run(c.Context(), f.name(args[0]), key)
		},
	}
	f.add(c)
	c.Flags().StringVar(&k.endpoint, "endpoint", "", "the consumer's Config.Endpoint, for dead letters that do not name it")
	c.Flags().StringVar(&key, "key", "", "replay the dead letters of this message `key` only")
	c.Flags().BoolVar(&all, "all", false, "replay every dead letter")
	c.Flags().BoolVar(&forget, "forget", false, "forget a failed record before replaying its message")
	c.Flags().BoolVar(&dryRun, "dry-run", false, "say what would be done, change nothing")
	c.Flags().BoolVar(&original, "to-original-exchange", false, "publish to the exchange and routing key the message was first published to")
	c.Flags().BoolVar(&yes, "yes", false, "replay --all --forget without asking (needed when stdin is not a terminal)")
	return c
}

// replayer replays the dead letters of one queue.
type replayer struct {
	o        *options
	queue    string
	k        *keyFlags
	admin    lock.Admin
	forget   bool
	dryRun   bool
	original bool
	// ask: a bulk replay (--all --forget) needs consent, or yes.
	ask, yes bool
	pub      *confirmer
}

// run goes once through the dead letters in dlq at the start, replaying
// those that match key (all when key is ""); those not replayed go back
// to the queue, in order, when the session closes. It reports what it did,
// also when it stops early.
func (r *replayer) run(ctx context.Context, dlq, key string) error {
	s, err := r.o.openDLQ(dlq)
	if err != nil {
		return err
	}
	defer s.close()
	if r.ask && s.count > 0 {
		to := "to " + r.queue
		if r.original {
			to = "to the exchanges they name"
		}
		what := fmt.Sprintf("dlq replay --all --forget: replay the %s in %s %s, deleting the failed record of each first (so its handler runs again)",
			plural(s.count, "dead letter"), dlq, to)
		if err := r.o.consent(r.yes, what); err != nil {
			return err
		}
	}
	if r.pub, err = newConfirmer(s.conn); err != nil {
		return err
	}
	var out []replayed
	left := 0
	p := &progress{w: r.o.stderr, on: r.o.progress && !r.o.json, verb: "replaying", total: s.count}
	stop := func(err error) error {
		p.end()
		if rerr := r.o.report(out, dlq, r.dryRun); rerr != nil {
			return rerr
		}
		return err
	}
	for i := 1; i <= s.count; i++ {
		if err := ctx.Err(); err != nil {
			return stop(withCode(exitFailed, "interrupted after %d of %d dead letters (the others stay in %s): %w", i-1, s.count, dlq, err))
		}
		d, ok, err := s.get()
		if err != nil {
			return stop(err)
		}
		if !ok {
			break
		}
		p.step(i)
		dl := describe(i, &d)
		if key != "" && dl.Key != key {
			continue // not acked: it goes back when the session closes
		}
		res := replayed{deadLetter: dl}
		res.Action, res.Forgot, res.Why, err = r.one(ctx, &d, dl)
		if err != nil {
			return stop(err)
		}
		if res.Action == "left" {
			left++
		}
		out = append(out, res)
	}
	if err := stop(nil); err != nil {
		return err
	}
	switch {
	case len(out) == 0 && key != "":
		return withCode(exitNotFound, "no dead letter of key %q in %s", key, dlq)
	case len(out) == 0:
		return withCode(exitNotFound, "no dead letter in %s", dlq)
	case left > 0:
		return withCode(exitRefused, "%s left in %s (see why above)", plural(left, "dead letter"), dlq)
	}
	return nil
}

// one replays d, whose description is dl, unless it should stay; it
// returns what it did. An error stops the whole run: the store or the
// broker cannot be used any more.
func (r *replayer) one(ctx context.Context, d *amqp.Delivery, dl deadLetter) (action, forgot, why string, err error) {
	switch dl.Reason {
	case "missing key", "invalid key":
		return "left", "", dl.Reason + ": a replay would be dead-lettered again (fix the publisher, or Config.Key or Config.MissingKey)", nil
	case "key conflict":
		return "left", "", "key conflict: another payload holds this key's record; a replay cannot run it", nil
	}
	// The records acted on are the endpoint's the operator named (the
	// queue's own, or --endpoint), never one a header names: a message
	// can reach a dead-letter queue with headers its publisher wrote
	// (dead-lettered by the broker, or published there), and a forged
	// endpoint header would otherwise aim --forget at another queue's
	// records.
	endpoint := r.k.name()
	if dl.Endpoint != "" && dl.Endpoint != endpoint {
		flag := fmt.Sprintf("the queue's own endpoint %q", endpoint)
		if r.k.endpoint != "" {
			flag = fmt.Sprintf("--endpoint %q", r.k.endpoint)
		}
		return "left", "", fmt.Sprintf("dead-lettered by endpoint %q, not %s: pass --endpoint %q to act on its records", dl.Endpoint, flag, dl.Endpoint), nil
	}
	if dl.Key != "" {
		action, forgot, why, err = r.record(ctx, endpoint, dl.Key)
		if err != nil || action != "" {
			return action, forgot, why, err
		}
	}
	if r.dryRun {
		return "would replay", forgot, "", nil
	}
	exchange, rk := "", r.queue
	if r.original {
		if _, ok := d.Headers[amqpidem.HeaderOriginalRoutingKey]; !ok {
			return "left", forgot, "no " + amqpidem.HeaderOriginalRoutingKey + " header to replay to", nil
		}
		exchange, rk = dl.OriginalExchange, dl.OriginalRoutingKey
	}
	if err := r.pub.publish(ctx, exchange, rk, replayCopy(d), r.o.timeout); err != nil {
		if r.pub.ch.IsClosed() || ctx.Err() != nil {
			return "", forgot, "", withCode(exitFailed, "republishing the dead letter of key %q: %w (it stays in the dead-letter queue)", dl.Key, err)
		}
		return "left", forgot, fmt.Sprintf("the broker did not take the copy for exchange %q routing key %q: %v", exchange, rk, err), nil
	}
	if err := d.Ack(false); err != nil {
		return "", forgot, "", withCode(exitFailed, "removing the dead letter of key %q after its copy was confirmed: %w (it may be replayed again; the record makes that a duplicate)", dl.Key, err)
	}
	return "replayed", forgot, "", nil
}

// record decides on the record of key under endpoint: an action and why
// when the dead letter stays, "" to replay it (after forgetting a failed
// record, forgot says so).
func (r *replayer) record(ctx context.Context, endpoint, key string) (action, forgot, why string, err error) {
	skey := amqpidem.StoreKey(endpoint, key)
	cctx, cancel := context.WithTimeout(ctx, r.o.timeout)
	defer cancel()
	rec, err := r.admin.Inspect(cctx, skey)
	switch {
	case errors.Is(err, lock.ErrNotFound):
		return "", "", "", nil // expired or forgotten: a replay runs it
	case errors.Is(err, lock.ErrUnavailable) || ctx.Err() != nil:
		return "", "", "", withCode(exitFailed, "%s: %w", r.o.storeName(), err)
	case err != nil:
		return "left", "", fmt.Sprintf("its record cannot be read: %v", err), nil
	case rec.State == lock.StateCompleted:
		return "left", "", "record completed: the work was done", nil
	case rec.State != lock.StateFailed:
		return "", "", "", nil // in progress, released: a replay waits its turn
	case !r.forget:
		return "left", "", "record failed: it would be dead-lettered again; fix the cause and use --forget", nil
	case r.dryRun:
		return "", "failed", "", nil
	}
	err = r.admin.Forget(cctx, skey, rec.State, rec.Fence)
	switch {
	case err == nil, errors.Is(err, lock.ErrNotFound):
		return "", "failed", "", nil
	case errors.Is(err, lock.ErrChanged):
		return "left", "", "record changed while replaying; run replay again", nil
	case errors.Is(err, lock.ErrUnavailable) || ctx.Err() != nil:
		return "", "", "", withCode(exitFailed, "%s: %w", r.o.storeName(), err)
	}
	return "left", "", fmt.Sprintf("its record cannot be forgotten: %v", err), nil
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
	fmt.Fprintf(o.stdout, "%s: %d replayed, %d would replay, %d left\n", escapeText(dlq), counts["replayed"], counts["would replay"], counts["left"])
	return nil
}
