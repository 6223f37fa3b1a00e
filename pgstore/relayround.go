package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// claimed is a row a round took.
type claimed struct {
	id       int64
	message  []byte
	attempts int
	orderKey *string // with Ordered: its order key and place in it
	seq      *int64
	err      error // of its publish
	marked   bool  // confirmed and marked sent before its round's end
}

// errNotTried marks a row of an order key's chain that was not published
// in its round: one before it was not confirmed, or the claim was too
// near its end to wait for another publish. Its row is released, due at
// once (it stays behind the row that held it back).
var errNotTried = errors.New("not tried: an earlier message of its order key was not published, or the claim was ending")

// round claims up to Batch rows (and, with Ordered, each order key's next
// rows behind its head), publishes them and records the outcomes. It
// returns how many of the rows it claimed it tried to publish (the loop
// looks again at once only when that is not 0: a claim too short for any
// publish must not make it spin), and an error when the database or the
// broker could not be reached (the rows it could not publish are
// released, due after a backoff): a partialError when the broker confirmed
// or refused others of its messages, or the rows it could not take had all
// timed out before.
func (r *Relay) round(ctx context.Context) (int, error) {
	rows, start, err := r.claim(ctx)
	if err != nil || len(rows) == 0 {
		return 0, err
	}
	// A chain is published one message at a time, each after the
	// confirm of the one before, stopping at the first that is not
	// confirmed; chains go Concurrency at a time (but those below). No publish starts
	// unless the claim outlasts it: a chain's first message (at most
	// Batch of them, which Validate makes fit in the claim when
	// publishes are all that runs) while the claim outlasts its publish;
	// the ones after it only while it outlasts their publish by half of
	// ClaimTTL, left for marking them sent (markSent). What was not tried
	// is released for the next round.
	heads := start.Add(r.cfg.ClaimTTL - r.cfg.PublishTimeout)
	followers := start.Add(r.cfg.ClaimTTL/2 - r.cfg.PublishTimeout)
	// Chains whose head timed out before (r.slow) go once the others are
	// done, one at a time, the fewest timeouts first: on the one
	// connection, a body too large for the link holds back every message
	// sent after it, which times out too; published beside it again, the
	// rows that timed out with it, due again with it, would stay behind it
	// round after round (TestRelayPublishesKnownSlowRowsLast,
	// TestRelaySlowRowsOneAtATime).
	var first, last [][]*claimed
	for _, chain := range chains(rows) {
		if _, slow := r.slow[chain[0].id]; slow {
			last = append(last, chain)
		} else {
			first = append(first, chain)
		}
	}
	slices.SortStableFunc(last, func(a, b []*claimed) int {
		return cmp.Compare(r.slow[a[0].id].timeouts, r.slow[b[0].id].timeouts)
	})
	r.publishChains(ctx, first, r.cfg.Concurrency, heads, followers)
	// The others' confirmed rows are marked sent before the slow ones go:
	// each of those may take a PublishTimeout, up to the end of the
	// claim, and a mark written after it comes after another relay may
	// have published the rows again (TestHrev14SlowRowsLeaveTheMarkItsClaim).
	var markErr error
	if len(last) > 0 {
		var early []int64
		for _, chain := range first {
			for _, c := range chain {
				if c.err == nil {
					c.marked = true
					early = append(early, c.id)
				}
			}
		}
		if len(early) > 0 {
			markErr = r.markSent(ctx, early)
		}
	}
	// One at a time, until one of them is not confirmed: the rest wait
	// for the next round, due at once, so that a round lasts one
	// PublishTimeout beyond its other publishes, not one per slow row,
	// which the rows written meanwhile would wait out
	// (TestRelayRoundTriesOneSlowRow).
	failed := false
	for _, chain := range last {
		if failed {
			for _, c := range chain {
				c.err = errNotTried
			}
			continue
		}
		r.publishChain(ctx, chain, heads, followers)
		for _, c := range chain {
			failed = failed || (c.err != nil && !errors.Is(c.err, errNotTried))
		}
	}

	var sent, unavailable, unavailableWaits, notTried, notTriedWaits []int64
	var refusedIDs, waits []int64
	confirmed := 0 // sent, and those marked before the slow rows went
	var reasons []string
	var brokerErr error
	onlySlow := true // every row the broker could not take timed out before
	now := time.Now()
	r.forgetSlow(now)
	for _, c := range rows {
		switch {
		case c.err == nil:
			confirmed++
			if !c.marked {
				sent = append(sent, c.id)
			}
			delete(r.slow, c.id)
		case errors.Is(c.err, errNotTried):
			notTried = append(notTried, c.id)
			notTriedWaits = append(notTriedWaits, 0)
		case refused(c.err):
			delete(r.slow, c.id)
			refusedIDs = append(refusedIDs, c.id)
			reasons = append(reasons, c.err.Error())
			wait := backoff(r.cfg.RetryBackoff, r.cfg.MaxBackoff, c.attempts+1)
			waits = append(waits, wait.Milliseconds())
			r.log.Warn("pgstore: relay: the broker refused a message", "relay", r.cfg.Name, "id", c.id,
				"attempt", c.attempts+1, "max_attempts", r.cfg.MaxAttempts, "error", c.err)
		default:
			wait, known := r.timedOut(c.id, c.err, now)
			onlySlow = onlySlow && known
			unavailable = append(unavailable, c.id)
			unavailableWaits = append(unavailableWaits, wait.Milliseconds())
			brokerErr = c.err
		}
	}
	r.refusedN.Add(uint64(len(refusedIDs)))
	// The outcomes are written even when ctx has ended (Shutdown): a
	// confirmed message left unmarked is published again. A mark that
	// failed does not keep the round from writing the others: a refusal
	// left unwritten is not counted toward MaxAttempts, and its row waits
	// out the claim instead of its backoff
	// (TestHrelay3RefusalRecordedWhenMarkFails).
	if len(sent) > 0 {
		markErr = errors.Join(markErr, r.markSent(ctx, sent))
	}
	// Started after the mark, which may take a third of ClaimTTL: the
	// statements below share PublishTimeout.
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.PublishTimeout)
	defer cancel()
	var refuseErr error
	if len(refusedIDs) > 0 {
		var dead []int64
		dead, refuseErr = r.refuse(mctx, refusedIDs, reasons, waits)
		if refuseErr != nil {
			// Not recorded: the rows wait out their claim, and are
			// published again with their attempts unchanged.
			waits = nil
		}
		// Each row is due its wait after the refusal's statement, which
		// has returned: so at the latest now plus the wait, by any clock.
		now := time.Now()
		for _, w := range waits {
			r.retryAt(now.Add(time.Duration(w) * time.Millisecond))
		}
		for _, id := range dead {
			r.dead.Add(1)
			r.log.Error("pgstore: relay: a message is dead after being refused MaxAttempts times: list it with "+
				"`amqpidem relay list --state dead`, re-drive it with `amqpidem relay redrive`",
				"relay", r.cfg.Name, "id", id, "max_attempts", r.cfg.MaxAttempts)
		}
	}
	if len(notTried) == len(rows) {
		r.log.Warn("pgstore: relay: a claim ended too soon for any publish: raise RelayConfig.ClaimTTL well above PublishTimeout",
			"relay", r.cfg.Name, "claim_ttl", r.cfg.ClaimTTL, "publish_timeout", r.cfg.PublishTimeout,
			"claimed_for", time.Since(start))
	}
	if len(notTried) > 0 {
		if _, err := r.o.pool.Exec(mctx, r.sql.release, r.claimant, notTried, notTriedWaits); err != nil {
			r.log.Warn("pgstore: relay: release rows (they wait out the claim): "+classify(err).Error(), "relay", r.cfg.Name)
		}
	}
	if len(unavailable) > 0 {
		if _, err := r.o.pool.Exec(mctx, r.sql.release, r.claimant, unavailable, unavailableWaits); err != nil {
			r.log.Warn("pgstore: relay: release rows (they wait out the claim): "+classify(err).Error(), "relay", r.cfg.Name)
		}
		// The row ids: a row the broker never takes in time (a body too
		// large to send within PublishTimeout) is no refusal, so it has no
		// attempts nor last_error to find it by (TestHrelay3PublishOutlastsTimeout).
		// How many were left for the next round, not tried: the others
		// the broker confirmed or refused.
		var left string
		if len(notTried) > 0 {
			left = fmt.Sprintf(", %d not tried", len(notTried))
		}
		err := fmt.Errorf("publish %d of %d messages (row ids %s)%s: %w", len(unavailable), len(rows), idList(unavailable, 10), left, brokerErr)
		if markErr == nil && refuseErr == nil && (confirmed+len(refusedIDs) > 0 || onlySlow) {
			// The broker answered for the others: reachable. Or the
			// rows it could not take are all ones that timed out
			// before, each waiting a backoff of its own: backing off
			// for them all made every other message wait it out
			// (TestHrev12LoneSlowRowBacksRelayOff).
			return len(rows) - len(notTried), partialError{err, confirmed+len(refusedIDs) > 0}
		}
		return len(rows) - len(notTried), errors.Join(markErr, refuseErr, err)
	}
	return len(rows) - len(notTried), errors.Join(markErr, refuseErr)
}

