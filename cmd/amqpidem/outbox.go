package main

import (
	"fmt"
	"slices"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// stagedJSON is one staged message of a record, as inspect --json prints
// it.
type stagedJSON struct {
	// Index is its place among the messages staged, from 0, as the
	// consumer's warning and outbox redrive --index number them.
	Index         int      `json:"index"`
	State         string   `json:"state"` // pending, published, returned
	Tries         int      `json:"tries"` // publishes the broker returned or refused
	Exchange      string   `json:"exchange"`
	RoutingKey    string   `json:"routing_key"`
	MessageID     string   `json:"message_id"`
	ContentType   string   `json:"content_type,omitempty"`
	CorrelationID string   `json:"correlation_id,omitempty"`
	Type          string   `json:"type,omitempty"`
	Headers       []string `json:"headers,omitempty"` // the headers' names, sorted
	BodyBytes     int      `json:"body_bytes"`
}

func toStagedJSON(i int, m amqpidem.OutboxMessage) stagedJSON {
	j := stagedJSON{Index: i, State: m.State.String(), Tries: m.Tries, Exchange: m.Exchange, RoutingKey: m.RoutingKey,
		MessageID: m.Msg.MessageId, ContentType: m.Msg.ContentType, CorrelationID: m.Msg.CorrelationId, Type: m.Msg.Type,
		BodyBytes: len(m.Msg.Body)}
	for k := range m.Msg.Headers {
		j.Headers = append(j.Headers, k)
	}
	slices.Sort(j.Headers)
	return j
}

// outboxCounts says how many of msgs are in each state, for people.
func outboxCounts(msgs []amqpidem.OutboxMessage) string {
	n := map[amqpidem.OutboxState]int{}
	for _, m := range msgs {
		n[m.State]++
	}
	return fmt.Sprintf("%s: %d published, %d pending, %d returned", plural(len(msgs), "staged message"),
		n[amqpidem.OutboxPublished], n[amqpidem.OutboxPending], n[amqpidem.OutboxReturned])
}

// stagedTable writes the staged messages msgs as inspect shows them.
func stagedTable(o *options, msgs []amqpidem.OutboxMessage) {
	rows := [][]string{{"INDEX", "STATE", "TRIES", "EXCHANGE", "ROUTING KEY", "MESSAGE ID", "BYTES"}}
	for i, m := range msgs {
		rows = append(rows, []string{strconv.Itoa(i), m.State.String(), strconv.Itoa(m.Tries), oneLine(orDash(m.Exchange), 40),
			oneLine(orDash(m.RoutingKey), 60), oneLine(orDash(m.Msg.MessageId), 60), strconv.Itoa(len(m.Msg.Body))})
	}
	table(o.stdout, rows)
}

func newOutbox(o *options) *cobra.Command {
	c := &cobra.Command{
		Use:   "outbox",
		Short: "Publish again the messages a handler staged that the broker returned",
		Long: `outbox works on the messages handlers staged (amqpidem.Stage), which a
completed record keeps with the result, each in a state: pending (stored,
not confirmed by the broker yet: the next delivery of its key publishes
it), published (confirmed), or returned (the broker returned it, no queue
being bound, or refused it, Config.MaxAttempts times: the consumer logged it
at warn level, counted it, and publishes it no more).

inspect shows a record's staged messages and their states.`,
	}
	c.AddCommand(newRedrive(o))
	return c
}

// redriveFlags select the staged messages outbox redrive publishes.
type redriveFlags struct {
	indexes []int
	all     bool // pending ones too
	force   bool // published ones too
	dryRun  bool
	yes     bool // publish without asking
}

// allowed reports whether a message in state s may be published again,
// or why not.
func (f *redriveFlags) allowed(s amqpidem.OutboxState) (bool, string) {
	switch s {
	case amqpidem.OutboxReturned:
		return true, ""
	case amqpidem.OutboxPending:
		if f.all || f.force {
			return true, ""
		}
		return false, "pending: the next delivery of the key publishes it; --all publishes it now"
	case amqpidem.OutboxPublished:
		if f.force {
			return true, ""
		}
		return false, "published already; --force publishes it again"
	}
	return false, "in state " + s.String()
}

// redriven is what outbox redrive did with one staged message.
type redriven struct {
	Index      int    `json:"index"`
	State      string `json:"state"` // as read, before redrive
	Tries      int    `json:"tries"`
	Exchange   string `json:"exchange"`
	RoutingKey string `json:"routing_key"`
	MessageID  string `json:"message_id"`
	// Action: "redriven" (published, confirmed and marked published in
	// the record), "would redrive" (--dry-run), "left" (not published;
	// Why says why), or "published, not marked" (published and
	// confirmed, but the record could not be amended: Why says why; it
	// is published again by the next redrive, or by its consumer when
	// pending).
	Action string `json:"action"`
	Why    string `json:"why,omitempty"`
}

func newRedrive(o *options) *cobra.Command {
	var k keyFlags
	var f redriveFlags
	c := &cobra.Command{
		Use:   "redrive KEY --queue QUEUE [--index N]... [--all] [--force] [--dry-run] [--yes]",
		Short: "Publish again the staged messages of a key that the broker returned",
		Long: `redrive publishes again messages that a handler staged with the outcome of
the message key KEY, as the record keeps them, then marks them published
in the record. Fix the cause first: declare the queue or the binding the
message was returned for (inspect shows each message's exchange and
routing key).

By default it publishes every message in state returned. --index N picks
messages by their index, from 0, as inspect and the consumer's warning
number them (repeat it, or give a list: --index 0,2). A pending message is
published only with --all (its consumer publishes it with the next delivery
of the key; use --all when that delivery is gone), a published one only
with --force (to send again what downstream lost), and --force without
--index publishes every staged message.

Each message goes to its exchange and routing key exactly as stored (the
same MessageId and properties), mandatory, with publisher confirms: an
amqpidem consumer downstream that already took it sees a duplicate. One the
broker returns or refuses again is left as it was and reported. Then the
record is amended, compare-and-set on the value read, so that the messages
confirmed are marked published; if a consumer changed the record meanwhile,
redrive reads it again and marks them in what it now holds.

Before it publishes, it takes the claim on the record's staged messages,
as a copy of their message does: while another redrive, or a copy of
the message publishing them, holds it, redrive publishes nothing and
says until when it is held (exit code 4). The claim lasts as long as the
run may take (--timeout for each publish, and two more) and is given up
when the run ends; a consumer gives its own up once it is done publishing.

Killed at any point it loses nothing: a message published but not yet
marked stays returned (or pending), and the next redrive (or, when pending,
its consumer) publishes it again: a duplicate downstream, never a loss.
--dry-run says what would be published and changes nothing.

Without --index it says how many messages it would publish and asks first
when stdin is a terminal; when it is not (a script), it needs --yes, else
it changes nothing and exits with code 2. With --index the messages are
named already: it does not ask.

Exit code 3 when the key has no record or there is nothing to publish (no
staged message in the states selected, an --index the record does not
have); 4 when the record is not completed, when the staged messages are
claimed by another redrive or a copy of their message, when some messages were left
(see why), or when the record was replaced meanwhile and could not be
marked; 1 when RabbitMQ or the store failed (what was done is reported
first).`,
		Example: `  amqpidem inspect order-1042 --queue orders
  amqpidem outbox redrive order-1042 --queue orders --dry-run
  amqpidem outbox redrive order-1042 --queue orders --yes
  amqpidem outbox redrive order-1042 --queue orders --index 1 --force`,
		Args: exactArgs(1, "one KEY"),
		RunE: func(c *cobra.Command, args []string) error {
			for _, i := range f.indexes {
				if i < 0 {
					return withCode(exitUsage, "--index %d: indexes start at 0", i)
				}
			}
			skey, err := k.storeKey(args[0])
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
			amender, ok := admin.(lock.Amender)
			if !ok {
				return withCode(exitFailed, "%s cannot amend records (lock.Amender)", o.storeName())
			}
			r := &redriver{o: o, k: &k, key: args[0], skey: skey, admin: admin, amender: amender, f: &f}
			return r.run(c.Context())
		},
	}
	k.add(c)
	c.Flags().IntSliceVar(&f.indexes, "index", nil, "publish the staged message of index `N` (from 0; repeatable)")
	c.Flags().BoolVar(&f.all, "all", false, "publish pending messages too")
	c.Flags().BoolVar(&f.force, "force", false, "publish published messages too")
	c.Flags().BoolVar(&f.dryRun, "dry-run", false, "say what would be published, change nothing")
	c.Flags().BoolVar(&f.yes, "yes", false, "publish without asking when --index is not given (needed when stdin is not a terminal)")
	return c
}
