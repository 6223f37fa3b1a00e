package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
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

// dlqFlags name a dead-letter queue and the key its dead letters are
// signed with.
type dlqFlags struct {
	dlq     string
	keyFile string
}

func (f *dlqFlags) add(c *cobra.Command) {
	c.Flags().StringVar(&f.dlq, "dlq", "", "the dead-letter `queue`, when it is not QUEUE.dlq (Config.DeadLetterRoutingKey)")
	c.Flags().StringVar(&f.keyFile, "signing-key-file", "", "a `file` holding the consumers' Config.SigningKey (default: AMQPIDEM_SIGNING_KEY)")
}

// signingKey is the key dead letters are checked with: the contents of
// --signing-key-file (without a final newline), else AMQPIDEM_SIGNING_KEY;
// nil when neither is given. It is never a flag's value, which ps shows.
func (f *dlqFlags) signingKey() ([]byte, error) {
	key := []byte(os.Getenv(signingKeyEnv))
	if f.keyFile != "" {
		b, err := os.ReadFile(f.keyFile)
		if err != nil {
			return nil, withCode(exitUsage, "--signing-key-file: %w", err)
		}
		key = bytes.TrimRight(b, "\r\n")
	}
	if len(key) > 0 && len(key) < amqpidem.MinSigningKey {
		return nil, withCode(exitUsage, "the signing key is %d bytes; a consumer's Config.SigningKey has at least %d", len(key), amqpidem.MinSigningKey)
	}
	return key, nil
}

// signingKeyEnv holds the consumers' Config.SigningKey for dlq commands.
const signingKeyEnv = "AMQPIDEM_SIGNING_KEY"

// Origins of a dead letter (deadLetter.Origin): whether its headers are
// proven amqpidem's.
const (
	originSigned    = "signed"        // HeaderSignature verifies under the key
	originUnsigned  = "unsigned"      // no HeaderSignature
	originBad       = "bad signature" // forged, changed, or another key's
	originUnchecked = "unchecked"     // signed, but no key to check it with
)

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
	// Origin says whether the headers above are proven amqpidem's: one
	// of the origin constants.
	Origin string `json:"origin"`
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
	rows := [][]string{{"#", "KEY", "REASON", "ORIGIN", "ATTEMPTS", "FIRST SEEN", "EXCHANGE", "ROUTING KEY", "ERROR"}}
	for _, dl := range list {
		first := "-"
		if dl.FirstSeen != nil {
			first = dl.FirstSeen.Format(time.RFC3339)
		}
		rows = append(rows, []string{strconv.Itoa(dl.Index), oneLine(orDash(dl.Key), 40), oneLine(dl.Reason, 40), dl.Origin, strconv.FormatInt(dl.Attempts, 10),
			first, oneLine(orDash(dl.OriginalExchange), 40), oneLine(orDash(dl.OriginalRoutingKey), 60), oneLine(dl.Error, 60)})
	}
	table(w, rows)
	originNote(w, list)
}

// originNote says, under a list, what the ORIGIN column means for the
// dead letters whose headers are not proven amqpidem's.
func originNote(w io.Writer, list []deadLetter) {
	n := map[string]int{}
	for _, dl := range list {
		n[dl.Origin]++
	}
	if k := n[originUnsigned] + n[originBad]; k > 0 {
		fmt.Fprintf(w, "%s not signed by a consumer with the key given: their headers may be a publisher's; "+
			"replay forgets their records and uses their original exchange only with --trust-headers\n", plural(k, "dead letter"))
	}
	if n[originUnchecked] > 0 {
		fmt.Fprintf(w, "%s with a signature not checked: give the consumers' Config.SigningKey in %s or --signing-key-file\n",
			plural(n[originUnchecked], "dead letter"), signingKeyEnv)
	}
}

// describe reads dead letter d, the i-th read, checking its signature
// with key (see origin).
func describe(i int, d *amqp.Delivery, key []byte) deadLetter {
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
	dl.Origin = origin(key, d)
	return dl
}

