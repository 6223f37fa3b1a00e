package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/operator"
	"github.com/amqpidem/amqpidem/lock"
)

// keyFlags name the record of a key: the endpoint (Config.Endpoint,
// default the queue) and the message key.
type keyFlags struct {
	queue    string
	endpoint string
}

func (k *keyFlags) add(c *cobra.Command) {
	c.Flags().StringVarP(&k.queue, "queue", "q", "", "the `queue` whose consumer keeps the record (its Config.Queue)")
	c.Flags().StringVar(&k.endpoint, "endpoint", "", "the consumer's Config.Endpoint, when it is not the queue")
}

// storeKey is the store's key of the record of key.
func (k *keyFlags) storeKey(key string) (string, error) {
	ep := k.endpoint
	if ep == "" {
		ep = k.queue
	}
	if ep == "" {
		return "", withCode(exitUsage, "--queue (or --endpoint) is required: records are kept per queue")
	}
	return amqpidem.StoreKey(ep, key), nil
}

func (k *keyFlags) name() string {
	if k.endpoint != "" {
		return k.endpoint
	}
	return k.queue
}

// recordJSON is a record as --json prints it.
type recordJSON struct {
	Key             string     `json:"key"`
	Endpoint        string     `json:"endpoint"`
	State           string     `json:"state"`
	Attempts        int        `json:"attempts"`
	Fence           int64      `json:"fence"`
	Owner           string     `json:"owner,omitempty"`
	Live            bool       `json:"live"`
	LeaseLeftMS     int64      `json:"lease_left_ms"`
	Created         *time.Time `json:"created,omitempty"`
	Ended           *time.Time `json:"ended,omitempty"`
	ExpiresInMS     int64      `json:"expires_in_ms"`
	Result          *string    `json:"result,omitempty"`
	ResultBytes     int        `json:"result_bytes,omitempty"`
	ResultTruncated bool       `json:"result_truncated,omitempty"`
	Error           string     `json:"error,omitempty"`
	// Outbox is the messages the handler staged with the result, if any;
	// OutboxError says why they cannot be read.
	Outbox      []stagedJSON `json:"outbox,omitempty"`
	OutboxError string       `json:"outbox_error,omitempty"`
	Location    string       `json:"location"`
}

func toJSON(k *keyFlags, key string, r lock.Record, maxBytes int) recordJSON {
	j := recordJSON{Key: key, Endpoint: k.name(), State: string(r.State), Attempts: r.Attempts, Fence: r.Fence,
		Owner: r.Owner, Live: r.Live(), LeaseLeftMS: r.LeaseLeft.Milliseconds(), Created: timePtr(r.Created),
		Ended: timePtr(r.Ended), ExpiresInMS: r.ExpiresIn.Milliseconds(), Error: r.Error, Location: r.Location}
	if r.State == lock.StateCompleted {
		res := amqpidem.StoredResult(r.Value)
		text, cut := shown(res, maxBytes)
		j.Result, j.ResultBytes, j.ResultTruncated = &text, len(res), cut
		msgs, err := amqpidem.StoredOutbox(r.Value)
		if err != nil {
			j.OutboxError = err.Error()
		}
		for i, m := range msgs {
			j.Outbox = append(j.Outbox, toStagedJSON(i, m))
		}
	}
	return j
}

func newInspect(o *options) *cobra.Command {
	var k keyFlags
	maxBytes := 1024
	c := &cobra.Command{
		Use:   "inspect KEY --queue QUEUE",
		Short: "Show the record of an idempotency key",
		Long: `inspect shows what the store keeps for the message key KEY of a queue's
consumer: its state (in_progress, completed, failed, released, cancelled),
attempts, fencing token, the lease's owner and time left, when it was
created and ended, when it expires, the stored result or error, and
where it lives in the store.

A completed record whose handler staged messages (amqpidem.Stage) shows
them too: per message its index, state (pending: not confirmed yet, the
next delivery of the key publishes it; published; returned: given up after
the broker returned or refused it Config.MaxAttempts times, which "amqpidem
outbox redrive" publishes again), tries, exchange, routing key, MessageId
and body size.

Exit code 3 when the key has no record (never seen, expired, forgotten).`,
		Example: `  amqpidem inspect order-1042 --queue orders
  amqpidem inspect order-1042 --queue orders --json`,
		Args: exactArgs(1, "one KEY"),
		RunE: func(c *cobra.Command, args []string) error {
			return o.withRecord(c, &k, args[0], func(_ context.Context, _ lock.Admin, _ string, r lock.Record) error {
				return o.printRecord(&k, args[0], r, maxBytes)
			})
		},
	}
	k.add(c)
	c.Flags().IntVar(&maxBytes, "max-bytes", maxBytes, "show at most this many bytes of a stored result or error")
	return c
}

