package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/operator"
	"github.com/amqpidem/amqpidem/lock"
)

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
	if operator.Number(d.Headers, deliveryCount) < 1 {
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
			operator.Number(d.Headers, deliveryCount), s.queue, err)
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
