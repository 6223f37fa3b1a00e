package pgstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/secret"
)

// Defaults of RelayConfig.
const (
	DefaultRelayBatch          = 128
	DefaultRelayConcurrency    = 64
	DefaultRelayClaimTTL       = 30 * time.Second
	DefaultRelayPublishTimeout = 10 * time.Second
	DefaultRelayPollInterval   = time.Second
	DefaultRelayMaxAttempts    = 10
	DefaultRelayRetryBackoff   = time.Second
	DefaultRelayMaxBackoff     = 5 * time.Minute
	DefaultRelayRetention      = time.Hour
	DefaultRelayCleanup        = time.Minute
)

// RelayConfig configures a Relay. Only URL (or Dial) is required.
type RelayConfig struct {
	// URL is the AMQP URL to dial; Dial, when set, overrides it (for TLS,
	// or several nodes to fall back on).
	URL  string
	Dial func() (*amqp.Connection, error)
	// Name is the relay's name in its logs and, followed by "#" and a
	// random suffix of each Relay (so that two relays given one name
	// still hold claims of their own), in its claims (the claimed_by
	// column). Default: host name, process id and a random suffix.
	Name string
	// Batch is how many rows one claim takes at most; with Ordered, how
	// many order keys' heads (and rows without an OrderKey) it takes, each
	// head with up to Batch-1 of its key's next rows: up to Batch² rows
	// (16,384 by default), all held in memory for the round. Default
	// DefaultRelayBatch.
	Batch int
	// Concurrency is how many publishes wait for their confirm at once, on
	// that many confirm-mode channels (at most 64). Default
	// DefaultRelayConcurrency.
	Concurrency int
	// Ordered publishes the messages of one Message.OrderKey one at a
	// time, in the order their transactions committed (then of their
	// writes within one transaction): a message only once every earlier
	// one of its key is confirmed or dead. Write makes that order: a
	// transaction writing a message of a key waits for the one that wrote
	// the key's previous message to end (see Outbox.Write). A relay
	// publishes a key's backlog as a chain, each message after the
	// broker's confirm of the one before (up to Batch per claim), so a
	// backlog goes out at the broker's confirm rate; different keys go
	// Concurrency at a time. Messages without an OrderKey are not held
	// back. Every relay of a table must agree on Ordered: one without it
	// publishes whatever it claims.
	Ordered bool
	// ClaimTTL is how long a claim keeps other relays off the rows it
	// took: a relay that crashes or stops mid-round leaves its rows to the
	// others after it. Default DefaultRelayClaimTTL; it must exceed
	// PublishTimeout times Batch/Concurrency (rounded up), what a round of
	// unordered messages takes at most. A publish starts only while the
	// claim will outlast it: what a round had no time for is released for
	// the next.
	ClaimTTL time.Duration
	// PublishTimeout bounds the wait for one publish's confirm. Default
	// DefaultRelayPublishTimeout.
	PublishTimeout time.Duration
	// PollInterval is how often the relay looks for rows when no
	// notification woke it (Outbox.Write notifies at commit; notifications
	// are lost while the relay's listening connection is down). Default
	// DefaultRelayPollInterval.
	PollInterval time.Duration
	// MaxAttempts is how many times the broker may refuse a message (no
	// queue bound to take it, an exchange that does not exist, a property
	// it refuses) before its row is dead: kept for an operator to list and
	// re-drive, never dropped, never retried again by itself. A lost
	// connection and a nack (the broker cannot take it now: a quorum queue
	// without a leader, a full queue) are not refusals: the row waits
	// RetryBackoff, and the relay backs off unless the broker confirmed or
	// refused other messages of the round, or the rows it could not take
	// had all timed out before. Default DefaultRelayMaxAttempts.
	MaxAttempts int
	// RetryBackoff is the wait after a message's first refusal, doubled
	// after each next one up to MaxBackoff; so is the wait of a row whose
	// publish outlasted PublishTimeout, after each timeout in a row
	// (counted in memory, not as a refusal); also the first wait after the
	// broker or the database could not be reached. Defaults
	// DefaultRelayRetryBackoff and DefaultRelayMaxBackoff.
	RetryBackoff, MaxBackoff time.Duration
	// Retention is how long sent rows are kept (to answer "was it sent,
	// and when?"); negative deletes a row as soon as its publish is
	// confirmed. Default DefaultRelayRetention.
	Retention time.Duration
	// CleanupInterval is how often the relay deletes the sent rows past
	// Retention, in statements of Config.CleanupBatch rows, beside its
	// publishing (a long cleanup holds no publish back). It also bounds
	// each of those statements (at least 10 s): one that a lock on the
	// table holds past it is given up, logged, and tried again at the
	// next cleanup. Default DefaultRelayCleanup.
	CleanupInterval time.Duration
	// Logger gets the relay's warnings and errors. Default the Outbox's
	// Config.Logger, or slog.Default().
	Logger *slog.Logger
	// Tracer, when set, is told of every publish (Kind
	// amqpidem.PublishRelay, with the row's headers, which hold the
	// trace context Config.Inject wrote with it), for a producer span:
	// an otelamqpidem.Tracer fits. Nil: none.
	Tracer amqpidem.PublishTracer
}

