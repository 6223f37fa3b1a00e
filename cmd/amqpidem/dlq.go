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
	"github.com/amqpidem/amqpidem/internal/operator"
)

// callContext bounds one command's service calls by --timeout.
func callContext(c *cobra.Command, o *options) (context.Context, context.CancelFunc) {
	return context.WithTimeout(c.Context(), o.timeout)
}

// dlqFlags name a queue, its dead-letter queue and the key its dead
// letters are signed with.
type dlqFlags struct {
	queue   string
	dlq     string
	keyFile string
}

func (f *dlqFlags) add(c *cobra.Command) {
	c.Flags().StringVarP(&f.queue, "queue", "q", "", "the `queue` (instead of the QUEUE argument; inspect and forget name it so)")
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

// Origins of a dead letter (deadLetter.Origin), internal/operator's: the
// console shows the same.
const (
	originSigned    = operator.OriginSigned
	originUnsigned  = operator.OriginUnsigned
	originBad       = operator.OriginBad
	originUnchecked = operator.OriginUnchecked
)

// queueArgs checks that a dlq command names its queue once: as its one
// argument, or with --queue (as inspect and forget do), or both alike;
// then f.queue holds it.
func (f *dlqFlags) queueArgs(c *cobra.Command, args []string) error {
	switch {
	case len(args) > 1:
		return withCode(exitUsage, "%s takes one QUEUE (see %s --help)", c.CommandPath(), c.CommandPath())
	case len(args) == 1 && f.queue != "" && args[0] != f.queue:
		return withCode(exitUsage, "%s: the QUEUE argument %q and --queue %q differ: give one", c.CommandPath(), args[0], f.queue)
	case len(args) == 0 && f.queue == "":
		return withCode(exitUsage, "%s takes one QUEUE, as an argument or with --queue (see %s --help)", c.CommandPath(), c.CommandPath())
	}
	if len(args) == 1 {
		f.queue = args[0]
	}
	return nil
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
the queue QUEUE.dlq), with the fault headers amqpidem gives them. Each
command names the queue as its argument or with --queue (-q), as inspect
and forget do.`,
	}
	c.AddCommand(newDLQList(o), newDLQReplay(o))
	return c
}

// deadLetter is one dead letter as dlq list and replay report it:
// internal/operator's, which the console shows too.
type deadLetter = operator.DeadLetter

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
// with key (see operator.Origin).
func describe(i int, d *amqp.Delivery, key []byte) deadLetter { return operator.Describe(i, d, key) }

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
		Args: f.queueArgs,
		RunE: func(c *cobra.Command, args []string) error {
			if limit < 1 {
				return withCode(exitUsage, "--limit must be at least 1")
			}
			key, err := f.signingKey()
			if err != nil {
				return err
			}
			s, err := o.openDLQ(f.name(f.queue))
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