// publishChains publishes the chains cs, n at a time (publishChain).
func (r *Relay) publishChains(ctx context.Context, cs [][]*claimed, n int, heads, followers time.Time) {
	sem := make(chan struct{}, n)
	var wg sync.WaitGroup
	for _, chain := range cs {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			r.publishChain(ctx, chain, heads, followers)
		}()
	}
	wg.Wait()
}

// publishChain publishes chain and sets each message's err: one message
// at a time, each after the confirm of the one before, stopping at the
// first that is not confirmed. No publish starts after heads, nor one
// after the chain's first after followers: those are errNotTried.
func (r *Relay) publishChain(ctx context.Context, chain []*claimed, heads, followers time.Time) {
	var failed error
	for i, c := range chain {
		switch {
		case failed != nil:
			c.err = errNotTried
		case time.Now().After(heads), i > 0 && time.Now().After(followers):
			c.err, failed = errNotTried, errNotTried
		default:
			c.err = r.publish(ctx, c.message)
			failed = c.err
		}
	}
}

// maxSlowRows bounds Relay.slow: past it, a row that times out for the
// first time waits RetryBackoff each time, as if not known.
const maxSlowRows = 4096

// slowRow is what a relay knows of a row whose publishes timed out.
type slowRow struct {
	timeouts int       // in a row
	due      time.Time // when its last release made it due again
}