// origin says whether d's headers are proven amqpidem's under key.
func origin(key []byte, d *amqp.Delivery) string {
	err := amqpidem.VerifySignature(key, d.Headers, d.Body)
	switch {
	case err == nil:
		return originSigned
	case errors.Is(err, amqpidem.ErrUnsigned):
		return originUnsigned
	case len(key) == 0:
		return originUnchecked
	}
	return originBad
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
otherwise): key, reason, origin, attempts, when first seen, the original
exchange and routing key, and the error. ORIGIN says whether a consumer's
signature (Config.SigningKey, checked with the key in AMQPIDEM_SIGNING_KEY
or --signing-key-file) proves the headers amqpidem's: "signed"; "unsigned"
or "bad signature" when they may be a publisher's; "unchecked" when no key
was given. It reads them without acknowledging them and
gives them all back when done, so they stay in the queue, in order, even if
list is killed; RabbitMQ marks them redelivered.

--json prints an array of them, each with "total": how many dead letters
the queue held, more than the entries when --limit cut the list (stderr
then says so too).

On a quorum dead-letter queue with a delivery limit (x-delivery-limit;
RabbitMQ 4 sets 20 by default), each look counts as a delivery of each
message read: one looked at more often than the limit is dropped (dlq
replay puts those read before back with a fresh count; list changes
nothing). amqpidem's own QUEUE.dlq is classic unless
Config.DeadLetterQueueArgs says otherwise.

Exit code 3 when the dead-letter queue does not exist.`,
		Example: `  amqpidem dlq list orders
  amqpidem dlq list orders --limit 1000 --json | jq '.[] | .key'
  amqpidem dlq list orders --limit 10 --json | jq 'length < (.[0].total // 0)'   # cut by --limit?`,
		Args: exactArgs(1, "one QUEUE"),
		RunE: func(c *cobra.Command, args []string) error {
			if limit < 1 {
				return withCode(exitUsage, "--limit must be at least 1")
			}
			key, err := f.signingKey()
			if err != nil {
				return err
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
				list = append(list, describe(len(list)+1, &d, key))
				p.step(len(list))
			}
			p.end()
			if o.json {
				return o.printListJSON(s, list)
			}
			printDeadLetters(o.stdout, s.queue, s.count, list)
			return nil
		},
	}
	f.add(c)
	c.Flags().IntVar(&limit, "limit", limit, "list at most this many")
	return c
}

// listed is a dead letter as dlq list --json prints it.
type listed struct {
	deadLetter
	// Total is how many messages the dead-letter queue held when list
	// began: more than the entries printed when --limit cut the list.
	// In each entry, so that the top level stays an array.
	Total int `json:"total"`
}