// Validate reports the first invalid field, by name. A URL that does not
// parse is named with its password hidden: amqp091-go's parse error,
// which quotes it, is left out.
func (c RelayConfig) Validate() error {
	switch {
	case c.URL == "" && c.Dial == nil:
		return errors.New("pgstore: RelayConfig.URL is required (or Dial)")
	case c.Dial == nil:
		if _, err := amqp.ParseURI(c.URL); err != nil {
			return secret.ParseError("pgstore: RelayConfig.URL", c.URL, err)
		}
	}
	switch {
	case c.Batch < 0, c.Concurrency < 0, c.MaxAttempts < 0:
		return errors.New("pgstore: RelayConfig.Batch, Concurrency and MaxAttempts must not be negative")
	case c.Concurrency > 64:
		return fmt.Errorf("pgstore: RelayConfig.Concurrency %d is above 64, the publisher's channels", c.Concurrency)
	case c.ClaimTTL < 0, c.PublishTimeout < 0, c.PollInterval < 0, c.RetryBackoff < 0, c.MaxBackoff < 0, c.CleanupInterval < 0:
		return errors.New("pgstore: RelayConfig durations other than Retention must not be negative")
	}
	c = c.withDefaults(nil)
	// A round publishes Batch rows Concurrency at a time, each waiting up
	// to PublishTimeout: its claim must outlast it, or other relays take
	// the rows meanwhile and publish them too.
	waves := time.Duration((c.Batch + c.Concurrency - 1) / c.Concurrency)
	if c.ClaimTTL <= c.PublishTimeout*waves {
		return fmt.Errorf("pgstore: RelayConfig.ClaimTTL %v must exceed PublishTimeout %v times Batch/Concurrency (%d/%d, rounded up): "+
			"a claim must outlast the round that publishes its rows", c.ClaimTTL, c.PublishTimeout, c.Batch, c.Concurrency)
	}
	return nil
}