// timedOut returns how long the row id, which the broker could not take
// (err), waits before its next try, and whether it had timed out before.
// A publish that outlasts PublishTimeout is no refusal (a slow or blocked
// broker gives the same error), so it counts toward no MaxAttempts; but a
// row that always outlasts it (a body too large for the link) would be
// tried, and its body copied to the queue, every RetryBackoff for good. So
// its wait doubles after each timeout in a row, from RetryBackoff up to
// MaxBackoff, counted in memory: forgotten on a
// restart, past maxSlowRows rows, once confirmed or refused, or once not
// claimed again by this relay within ClaimTTL after it was due (another
// relay took it) (TestHrev12SlowRowTriesGrow). Any other error (a lost
// connection) waits RetryBackoff and ends the row's run of timeouts.
func (r *Relay) timedOut(id int64, err error, now time.Time) (time.Duration, bool) {
	if !errors.Is(err, context.DeadlineExceeded) {
		delete(r.slow, id)
		return r.cfg.RetryBackoff, false
	}
	s, known := r.slow[id]
	if !known && len(r.slow) >= maxSlowRows {
		return r.cfg.RetryBackoff, false
	}
	s.timeouts++
	// No jitter: rows that timed out together (behind one slow body on
	// the connection) stay due together, as they were when each waited
	// RetryBackoff. Apart, one's round came while the other's body still
	// filled the link, and timed out behind it, round after round
	// (TestHrelay3PublishOutlastsTimeout: "other" never published in 8 s).
	wait := r.cfg.RetryBackoff
	for i := 1; i < s.timeouts && wait < r.cfg.MaxBackoff; i++ {
		wait *= 2
	}
	wait = min(wait, r.cfg.MaxBackoff)
	s.due = now.Add(wait)
	r.slow[id] = s
	return wait, known
}

