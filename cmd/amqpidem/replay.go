package main

import (
	"context"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

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
		Args: f.queueArgs,
		RunE: func(c *cobra.Command, args []string) error {
			if all == (key != "") {
				return withCode(exitUsage, "give exactly one of --key KEY and --all")
			}
			k.queue = f.queue
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
			r := &replayer{o: o, queue: f.queue, k: &k, admin: admin, forget: forget, dryRun: dryRun, original: original,
				ask: all && forget && !dryRun, yes: yes, signingKey: signingKey, trust: trust, allowMissing: allowMissing}
			return r.run(c.Context(), f.name(f.queue), key)
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