// printRecord prints r, the record of key, cutting its result or error to
// maxBytes.
func (o *options) printRecord(k *keyFlags, key string, r lock.Record, maxBytes int) error {
	j := toJSON(k, key, r, maxBytes)
	if o.json {
		return printJSON(o.stdout, j)
	}
	rows := [][]string{
		{"key", j.Key},
		{"endpoint", j.Endpoint},
		{"state", j.State},
		{"attempts", strconv.Itoa(j.Attempts)},
		{"fence", strconv.FormatInt(j.Fence, 10)},
		{"lease", leaseText(r)},
		{"created", when(r.Created)},
		{"ended", when(r.Ended)},
		{"expires in", r.ExpiresIn.Round(time.Millisecond).String()},
	}
	var staged []amqpidem.OutboxMessage
	switch {
	case j.OutboxError != "" && j.ResultBytes == 0:
		rows = append(rows, []string{"result", "unreadable: the stored value is damaged"})
	case j.Result != nil:
		note := fmt.Sprintf(" (%d bytes)", j.ResultBytes)
		if j.ResultTruncated {
			note = fmt.Sprintf(" (first %d of %d bytes)", maxBytes, j.ResultBytes)
		}
		rows = append(rows, []string{"result", oneLine(*j.Result, maxBytes) + note})
	}
	if j.OutboxError != "" {
		rows = append(rows, []string{"outbox", "unreadable: " + oneLine(j.OutboxError, maxBytes)})
	} else if staged, _ = amqpidem.StoredOutbox(r.Value); len(staged) > 0 {
		rows = append(rows, []string{"outbox", outboxCounts(staged)})
	}
	if r.State == lock.StateFailed {
		rows = append(rows, []string{"error", oneLine(r.Error, maxBytes)})
	}
	rows = append(rows, []string{"location", r.Location})
	table(o.stdout, rows)
	if len(staged) > 0 {
		fmt.Fprintln(o.stdout)
		stagedTable(o, staged)
	}
	return nil
}

// leaseText describes a record's lease for people (operator.LeaseText,
// as the console does).
func leaseText(r lock.Record) string { return operator.LeaseText(r) }

func newForget(o *options) *cobra.Command {
	var k keyFlags
	var force, dryRun bool
	c := &cobra.Command{
		Use:   "forget KEY --queue QUEUE [--force] [--dry-run]",
		Short: "Delete the record of an idempotency key so that its work can run again",
		Long: `forget deletes the record of the message key KEY, so that the next delivery
of KEY runs the handler as a first execution. Use it for work that failed
for good and was fixed, or a completed operation that must run again.

It refuses a record whose lease is live (a consumer may be running the work
right now; forgetting it lets a second one start), and a completed record
keeping staged messages not published yet (pending or returned: forgetting
it drops them; "amqpidem outbox redrive" publishes them), unless --force is
given, and it deletes only the record it read: if the record changed meanwhile it
deletes nothing and says so (exit code 4). --dry-run says which record it
would forget (or why not) and changes nothing. Exit code 3 when there is no
record.`,
		Example: `  amqpidem forget payment-77 --queue payments --dry-run
  amqpidem forget payment-77 --queue payments`,
		Args: exactArgs(1, "one KEY"),
		RunE: func(c *cobra.Command, args []string) error {
			return o.withRecord(c, &k, args[0], func(ctx context.Context, admin lock.Admin, skey string, r lock.Record) error {
				return o.forgetRecord(ctx, admin, &k, args[0], skey, r, force, dryRun)
			})
		},
	}
	k.add(c)
	c.Flags().BoolVar(&force, "force", false, "forget a record whose lease is live, or that keeps staged messages not published")
	c.Flags().BoolVar(&dryRun, "dry-run", false, "say which record would be forgotten, change nothing")
	return c
}