// forgetSlow forgets the slow rows not claimed again by this relay within
// ClaimTTL after they were due: another relay took them, or an operator's
// hand, or this relay backed off meanwhile.
func (r *Relay) forgetSlow(now time.Time) {
	for id, s := range r.slow {
		if now.Sub(s.due) > r.cfg.ClaimTTL {
			delete(r.slow, id)
		}
	}
}

// idList formats up to n of ids, space-separated, with "..." when there
// are more.
func idList(ids []int64, n int) string {
	var b strings.Builder
	for i, id := range ids[:min(len(ids), n)] {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(strconv.FormatInt(id, 10))
	}
	if len(ids) > n {
		b.WriteString(" ...")
	}
	return b.String()
}

// partialError is round's error when the broker confirmed or refused some
// of its messages and could not take others (no confirm within
// PublishTimeout, a nack, a channel lost): the broker is reachable, so Run
// logs it and does not back off; the rows it could not take are released,
// due again after RetryBackoff (or their own wait: timedOut). It is round's
// error too when the rows the broker could not take all timed out before:
// each waits its own growing wait, so a relay-wide backoff would only hold
// the other rows back (a broker whose publishes all time out, blocked or
// hung, is backed off from at the first round of rows new to it).
// Backing off, as from a broker that cannot be reached, made one row that
// always outlasts PublishTimeout hold every other row back for up to 30 s
// a round (TestHrelay3OneSlowRowHoldsNoOtherBack).
type partialError struct {
	error
	// reachable: the broker confirmed or refused some of the round's
	// messages, which ends a run of failed rounds. A round of rows that
	// timed out before neither ends nor lengthens it: a broker that
	// times out every publish (blocked by an alarm, a hung dial) is still
	// backed off from more at each round of rows new to the relay.
	reachable bool
}

func (e partialError) Unwrap() error { return e.error }

// markSent marks the rows ids sent (deletes them, with a negative
// Retention) once the broker confirmed them, and counts them published.
//
// A confirmed row left unmarked is published again once its claim ends,
// so a mark that fails (the session lost, the server restarting) is tried
// again, after 50 ms doubled up to 1 s, on a connection checked to be
// alive: new tries start for a third of ClaimTTL, each bounded by a
// sixth, so all end within half of ClaimTTL after the publishes. round
// stops starting a chain's later publishes in time for that; a slow first
// wave can still leave less. A mark written after the claim ended may come
// after another relay took the rows and published them again: copies,
// with one MessageId. The mark changes only rows still pending: repeating
// it, or writing it after another relay's, is harmless. It is written
// even when ctx has ended (Shutdown).
func (r *Relay) markSent(ctx context.Context, ids []int64) error {
	if r.beforeMark != nil {
		r.beforeMark()
	}
	ctx = context.WithoutCancel(ctx)
	window := r.cfg.ClaimTTL / 3
	per := max(window/2, 100*time.Millisecond)
	deadline := time.Now().Add(window)
	wait := 50 * time.Millisecond
	for try := 1; ; try++ {
		err := r.markOnce(ctx, ids, try > 1, per)
		if err == nil {
			r.published.Add(uint64(len(ids)))
			if try > 1 {
				r.log.Info("pgstore: relay: marked the published rows sent on a later try", "relay", r.cfg.Name,
					"rows", len(ids), "tries", try)
			}
			return nil
		}
		if time.Until(deadline) < wait {
			return fmt.Errorf("mark %d published rows sent, %d tries (they will be published again once their claim ends): %w",
				len(ids), try, err)
		}
		if try == 1 {
			r.log.Warn("pgstore: relay: mark published rows sent (trying again): "+err.Error(), "relay", r.cfg.Name,
				"rows", len(ids))
		}
		time.Sleep(wait)
		wait = min(2*wait, time.Second)
	}
}