// printListJSON prints list, read from s, as dlq list --json does; when
// --limit cut it, stderr says so too.
func (o *options) printListJSON(s *dlqSession, list []deadLetter) error {
	out := make([]listed, len(list))
	for i, dl := range list {
		out[i] = listed{deadLetter: dl, Total: s.count}
	}
	if len(list) < s.count {
		fmt.Fprintf(o.stderr, "amqpidem: the first %d of %s in %s (--limit)\n", len(list), plural(s.count, "dead letter"), escapeText(s.queue))
	}
	return printJSON(o.stdout, out)
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
	var all, forget, dryRun, original, yes, trust, allowMissing bool
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

A failed message's dead letter whose record is not found is replayed as if
the record had expired or been forgotten. But a wrong --prefix or store (a
Redis database, a schema) finds none either, and the copies of messages
whose failed records the consumer still holds come back as failed
duplicates: replay warns on stderr when it found no record at all, and
under --forget replays such dead letters only once it found the record of
another dead letter; when it finds none, it leaves them. Add
--allow-missing-record when the records did expire.

Records are looked up under QUEUE's own endpoint, or --endpoint when the
consumer sets Config.Endpoint: a dead letter naming another endpoint in its
header is left, with the flag that would act on it (a header can be written
by whoever published the message, and is never enough to touch another
endpoint's records).

The copy goes to QUEUE through the default exchange, not to the exchange the
message was first published to: that exchange may route it to other queues
too, whose consumers would see it again. --to-original-exchange publishes
it to the original exchange and routing key instead.

A message can reach a dead-letter queue with headers its publisher chose
(dead-lettered by the broker, or published there by anyone allowed to), so
--forget and --to-original-exchange act only on dead letters whose headers
a consumer signed (Config.SigningKey), checked with the same key, given in
AMQPIDEM_SIGNING_KEY or --signing-key-file. Others are left, with their
origin (unsigned, bad signature, or unchecked without a key): read them
with dlq list, then pass --trust-headers to act on them anyway. Without
those two flags a dead letter is replayed to QUEUE whatever its origin, as
if its publisher had sent it there.

replay reads the dead-letter queue as list does, without acknowledging,
and gives back what it does not replay. On a quorum dead-letter queue each
such read counts as a delivery, and a message given back more often than
the queue's delivery limit (x-delivery-limit; RabbitMQ 4 sets 20 by
default) is dropped: a dead letter read before (x-delivery-count 1 or more)
is therefore not given back but put back at the end of the queue, as a
copy whose count starts again (published with a confirm, then the original
removed), even under --dry-run. Those dead letters change place, not
content; stderr says how many. Killed between the two steps, one may be
there twice (a second replay of it is a duplicate).

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
  amqpidem dlq replay orders --all --forget
  AMQPIDEM_SIGNING_KEY=... amqpidem dlq replay orders --all --forget --to-original-exchange`,
		Args: exactArgs(1, "one QUEUE"),
		RunE: func(c *cobra.Command, args []string) error {
			if all == (key != "") {
				return withCode(exitUsage, "give exactly one of --key KEY and --all")
			}
			k.queue = args[0]
			signingKey, err := f.signingKey()
			if err != nil {
				return err
			}
			ctx, cancel := callContext(c, o)
			admin, closeStore, err := o.openStore(ctx)
			cancel()
			if err != nil {
				return err
			}
			defer closeStore()
			r := &replayer{o: o, queue: args[0], k: &k, admin: admin, forget: forget, dryRun: dryRun, original: original,
				ask: all && forget && !dryRun, yes: yes, signingKey: signingKey, trust: trust, allowMissing: allowMissing}
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
	c.Flags().BoolVar(&allowMissing, "allow-missing-record", false, "with --forget, replay dead letters of failed messages even when no record is found (they expired or were forgotten)")
	c.Flags().BoolVar(&yes, "yes", false, "replay --all --forget without asking (needed when stdin is not a terminal)")
	c.Flags().BoolVar(&trust, "trust-headers", false, "act on the headers of dead letters not signed with the signing key (--forget, --to-original-exchange): only after checking them")
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
	// signingKey checks dead letters' signatures; trust (--trust-headers)
	// acts on unsigned ones' headers too.
	signingKey []byte
	trust      bool
	pub        copyPublisher
	// frameMax is the connection's frame_max (0: no limit): a copy
	// whose headers exceed it is not sent (see fits).
	frameMax int
	kept     int // dead letters put back at the end of the queue (keep)
	// allowMissing: under --forget, replay dead letters of failed
	// messages whose record is not found, even when no other record is.
	allowMissing bool
	// found counts the records found; missing the dead letters of failed
	// messages without one (see held).
	found, missing int
	// held are dead letters of failed messages without a record, under
	// --forget, kept back until another dead letter's record is found;
	// released are those then replayed, for run to report.
	held, released []heldLetter
}

// heldLetter is a dead letter held back, and what was done with it.
type heldLetter struct {
	d   amqp.Delivery
	res replayed
}

// actionHeld is one's answer for a dead letter held back (see hold).
const actionHeld = "held"

// copyPublisher publishes one message and waits for the broker's confirm:
// the confirmer, or a fake in tests.
type copyPublisher interface {
	publish(ctx context.Context, exchange, key string, msg amqp.Publishing, timeout time.Duration) error
	// closed reports whether the publishing channel is closed.
	closed() bool
	// reopen replaces a channel the broker closed over a publish.
	reopen() error
}

// closed reports whether c's channel is closed.
func (c *confirmer) closed() bool { return c.ch.IsClosed() }

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
	r.frameMax = s.conn.Config.FrameSize
	if r.pub, err = newConfirmer(s.conn); err != nil {
		return err
	}
	var out []replayed
	left := 0
	p := &progress{w: r.o.stderr, on: r.o.progress && !r.o.json, verb: "replaying", total: s.count}
	// add reports what was done with the dead letter d; one left in
	// the queue is kept from the delivery limit (keep).
	add := func(res replayed, d *amqp.Delivery) error {
		out = append(out, res)
		if res.Action != "left" {
			return nil
		}
		left++
		return r.keep(ctx, s, d)
	}
	stop := func(err error) error {
		for _, h := range r.held { // no record found in the whole run
			h.res.Action, h.res.Why = "left", r.missingWhy(h.res.deadLetter)
			if kerr := add(h.res, &h.d); kerr != nil && err == nil {
				err = kerr
			}
		}
		r.held = nil
		p.end()
		r.saidKept(dlq)
		r.warnMissing()
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
		dl := describe(i, &d, r.signingKey)
		if key != "" && dl.Key != key {
			// Not acked: it goes back when the session closes.
			if err := r.keep(ctx, s, &d); err != nil {
				return stop(err)
			}
			continue
		}
		res := replayed{deadLetter: dl}
		res.Action, res.Forgot, res.Why, err = r.one(ctx, &d, dl)
		for _, h := range r.released { // held ones go first, as they came
			if err := add(h.res, &h.d); err != nil {
				return stop(err)
			}
		}
		r.released = nil
		if err != nil {
			return stop(err)
		}
		if res.Action == actionHeld {
			r.held = append(r.held, heldLetter{d: d, res: res})
			continue
		}
		if err := add(res, &d); err != nil {
			return stop(err)
		}
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
	if r.original && !r.trusted(dl) {
		return "left", "", r.untrusted(dl, "its original exchange and routing key may be a publisher's (without --to-original-exchange it goes to the queue)"), nil
	}
	if why := tooLarge(d, r.frameMax); why != "" {
		return "left", "", why, nil // before its record is forgotten
	}
	if dl.Key != "" {
		action, forgot, why, err = r.record(ctx, endpoint, dl)
		if err == nil && action == actionNoRecord {
			action = r.hold(dl)
		}
		if err == nil && r.found > 0 && len(r.held) > 0 {
			if err := r.release(ctx); err != nil {
				return "", "", "", err
			}
		}
		if err != nil || action != "" {
			return action, forgot, why, err
		}
	}
	return r.send(ctx, d, dl, forgot)
}

// send replays d, whose description is dl (unless --dry-run), after its
// failed record was forgotten (forgot says so, "" if not).
func (r *replayer) send(ctx context.Context, d *amqp.Delivery, dl deadLetter, forgot string) (action, _, why string, err error) {
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
	if err := ctx.Err(); err != nil {
		return "", forgot, "", withCode(exitFailed, "interrupted before republishing the dead letter of key %q: %w (not published; it stays in the dead-letter queue)", dl.Key, err)
	}
	if err := r.pub.publish(ctx, exchange, rk, replayCopy(d, r.frameMax), r.o.timeout); err != nil {
		return r.notConfirmed(ctx, dl, exchange, rk, forgot, err)
	}
	if err := d.Ack(false); err != nil {
		return "", forgot, "", withCode(exitFailed, "removing the dead letter of key %q after its copy was confirmed: %w (it may be replayed again; the record makes that a duplicate)", dl.Key, err)
	}
	return "replayed", forgot, "", nil
}

// trusted reports whether replay may act on dl's headers: they are signed
// with the signing key, or --trust-headers says to.
func (r *replayer) trusted(dl deadLetter) bool { return dl.Origin == originSigned || r.trust }

// untrusted says why dead letter dl, whose headers are not proven
// amqpidem's, is left: risk, and how to act anyway.
func (r *replayer) untrusted(dl deadLetter, risk string) string {
	how := "check them, then pass --trust-headers"
	if dl.Origin == originUnchecked {
		how = "give the consumers' Config.SigningKey in " + signingKeyEnv + " or --signing-key-file, or check them and pass --trust-headers"
	}
	return fmt.Sprintf("headers %s: %s; %s", dl.Origin, risk, how)
}

// deliveryCount is the header a quorum queue gives each message it
// delivers: how often it was delivered before and given back.
const deliveryCount = "x-delivery-count"

// keep makes sure that dead letter d, read from s and not replayed, is
// not dropped when it goes back. A quorum queue counts each message it
// gives back (when the session closes) as a delivery, and drops it, or
// dead-letters it on, past its delivery limit (x-delivery-limit, or a
// policy's; 20 by default from RabbitMQ 4), which cannot be read here
// (queue.declare does not return arguments). So a dead letter already
// given back before (x-delivery-count 1 or more: every replay or list
// that read it without taking it counts) is not given back again but
// put back at the end of the queue, as a copy whose count starts again:
// published with a confirm, and only then d acked. The queue keeps each
// dead letter, if not its place: those put back follow the others. A
// classic queue's messages (no such header) are simply given back.
func (r *replayer) keep(ctx context.Context, s *dlqSession, d *amqp.Delivery) error {
	if number(d.Headers, deliveryCount) < 1 {
		return nil
	}
	msg := replayCopy(d, 0)
	msg.Headers = make(amqp.Table, len(d.Headers))
	for k, v := range d.Headers {
		msg.Headers[k] = v // the broker's dead-lettering headers too: it stays the same dead letter
	}
	delete(msg.Headers, deliveryCount)
	msg.Expiration = d.Expiration
	if err := r.pub.publish(ctx, "", s.queue, msg, r.o.timeout); err != nil {
		return withCode(exitFailed, "putting back a dead letter read %d times before at the end of %s: %w (it goes back in its place, counting one more delivery; its copy may be at the end too)",
			number(d.Headers, deliveryCount), s.queue, err)
	}
	if err := d.Ack(false); err != nil {
		return withCode(exitFailed, "removing a dead letter of %s once its copy was put back at the end: %w (it may now be there twice)", s.queue, err)
	}
	r.kept++
	return nil
}

// saidKept tells on stderr how many dead letters keep put back at the
// end of dlq, if any.
func (r *replayer) saidKept(dlq string) {
	if r.kept > 0 {
		fmt.Fprintf(r.o.stderr, "amqpidem: %s of %s read before put back at its end with a fresh delivery count, so that the quorum queue's delivery limit does not drop them\n",
			plural(r.kept, "dead letter"), escapeText(dlq))
	}
}

// notConfirmed says what became of the copy of dl that publish sent
// without a confirm (err): left when the broker said it did not take it
// (returned unroutable, nacked); else the run stops, and the copy may
// have been published: the broker may have taken it before the wait was
// interrupted, timed out or the connection lost.
func (r *replayer) notConfirmed(ctx context.Context, dl deadLetter, exchange, rk, forgot string, err error) (action, _, why string, _ error) {
	var closed *channelClosed
	switch {
	case errors.As(err, &closed):
		// The broker refused this copy (an exchange that does not
		// exist, access refused): the next dead letter gets a new
		// channel, this one stays.
		if rerr := r.pub.reopen(); rerr != nil {
			return "", forgot, "", withCode(exitFailed, "republishing the dead letter of key %q: %w (not taken; it stays in the dead-letter queue); reopening the channel: %w", dl.Key, err, rerr)
		}
		return "left", forgot, fmt.Sprintf("the broker refused the copy for exchange %q routing key %q: %v", exchange, rk, err), nil
	case ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || r.pub.closed():
		return "", forgot, "", withCode(exitFailed, "republishing the dead letter of key %q: %w: the copy may have been published (the dead letter stays in the dead-letter queue and may be replayed twice; the record makes that a duplicate)", dl.Key, err)
	}
	return "left", forgot, fmt.Sprintf("the broker did not take the copy for exchange %q routing key %q: %v", exchange, rk, err), nil
}

// actionNoRecord is record's answer when key has no record.
const actionNoRecord = "no record"

// recordedFailure reports whether a dead letter of reason was dead-lettered
// after its consumer recorded a failure: its record, when not found, has
// expired or been forgotten, or is looked for in the wrong place.
func recordedFailure(reason string) bool {
	switch reason {
	case "permanent failure", "attempts exhausted", "result too large", "failed duplicate":
		return true
	}
	return false
}

// hold decides on dead letter dl, whose record is not found: "" to replay
// it (the record expired or was forgotten: the handler runs), or
// actionHeld. A wrong --prefix or store (a Redis database, a schema)
// finds no record either, and a replay then sends back messages whose
// failed records the consumer still holds: they come back dead-lettered
// as failed duplicates, their reason lost. So under --forget (which
// means to run the handler again), the dead letter of a failed message
// is held back until another dead letter's record is found, proof that
// the records are looked for in the right place; left when none is
// (missingWhy), unless --allow-missing-record.
func (r *replayer) hold(dl deadLetter) string {
	if !recordedFailure(dl.Reason) {
		return ""
	}
	r.missing++
	if !r.forget || r.allowMissing || r.found > 0 {
		return ""
	}
	return actionHeld
}

// release replays the dead letters held back, in their order, once a
// record was found; run reports them (released).
func (r *replayer) release(ctx context.Context) error {
	for len(r.held) > 0 {
		h := r.held[0]
		r.held = r.held[1:]
		var err error
		h.res.Action, h.res.Forgot, h.res.Why, err = r.send(ctx, &h.d, h.res.deadLetter, "")
		if err != nil {
			return err // it says what became of h, given back when the session closes
		}
		r.released = append(r.released, h)
	}
	return nil
}

// missingWhy says why the dead letter dl, held back, was left.
func (r *replayer) missingWhy(dl deadLetter) string {
	return fmt.Sprintf("dead-lettered as %s, but no record of it, nor of any other dead letter read, under endpoint %q in %s: a wrong %s? If the records expired or were forgotten, add --allow-missing-record",
		dl.Reason, r.k.name(), r.o.recordPlace(), r.o.placeFlags())
}

// warnMissing warns on stderr when dead letters of failed messages were
// replayed though no record at all was found: the consumer may keep its
// records elsewhere, and then dead-letters the copies again.
func (r *replayer) warnMissing() {
	if r.found > 0 || r.missing == 0 || r.forget && !r.allowMissing {
		return
	}
	fmt.Fprintf(r.o.stderr, "amqpidem: warning: no record found for any of the %s of failed messages, under endpoint %q in %s: if the consumer keeps its records elsewhere (%s), their copies come back as failed duplicates\n",
		plural(r.missing, "dead letter"), r.k.name(), r.o.recordPlace(), r.o.placeFlags())
}

// recordPlace says where the records are looked for: the store and the
// prefix.
func (o *options) recordPlace() string {
	prefix := o.prefix
	if prefix == "" {
		prefix = lock.DefaultPrefix
	}
	return fmt.Sprintf("%s, prefix %q", o.storeName(), prefix)
}

// placeFlags names the flags that say where the records are.
func (o *options) placeFlags() string {
	switch {
	case o.dynamo.table != "":
		return "--prefix or --dynamodb-table"
	case o.pgDSN != "":
		return "--prefix, --pg-schema or --pg-table"
	case o.redisMaster != "" || len(o.redisAddrs) > 0:
		return "--prefix"
	}
	return "--prefix or Redis database (the /N of --redis)"
}

// record decides on the record of dead letter dl's key under endpoint: an
// action and why when the dead letter stays, "" to replay it (after
// forgetting a failed record, forgot says so), actionNoRecord when there
// is none.
func (r *replayer) record(ctx context.Context, endpoint string, dl deadLetter) (action, forgot, why string, err error) {
	skey := amqpidem.StoreKey(endpoint, dl.Key)
	cctx, cancel := context.WithTimeout(ctx, r.o.timeout)
	defer cancel()
	rec, err := r.admin.Inspect(cctx, skey)
	if err == nil {
		r.found++
	}
	switch {
	case errors.Is(err, lock.ErrNotFound):
		return actionNoRecord, "", "", nil // expired or forgotten, or looked for in the wrong place: see hold
	case err != nil && (errors.Is(err, lock.ErrUnavailable) || ctx.Err() != nil):
		// Only a failed lookup: one that succeeded is decided on even
		// when the run was interrupted meanwhile (the loop stops
		// before the next dead letter, publish before sending).
		return "", "", "", withCode(exitFailed, "%s: reading the record of key %q: %w", r.o.storeName(), dl.Key, keyFree(err, skey))
	case err != nil:
		return "left", "", fmt.Sprintf("its record cannot be read: %v", keyFree(err, skey)), nil
	case rec.State == lock.StateCompleted:
		return "left", "", "record completed: the work was done", nil
	case rec.State != lock.StateFailed:
		return "", "", "", nil // in progress, released: a replay waits its turn
	case !r.forget:
		return "left", "", "record failed: it would be dead-lettered again; fix the cause and use --forget", nil
	case !r.trusted(dl):
		// A publisher may have named a key whose failure it wants undone.
		return "left", "", r.untrusted(dl, "--forget would delete the failed record of a key a publisher may have named"), nil
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
		return "", "", "", withCode(exitFailed, "%s: forgetting the record of key %q: %w", r.o.storeName(), dl.Key, keyFree(err, skey))
	}
	return "left", "", fmt.Sprintf("its record cannot be forgotten: %v", keyFree(err, skey)), nil
}

// replayCopy is what replay publishes for dead letter d: d's properties,
// headers and body, without the broker's dead-lettering headers, and
// without an expiration: a replayed message must not expire on its way
// (amqpidem keeps the original one in HeaderOriginalExpiration). It
// notes when it was replayed in a header, unless that would take its
// headers past frameMax (0: no limit).
func replayCopy(d *amqp.Delivery, frameMax int) amqp.Publishing {
	h := make(amqp.Table, len(d.Headers)+1)
	for k, v := range d.Headers {
		h[k] = v
	}
	for _, k := range []string{"x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason",
		"x-last-death-exchange", "x-last-death-queue", "x-last-death-reason", amqpidem.HeaderDeadLetterPending} {
		delete(h, k)
	}
	h[headerReplayedAt] = time.Now().UTC().Truncate(time.Second)
	msg := amqp.Publishing{Headers: h, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: amqp.Persistent, Priority: d.Priority, CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo,
		MessageId: d.MessageId, Timestamp: d.Timestamp,
		Type: d.Type, AppId: d.AppId, Body: d.Body}
	if !fits(&msg, frameMax) {
		delete(h, headerReplayedAt)
	}
	return msg
}

// headerReplayedAt says when dlq replay republished a dead letter.
const headerReplayedAt = "x-amqpidem-replayed-at"

// fits reports whether msg's headers fit in frameMax (0: no limit).
func fits(msg *amqp.Publishing, frameMax int) bool {
	return frameMax <= 0 || amqpidem.HeaderFrameSize(msg) <= frameMax
}

// tooLarge says why dead letter d cannot be replayed when its copy would
// not fit in frameMax: the broker would close the connection over it,
// ending the run; "" when it fits.
func tooLarge(d *amqp.Delivery, frameMax int) string {
	msg := replayCopy(d, frameMax)
	if fits(&msg, frameMax) {
		return ""
	}
	return fmt.Sprintf("its properties and headers take %d bytes, over the connection's frame_max %d: the broker would close the connection "+
		"over its copy; read it with dlq list --json, and republish it with fewer headers", amqpidem.HeaderFrameSize(&msg), frameMax)
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