// forgetRecord is forget's rules and action on r, the record of key
// (store key skey) just read: it refuses a live lease or a completed
// record keeping staged messages not published without force, says what
// it would do under dryRun, else deletes the record if it is still the
// one read. The console's forget runs it too.
func (o *options) forgetRecord(ctx context.Context, admin lock.Admin, k *keyFlags, key, skey string, r lock.Record, force, dryRun bool) error {
	if r.Live() && !force {
		return withCode(exitRefused, "key %q of %s: a lease is live (%v left, owner %s): a consumer may be running it now; --force forgets it anyway",
			key, k.name(), r.LeaseLeft.Round(time.Millisecond), r.Owner)
	}
	if n := unpublished(r); n > 0 && !force {
		return withCode(exitRefused, "key %q of %s: %s not published yet (pending or returned; see inspect): forgetting the record drops them; amqpidem outbox redrive publishes them; --force forgets anyway",
			key, k.name(), plural(n, "staged message"))
	}
	if dryRun {
		if o.json {
			return printJSON(o.stdout, struct {
				WouldForget recordJSON `json:"would_forget"`
			}{toJSON(k, key, r, 1024)})
		}
		fmt.Fprintf(o.stdout, "would forget the %s record of %q on %s (attempts %d, fence %d) (--dry-run: nothing changed)\n",
			r.State, key, k.name(), r.Attempts, r.Fence)
		return nil
	}
	if err := admin.Forget(ctx, skey, r.State, r.Fence); err != nil {
		return o.storeError(key, k, err)
	}
	if o.json {
		return printJSON(o.stdout, struct {
			Forgot recordJSON `json:"forgot"`
		}{toJSON(k, key, r, 1024)})
	}
	fmt.Fprintf(o.stdout, "forgot the %s record of %q on %s (attempts %d, fence %d): its next delivery runs the handler again\n",
		r.State, key, k.name(), r.Attempts, r.Fence)
	return nil
}

// unpublished counts the staged messages of r not published yet.
func unpublished(r lock.Record) int {
	if r.State != lock.StateCompleted {
		return 0
	}
	msgs, _ := amqpidem.StoredOutbox(r.Value)
	n := 0
	for _, m := range msgs {
		if m.State != amqpidem.OutboxPublished {
			n++
		}
	}
	return n
}

// withRecord opens the store, reads the record of key and calls then with
// them, within --timeout: how inspect and forget begin.
func (o *options) withRecord(c *cobra.Command, k *keyFlags, key string, then func(ctx context.Context, admin lock.Admin, skey string, r lock.Record) error) error {
	skey, err := k.storeKey(key)
	if err != nil {
		return err
	}
	ctx, cancel := callContext(c, o)
	defer cancel()
	admin, closeStore, err := o.openStore(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	r, err := admin.Inspect(ctx, skey)
	if err != nil {
		return o.storeError(key, k, err)
	}
	return then(ctx, admin, skey, r)
}

// storeError turns a store's error about key into a message and exit code.
func (o *options) storeError(key string, k *keyFlags, err error) error {
	switch {
	case errors.Is(err, lock.ErrNotFound):
		return withCode(exitNotFound, "key %q of %s: no record in %s (never seen, expired, or forgotten; check --queue, --endpoint and --prefix)", key, k.name(), o.storeName())
	case errors.Is(err, lock.ErrChanged):
		return withCode(exitRefused, "key %q of %s: the record changed while this ran; nothing deleted: inspect it again", key, k.name())
	case errors.Is(err, lock.ErrInvalidKey):
		return withCode(exitUsage, "key %q: %w", key, err)
	}
	skey, _ := k.storeKey(key)
	return withCode(exitFailed, "key %q of %s: %s: %w", key, k.name(), o.storeName(), keyFree(err, skey))
}

// keyFree is err without the store key skey in its text
// (operator.KeyFree): the lock package's errors quote it.
func keyFree(err error, skey string) error { return operator.KeyFree(err, skey) }