// markOnce is one try of markSent, bounded by per. A retry (check) first
// pings the connection the pool gives, and takes another while it gives
// dead ones (a session ended under an idle connection), up to MaxConns.
func (r *Relay) markOnce(ctx context.Context, ids []int64, check bool, per time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, per)
	defer cancel()
	c, err := r.acquire(ctx)
	for dead := int32(0); err == nil && check && dead < r.o.pool.Stat().MaxConns(); dead++ {
		if err = c.Ping(ctx); err == nil {
			break
		}
		c.Release() // closed: the pool drops it
		if ctx.Err() != nil {
			return classify(err)
		}
		c, err = r.acquire(ctx)
	}
	if err != nil {
		return err
	}
	defer c.Release()
	_, err = c.Exec(ctx, r.sql.sent, ids)
	return classify(err)
}

// acquire returns a connection of the Outbox's pool, waiting poolWait at
// most: a pool whose connections are all taken (by the application, or too
// small) is an error that the relay logs and backs off from, never a
// silent stall.
func (r *Relay) acquire(ctx context.Context) (*pgxpool.Conn, error) {
	actx, cancel := context.WithTimeout(ctx, poolWait)
	defer cancel()
	c, err := r.o.pool.Acquire(actx)
	if err == nil {
		return c, nil
	}
	if ctx.Err() == nil && actx.Err() != nil {
		st := r.o.pool.Stat()
		if st.ConstructingConns() > 0 {
			// Not a busy pool: a new connection was still being made.
			return nil, fmt.Errorf("no connection to the database within %v: the server or the network did not "+
				"answer a new connection (%d of the pool's MaxConns %d in use): %w", poolWait,
				st.AcquiredConns(), st.MaxConns(), err)
		}
		return nil, fmt.Errorf("no connection of the pool free within %v (%d of its MaxConns %d in use, by the relay or "+
			"others): %w", poolWait, st.AcquiredConns(), st.MaxConns(), err)
	}
	return nil, classify(err)
}

// claim takes up to Batch due rows for ClaimTTL, in ID order, and with
// Ordered the chains behind the order keys' heads among them. It returns
// them and when it started the claim's statement, which is no later than
// the claim's start by the database's clock.
//
// The statement is bounded by ClaimTTL less PublishTimeout: rows that
// come back later could no longer be published (round releases them
// untried). So a database that takes the statement and does not answer (a
// hung server, a network dropping packets without resetting the
// connection, a lock another session holds on the table) is an error that
// the relay logs and backs off from, not a wait in silence for as long as
// the server's TCP stack answers (before, TestHrev9RelayClaimHungDatabase
// and TestHrev9RelayClaimBlockedByLock waited 6 s without a word). pgx
// drops the connection then; a server that runs the statement later (once
// the lock is released) claims rows that nobody publishes until that claim
// ends: published late, not lost.
func (r *Relay) claim(ctx context.Context) ([]claimed, time.Time, error) {
	args := []any{r.claimant, r.cfg.Batch, r.cfg.ClaimTTL.Milliseconds()}
	if r.cfg.Ordered {
		args = append(args, r.cfg.Batch-1)
	}
	c, err := r.acquire(ctx) // bounded: a busy pool is an error, not a stall
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("claim: %w", err)
	}
	defer c.Release()
	start := time.Now()
	wait := r.cfg.ClaimTTL - r.cfg.PublishTimeout // > 0: Validate
	qctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	fail := func(err error) error {
		if ctx.Err() == nil && qctx.Err() != nil {
			return fmt.Errorf("claim: the database did not answer within %v (ClaimTTL less PublishTimeout, after which its rows "+
				"could not be published): a hung server, a lost network, or a lock held on the outbox table: %w", wait, classify(err))
		}
		return fmt.Errorf("claim: %w", classify(err))
	}
	q, err := c.Query(qctx, r.sql.claim, args...)
	if err != nil {
		return nil, start, fail(err)
	}
	defer q.Close()
	var rows []claimed
	for q.Next() {
		var row claimed
		if err := q.Scan(&row.id, &row.message, &row.attempts, &row.orderKey, &row.seq); err != nil {
			return nil, start, fail(err)
		}
		if !r.cfg.Ordered {
			row.orderKey, row.seq = nil, nil // no chains: each row on its own
		}
		rows = append(rows, row)
	}
	if err := q.Err(); err != nil {
		return nil, start, fail(err)
	}
	return rows, start, nil
}