// withDefaults returns c with every zero field set to its default.
func (c RelayConfig) withDefaults(log *slog.Logger) RelayConfig {
	if c.Dial == nil {
		url := c.URL
		c.Dial = func() (*amqp.Connection, error) { return amqp.Dial(url) }
	}
	if c.Name == "" {
		host, _ := os.Hostname()
		c.Name = host + "-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatUint(rand.Uint64()&0xffffff, 16)
	}
	set := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	if c.Batch == 0 {
		c.Batch = DefaultRelayBatch
	}
	if c.Concurrency == 0 {
		c.Concurrency = DefaultRelayConcurrency
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultRelayMaxAttempts
	}
	set(&c.ClaimTTL, DefaultRelayClaimTTL)
	set(&c.PublishTimeout, DefaultRelayPublishTimeout)
	set(&c.PollInterval, DefaultRelayPollInterval)
	set(&c.RetryBackoff, DefaultRelayRetryBackoff)
	set(&c.MaxBackoff, DefaultRelayMaxBackoff)
	set(&c.Retention, DefaultRelayRetention)
	set(&c.CleanupInterval, DefaultRelayCleanup)
	if c.Logger == nil {
		c.Logger = log
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Relay publishes the rows of an Outbox: it claims committed pending rows
// in ID order, publishes each with amqpidem's Publisher (mandatory,
// confirmed), and marks a row sent only after the broker's confirm. So a
// message is published at least once, and more than once when a relay
// crashed between the confirm and the mark (the copy goes once the claim
// ends), or could not write the mark (tried again for a third of
// ClaimTTL), or a paused relay's claim ended, or the broker took a message
// whose confirm did not come back (PublishTimeout passed, the connection
// was lost), or the broker closed a channel the message shared with
// another it refused (the Publisher publishes it again, alone): every copy
// carries the row's MessageId, and an amqpidem consumer runs it once;
// another consumer must drop copies by MessageId. Several relays may run
// on one table at once: a claim takes rows with FOR UPDATE SKIP LOCKED and
// keeps them ClaimTTL. A claim the database does not answer within
// ClaimTTL less PublishTimeout (a hung server, a lock on the table) is
// given up, logged, and tried again after a backoff.
type Relay struct {
	o   *Outbox
	cfg RelayConfig
	log *slog.Logger
	pub *amqpidem.Publisher
	sql relaySQL

	published, refusedN, dead atomic.Uint64

	wake     chan struct{} // a notification or a re-drive: look now
	stopping chan struct{} // closed by Shutdown
	stopOnce sync.Once
	cancel   chan struct{} // closed when Shutdown's ctx ends: publishes give up
	canOnce  sync.Once
	done     chan struct{} // closed when Run returns
	started  atomic.Bool

	// retries are when refused rows are due again, soonest first (at
	// most Batch of them; Run's goroutine only): Run looks again then,
	// not at its next poll, so that a refused head of an order key does
	// not hold its key back for a PollInterval more.
	retries []time.Time

	// slow are the rows whose publishes timed out, by id (Run's
	// goroutine only): see timedOut.
	slow map[int64]slowRow

	// claimant is the claimed_by of this relay's claims: Name and a
	// random suffix. A relay writes a refusal or a release only on rows
	// claimed under it, so no two relays may share it, even when they
	// share a Name.
	claimant string

	beforeMark func() // tests: called before a round marks its rows sent
}

// relaySQL are a Relay's statements.
type relaySQL struct {
	claim, sent, refuse, release, listen string
}

// NewRelay returns a Relay for o's table. It makes no network call.
func NewRelay(o *Outbox, cfg RelayConfig) (*Relay, error) {
	if o == nil {
		return nil, errors.New("pgstore: nil Outbox")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults(o.cfg.Logger)
	t := o.n.outbox
	claim := `WITH c AS (SELECT p.id FROM ` + t + ` p WHERE p.state = 'p' AND p.due_at <= clock_timestamp()
			ORDER BY p.id LIMIT $2 FOR UPDATE SKIP LOCKED)`
	if cfg.Ordered {
		// A row of an order key is claimable when no pending row of its
		// key has a lower seq: it is the key's head. A row visible with
		// seq n has every lower one of its key visible too (schema.go), so
		// no row can yet appear ahead of it. With each head comes the
		// chain of its key's next pending rows, up to $4, published one
		// after the other: nobody else claims them while the head is
		// pending and claimed. The chain ends before the first row that
		// is not due: one that another relay still holds (claimed with
		// a head that was then re-driven ahead of it) or that waits out
		// a backoff is not taken, and nothing behind it. (A row of the
		// previous format written without seq has no place in its key's
		// order: a head, alone.)
		claim = `WITH h AS (SELECT p.id, p.order_key, p.seq FROM ` + t + ` p WHERE p.state = 'p' AND p.due_at <= clock_timestamp()
				AND (p.seq IS NULL OR NOT EXISTS (SELECT 1 FROM ` + t + ` q
					WHERE q.state = 'p' AND q.order_key = p.order_key AND q.seq < p.seq))
				ORDER BY p.id LIMIT $2 FOR UPDATE SKIP LOCKED),
			f AS (SELECT n.id FROM h CROSS JOIN LATERAL (SELECT w.id FROM (
					SELECT q.id, bool_or(q.due_at > clock_timestamp()) OVER (ORDER BY q.seq) AS cut
					FROM (SELECT id, seq, due_at FROM ` + t + ` q WHERE q.state = 'p' AND q.order_key = h.order_key
						AND q.seq > h.seq ORDER BY q.seq LIMIT $4) q) w
				WHERE NOT w.cut) n),
			c AS (SELECT id FROM h UNION ALL SELECT id FROM f)`
	}
	// The UPDATE takes a row only while it is still due: a chain's next
	// rows are read without a lock, and a claim that waited for another
	// one's lock on them re-reads only this WHERE before writing. Without
	// the due_at test, two claims that reached one key's next rows (two
	// heads of one key with one seq, as a dead row re-driven after its
	// key's counter was deleted made them) both took them and published
	// them (TestHrev9RelaysClaimAFollowerOnce).
	claim += `
		UPDATE ` + t + ` t SET claimed_by = $1, due_at = clock_timestamp() + $3 * interval '1 millisecond'
		FROM c WHERE t.id = c.id AND t.state = 'p' AND t.due_at <= clock_timestamp()
		RETURNING t.id, t.message, t.attempts, t.order_key, t.seq`
	sent := `UPDATE ` + t + ` SET state = 's', sent_at = clock_timestamp(), claimed_by = NULL
		WHERE id = ANY($1) AND state = 'p'`
	if cfg.Retention < 0 {
		sent = `DELETE FROM ` + t + ` WHERE id = ANY($1) AND state = 'p'`
	}
	r := &Relay{o: o, cfg: cfg, log: cfg.Logger,
		pub: amqpidem.DialPublisher(cfg.Dial, cfg.Logger),
		sql: relaySQL{
			claim: claim,
			sent:  sent,
			// A refused row is tried again after its backoff, or is dead
			// after MaxAttempts refusals. Only the claim's holder writes:
			// a row another relay claimed since is its business.
			refuse: `UPDATE ` + t + ` t SET attempts = t.attempts + 1, last_error = x.err, claimed_by = NULL,
					state = CASE WHEN t.attempts + 1 >= $2 THEN 'd' ELSE 'p' END,
					due_at = clock_timestamp() + x.wait * interval '1 millisecond'
				FROM unnest($3::bigint[], $4::text[], $5::bigint[]) AS x(id, err, wait)
				WHERE t.id = x.id AND t.state = 'p' AND t.claimed_by = $1
				RETURNING t.id, t.state`,
			// Each row due after its own wait: a row whose publishes
			// time out waits longer each time (Relay.timedOut).
			release: `UPDATE ` + t + ` t SET claimed_by = NULL, due_at = clock_timestamp() + x.wait * interval '1 millisecond'
				FROM unnest($2::bigint[], $3::bigint[]) AS x(id, wait)
				WHERE t.id = x.id AND t.state = 'p' AND t.claimed_by = $1`,
			listen: "LISTEN " + pgx.Identifier{o.n.outboxChannel}.Sanitize(),
		},
		wake:     make(chan struct{}, 1),
		stopping: make(chan struct{}),
		cancel:   make(chan struct{}),
		done:     make(chan struct{}),
		claimant: cfg.Name + "#" + strconv.FormatUint(rand.Uint64(), 36),
		slow:     map[int64]slowRow{},
	}
	return r, nil
}

// Counts returns how many messages the relay published (confirmed), how
// many publishes the broker refused, and how many rows it moved to dead,
// since it was made. promamqpidem.NewRelayCollector exports them.
func (r *Relay) Counts() (published, refused, dead uint64) {
	return r.published.Load(), r.refusedN.Load(), r.dead.Load()
}

// Backlog is Outbox.Backlog: the rows waiting and the oldest one's age.
func (r *Relay) Backlog(ctx context.Context) (rows int64, oldest time.Duration, err error) {
	return r.o.Backlog(ctx)
}

// Dead is Outbox.Dead: the rows dead now, refused MaxAttempts times and
// waiting for an operator, whichever relay (or process) moved them there.
// promamqpidem.NewRelayCollector exports it as a gauge, beside Counts'
// dead, which counts only this relay's since it was made.
func (r *Relay) Dead(ctx context.Context) (int64, error) {
	return r.o.Dead(ctx)
}

// Run relays until Shutdown (then it returns nil) or until ctx ends (then
// ctx.Err()). Errors of the database or the broker are logged and waited
// out with backoff, never returned. Run may be called once. It listens,
// and deletes expired sent rows, from goroutines that end before it
// returns. Called after Shutdown (or with ctx ended), it returns at once,
// having started nothing and opened no connection.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return errors.New("pgstore: Relay.Run called twice")
	}
	defer close(r.done)
	defer r.pub.Close()
	// Before the goroutines below: a listener started only to be
	// cancelled could still dial PostgreSQL (TestHrelay3RunAfterShutdown).
	if r.isStopping() {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel() // before wg.Wait: stops the goroutines below
	wg.Add(3)
	go func() { // Shutdown's ctx ended: stop waiting for confirms
		defer wg.Done()
		select {
		case <-r.cancel:
			cancel()
		case <-ctx.Done():
		}
	}()
	go func() {
		defer wg.Done()
		r.listen(ctx)
	}()
	go func() {
		defer wg.Done()
		r.cleanup(ctx)
	}()

	failures := 0 // rounds in a row the database or broker failed
	for {
		if r.isStopping() {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		began := time.Now()
		n, err := r.round(ctx)
		reachable := true
		if pe := (partialError{}); errors.As(err, &pe) {
			// The broker is reachable, or the rows it could not take
			// wait backoffs of their own: no backoff for all the rows.
			// Not logged once stopping: Shutdown cut the publishes
			// short (TestHrev12ShutdownCutsMixedRoundQuietly).
			if ctx.Err() == nil && !r.isStopping() {
				r.log.Warn("pgstore: relay: "+err.Error(), "relay", r.cfg.Name)
			}
			err, reachable = nil, pe.reachable
		}
		var wait time.Duration
		switch {
		case err != nil:
			failures++
			wait = backoff(r.cfg.RetryBackoff, min(r.cfg.MaxBackoff, 30*time.Second), failures)
			if ctx.Err() == nil && !r.isStopping() {
				r.log.Warn("pgstore: relay: "+err.Error(), "relay", r.cfg.Name, "retry_in", wait)
			}
		default:
			if reachable {
				failures = 0
			}
			wait = r.cfg.PollInterval
			if d, ok := r.nextRetry(began); ok {
				wait = min(wait, d)
			}
		}
		if err == nil && n > 0 {
			// More may be waiting: a full batch's next rows, or an order
			// key's next head, claimable now that its row before is sent.
			continue
		}
		wake := r.wake
		if err != nil {
			wake = nil // a notification does not end a backoff
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-wake:
		case <-r.stopping:
		case <-ctx.Done():
		}
		t.Stop()
	}
}

// cleanup deletes the sent rows past Retention (Outbox.Cleanup), or with
// a negative Retention (rows deleted at their confirm) the counters of
// order keys without pending or dead rows only, every CleanupInterval (from the
// end of one cleanup to the start of the next), beside the publishing
// loop, so that a long one (a lowered Retention, a busy hour's rows)
// holds no publish back, until Shutdown or ctx ends (Run's return cancels
// the statement in flight).
//
// Each of its statements is bounded by CleanupInterval, at least
// cleanupFloor (10 s): one that a lock held on the outbox table (a CREATE
// INDEX without CONCURRENTLY, a LOCK TABLE left open) or a server that
// does not answer holds past it is given up and logged, and gives its
// pool connection back; the next pass tries again an interval later.
// Before, it waited in silence for as long as the lock was held
// (TestHrelay3CleanupBlockedByLock).
func (r *Relay) cleanup(ctx context.Context) {
	per := max(r.cfg.CleanupInterval, cleanupFloor)
	t := time.NewTimer(r.cfg.CleanupInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-r.stopping:
			return
		case <-ctx.Done():
			return
		}
		var err error
		if r.cfg.Retention >= 0 {
			_, err = r.o.cleanup(ctx, r.cfg.Retention, r.o.cfg.CleanupBatch, per)
		} else {
			_, err = r.o.cleanupKeys(ctx, r.o.cfg.CleanupBatch, per)
		}
		if err != nil && ctx.Err() == nil {
			r.log.Warn("pgstore: relay: "+err.Error(), "relay", r.cfg.Name)
		}
		t.Reset(r.cfg.CleanupInterval)
	}
}

// retryAt notes that a refused row is due again at t.
func (r *Relay) retryAt(t time.Time) {
	i, _ := slices.BinarySearchFunc(r.retries, t, time.Time.Compare)
	if i < r.cfg.Batch {
		r.retries = slices.Insert(r.retries, i, t)
		r.retries = r.retries[:min(len(r.retries), r.cfg.Batch)]
	}
}

// nextRetry forgets the retries due by began (the start of the round
// that just ended: it claimed those), and returns how long until the
// soonest of the others, if any (negative when it is due already).
func (r *Relay) nextRetry(began time.Time) (time.Duration, bool) {
	i, _ := slices.BinarySearchFunc(r.retries, began, time.Time.Compare)
	r.retries = r.retries[i:]
	if len(r.retries) == 0 {
		return 0, false
	}
	return time.Until(r.retries[0]), true
}

// cleanupFloor is the least bound of a cleanup statement (a variable:
// tests shorten it).
var cleanupFloor = 10 * time.Second

// backoff is base doubled n-1 times, capped at limit, with up to 20%
// jitter taken off so that relays retrying together spread out.
func backoff(base, limit time.Duration, n int) time.Duration {
	d := base
	for i := 1; i < n && d < limit; i++ {
		d *= 2
	}
	d = min(d, limit)
	return d - rand.N(d/5+1)
}