// chains groups the claimed rows into what is published in sequence: the
// rows of one order key in seq order (Ordered), and each other row alone,
// in ID order of their first rows.
func chains(rows []claimed) [][]*claimed {
	slices.SortFunc(rows, func(a, b claimed) int { return cmp.Compare(a.id, b.id) })
	var out [][]*claimed
	byKey := map[string]int{} // order key -> its chain in out
	for i := range rows {
		c := &rows[i]
		if c.seq == nil {
			out = append(out, []*claimed{c})
			continue
		}
		j, ok := byKey[*c.orderKey]
		if !ok {
			j = len(out)
			byKey[*c.orderKey] = j
			out = append(out, nil)
		}
		out[j] = append(out[j], c)
	}
	for _, chain := range out {
		slices.SortFunc(chain, func(a, b *claimed) int { return cmp.Compare(*a.seq, *b.seq) })
	}
	return out
}

// refuse records the broker's refusals and returns the IDs of the rows
// that are dead now.
func (r *Relay) refuse(ctx context.Context, ids []int64, reasons []string, waits []int64) ([]int64, error) {
	q, err := r.o.pool.Query(ctx, r.sql.refuse, r.claimant, r.cfg.MaxAttempts, ids, reasons, waits)
	if err != nil {
		return nil, fmt.Errorf("record %d refusals: %w", len(ids), classify(err))
	}
	var dead []int64
	for q.Next() {
		var id int64
		var state string
		if err := q.Scan(&id, &state); err != nil {
			q.Close()
			return nil, fmt.Errorf("record %d refusals: %w", len(ids), classify(err))
		}
		if state == "d" {
			dead = append(dead, id)
		}
	}
	if err := q.Err(); err != nil {
		return nil, fmt.Errorf("record %d refusals: %w", len(ids), classify(err))
	}
	return dead, nil
}

// publish decodes a stored message and publishes it, waiting
// PublishTimeout at most. A message that cannot be decoded is refused.
func (r *Relay) publish(ctx context.Context, b []byte) error {
	exchange, key, msg, err := amqpidem.UnmarshalPublishing(b)
	if err != nil {
		return fmt.Errorf("%w: %w", errUndecodable, err)
	}
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
	defer cancel()
	if r.cfg.Tracer == nil {
		return r.pub.Publish(ctx, exchange, key, msg)
	}
	if msg.Headers == nil {
		msg.Headers = amqp.Table{}
	}
	end := r.cfg.Tracer.StartPublish(ctx, amqpidem.Publish{Kind: amqpidem.PublishRelay, Exchange: exchange, RoutingKey: key,
		Headers: msg.Headers, MessageID: msg.MessageId, CorrelationID: msg.CorrelationId, BodySize: len(msg.Body)})
	err = r.pub.Publish(ctx, exchange, key, msg)
	if end != nil {
		end(err)
	}
	return err
}

// errUndecodable marks a row whose message cannot be read: refused.
var errUndecodable = errors.New("stored message unreadable")

// refused reports whether err is the broker refusing the message itself
// (no queue bound to take it, a channel closed over it: an exchange that
// does not exist, a property refused), or a row that cannot be read: what
// counts toward MaxAttempts. A connection that failed or ended is not; nor
// is a plain nack, which says the broker could not take the message now (a
// quorum queue electing a leader, a queue full with reject-publish), not
// that the message is wrong: counted, it turned rows dead during a node's
// restart (chaos scenario 16 with -max-attempts 2).
func refused(err error) bool {
	return errors.Is(err, errUndecodable) || amqpidem.IsRefused(err)
}
