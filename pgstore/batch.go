package pgstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

// BatchTxFunc does the work of a batch's messages in tx and answers per
// message, as amqpidem.BatchHandler does: nil for every message done with
// no result, or one amqpidem.BatchResult per delivery of ds, in order;
// a non-nil error is the whole batch's (nothing commits, and amqpidem
// splits the batch to find the message at fault). tx is as TxFunc's
// (Commit keeps the work for the commit with the records, Rollback undoes
// it, and either closes tx: Commit once, after the last message); run its
// statements with ctx. Each way of ending comes to what TxFunc says,
// for the whole batch, with one difference: when fn ended the transaction
// itself and it committed (a COMMIT statement, or a library given
// tx.Conn()), a batch error (a panic too) or a message's retryable error
// after that is made each message's own error, Permanent, wrapping
// ErrTxEnded: their work committed, and a batch error would be split and
// its halves run again.
//
// amqpidem.DeliveryContext(ctx, d) is the context of the message d: its
// Info, and its outbox (amqpidem.Stage), whose messages are stored with
// its record in the batch's transaction, and published after the commit,
// before its ack, as with TxHandler.
//
// A message answered with an error may have written in tx before it
// failed: its writes never commit. When some messages of a batch fail and
// others succeed, the transaction rolls back and fn runs again on those
// that succeeded, in a new transaction, until a run's messages all
// succeed; only that run commits, with their records. A handler that
// fails messages often pays for that rerun: do each message's work under
// a savepoint of its own (tx.Begin, then Rollback on its failure) and
// answer its error after rolling the savepoint back, and the rerun is
// still made (the library cannot see savepoints), but on less work. The
// messages staged by a run that did not commit are dropped with it: a
// rerun stages afresh.
type BatchTxFunc func(ctx context.Context, tx pgx.Tx, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error)

// BatchTxHandler returns a batch handler (amqpidem.NewBatchConsumer) that
// runs fn on a batch in one transaction (begun with Config.TxOptions) and
// completes the records of every message fn answered without an error in
// that same transaction, with one statement, sent with the COMMIT: fn's
// writes and the batch's records commit together, once, or not at all.
// The messages are acked after the commit.
//
//   - fn returns an error, panics, or a statement of it failed: the
//     transaction rolls back, and amqpidem splits the batch.
//   - A lease of the batch was lost (another consumer took a key over):
//     that record refuses its completion (compare-and-set on owner and
//     fence), the whole transaction rolls back, and amqpidem runs the
//     batch again without that message, which is requeued.
//   - The commit's outcome is unknown (the connection dropped during
//     COMMIT): the server is asked, on another connection, whether the
//     transaction committed; if it did, the messages are acked. When it
//     cannot say, every message of the batch is requeued, and its redelivery
//     finds its record completed (acked as a duplicate) or still held (the
//     effects rolled back with it, and it runs again). The batch is not
//     run again in place, which could commit its effects twice.
//
// The returned handler implements amqpidem.BatchLeaseTaker: the batch
// consumer takes a lease batch's leases with its AcquireLeaseBatch, held
// by the session of one pooled connection and written once, with the
// batch's effects (one commit per batch; see "Lease batches held by a
// session" in the package documentation). A lease batch holds that
// connection until each of its leases ended. With Config.RowLeases, and
// for redelivered messages, the leases are record rows taken by
// AcquireBatch (one statement for the batch), committed before the batch
// runs, and a batch holds one pooled connection while it runs.
//
// The returned handler implements amqpidem.BatchCompleter. A message
// processed without a lease (amqpidem.ProcessMissingKey, FailOpen) runs
// fn as a batch of one, in a transaction of its own, with no record.
func (s *Store) BatchTxHandler(fn BatchTxFunc) amqpidem.BatchHandler {
	return &batchTxHandler{s: s, fn: fn, tx: txOptions{s.cfg.TxOptions, s.sql.begin}}
}

// batchTxHandler is what BatchTxHandler returns.
type batchTxHandler struct {
	s  *Store
	fn BatchTxFunc
	tx txOptions
}

var _ amqpidem.BatchCompleter = (*batchTxHandler)(nil)

// CompleterStore returns the Store the handler writes records to.
func (h *batchTxHandler) CompleterStore() lock.Store { return h.s }

// HandleBatch runs fn in a transaction with no records, and commits it,
// unless some messages failed: as with records, their writes never
// commit, and the others run again without them (complete).
func (h *batchTxHandler) HandleBatch(ctx context.Context, ds []*amqp.Delivery) ([]amqpidem.BatchResult, error) {
	return h.complete(ctx, ds, nil, nil, nil)
}

// HandleBatchComplete runs fn on the items' deliveries in a transaction,
// then completes the records of those done and commits, in one round
// trip (see BatchTxHandler). The items of a lease batch held by a session
// (AcquireLeaseBatch) run on that session, in its transaction; items of
// several lease batches, or of one and of record-row leases, run as one
// part each, one transaction each (part).
func (h *batchTxHandler) HandleBatchComplete(ctx context.Context, items []amqpidem.BatchItem, value func(int, []byte) ([]byte, error)) ([]amqpidem.BatchResult, error) {
	var parts []*part
	byBatch := map[*heldBatch]*part{}
	rows := &part{}
	var bad []int
	for i, it := range items {
		if err := lock.CheckLease(it.Lease); err != nil {
			return nil, err
		}
		switch b := h.s.heldBatchOf(it.Lease); {
		case b != nil:
			p := byBatch[b]
			if p == nil {
				p = &part{b: b}
				byBatch[b] = p
				parts = append(parts, p)
			}
			p.idx = append(p.idx, i)
		case isHeld(it.Lease):
			bad = append(bad, i)
		default:
			rows.idx = append(rows.idx, i)
		}
	}
	if len(rows.idx) > 0 {
		parts = append(parts, rows)
	}
	if len(parts) == 1 && len(bad) == 0 {
		return parts[0].run(ctx, h, items, value)
	}
	rs := make([]amqpidem.BatchResult, len(items))
	for _, i := range bad {
		// A single held lease (a batch cannot complete it), or a batch's
		// that ended before its run (its TTL passed): not run.
		rs[i].Err = fmt.Errorf("%w: key %q: the lease is not held by a lease batch's session (it ended, or was never one's)", lock.ErrUnavailable, items[i].Lease.Key)
	}
	ran := false
	for _, p := range parts {
		if ran {
			// An earlier part ran, and may have committed (its messages
			// answered with errors too: the function's own COMMIT, then
			// an error): a batch error would be split by amqpidem and
			// that part run again. This part is split here instead.
			h.split(ctx, p, items, value, rs)
			continue
		}
		prs, err := p.run(ctx, h, items, value)
		if err != nil {
			// Nothing ran yet: the batch error is the whole batch's, and
			// amqpidem splits it (the parts not run yet hold their
			// leases as they were).
			return nil, err
		}
		for j, i := range p.idx {
			if prs != nil {
				rs[i] = prs[j]
			}
		}
		ran = true
	}
	return rs, nil
}

// split runs p's items, part of a run batch of which another part ran, as
// amqpidem runs a batch: a batch error splits them in halves, each run
// again, down to single messages, whose error is then their own, so that
// a poison message is not charged to its neighbours; a commit whose
// outcome is unknown (lock.ErrUnavailable) is not run again. It sets the
// items' answers in rs.
func (h *batchTxHandler) split(ctx context.Context, p *part, items []amqpidem.BatchItem, value func(int, []byte) ([]byte, error), rs []amqpidem.BatchResult) {
	prs, err := p.run(ctx, h, items, value)
	switch {
	case err == nil:
		for j, i := range p.idx {
			if prs != nil {
				rs[i] = prs[j]
			}
		}
	case len(p.idx) == 1 || ctx.Err() != nil || errors.Is(err, lock.ErrUnavailable) && !amqpidem.IsPermanent(err):
		for _, i := range p.idx {
			rs[i].Err = err
		}
	default:
		// What the failed run staged did not commit: the halves stage
		// afresh.
		amqpidem.DiscardStaged(ctx)
		mid := len(p.idx) / 2
		h.split(ctx, &part{b: p.b, idx: p.idx[:mid]}, items, value, rs)
		h.split(ctx, &part{b: p.b, idx: p.idx[mid:]}, items, value, rs)
	}
}

// part is the items of a run batch that run in one transaction: those of
// the lease batch b, or, with b nil, those of record-row leases.
type part struct {
	b   *heldBatch
	idx []int // their indexes in the run batch
}

// run runs p's items as a batch of their own.
func (p *part) run(ctx context.Context, h *batchTxHandler, items []amqpidem.BatchItem, value func(int, []byte) ([]byte, error)) ([]amqpidem.BatchResult, error) {
	ds := make([]*amqp.Delivery, len(p.idx))
	leases := make([]lock.Lease, len(p.idx))
	for j, i := range p.idx {
		ds[j], leases[j] = items[i].Delivery, items[i].Lease
	}
	sub := func(j int, r []byte) ([]byte, error) { return value(p.idx[j], r) }
	if p.b != nil {
		return h.runHeld(ctx, p.b, ds, leases, sub)
	}
	return h.complete(ctx, ds, leases, sub, nil)
}

// heldBatchOf returns the lease batch l is a member of, nil when it is
// none's.
func (s *Store) heldBatchOf(l lock.Lease) *heldBatch {
	if !isHeld(l) {
		return nil
	}
	if h, ok := s.held.Load(l.Owner); ok {
		return h.batch
	}
	return nil
}

// errRunAgain is run's answer when some of the batch's messages failed
// and others did not: the transaction, which may hold the failed ones'
// writes, was not committed; the messages answered without an error must
// run again without the others (complete).
var errRunAgain = errors.New("pgstore: some messages of the batch failed: run the rest again")

// complete runs fn on the batch ds with leases and commits it with the
// records of its messages, as run does, running it again without the
// failed messages until a run's messages all succeed (see BatchTxHandler):
// the failed ones' writes never commit. With no leases (nil), there are no
// records, and value is not called. With b, the leases are b's members,
// and it runs on b's session (b.mu held).
func (h *batchTxHandler) complete(ctx context.Context, ds []*amqp.Delivery, leases []lock.Lease, value func(int, []byte) ([]byte, error), b *heldBatch) ([]amqpidem.BatchResult, error) {
	rs, err := h.run(ctx, ds, leases, value, b)
	if !errors.Is(err, errRunAgain) {
		return rs, err
	}
	var ok []int
	for i := range rs {
		if rs[i].Err == nil {
			ok = append(ok, i)
		}
	}
	// What the first run staged rolled back with it: the rerun stages
	// afresh (amqpidem.DeliveryContext), and only the committed run's
	// staged messages are stored with the records.
	amqpidem.DiscardStaged(ctx)
	subDs := make([]*amqp.Delivery, len(ok))
	var subLeases []lock.Lease
	var subValue func(int, []byte) ([]byte, error)
	if leases != nil {
		subLeases = make([]lock.Lease, len(ok))
		subValue = func(j int, result []byte) ([]byte, error) { return value(ok[j], result) }
	}
	for j, i := range ok {
		subDs[j] = ds[i]
		if leases != nil {
			subLeases[j] = leases[i]
		}
	}
	srs, err := h.complete(ctx, subDs, subLeases, subValue, b)
	if err != nil {
		return nil, err // the rest failed as a batch: amqpidem splits it all
	}
	for j, i := range ok {
		rs[i] = srs[j]
	}
	return rs, nil
}

// run begins a transaction, runs fn in it, and commits it with the
// records of leases (when not nil) whose messages fn answered without an
// error, completed with value. With b, the transaction is on b's session
// (b.mu held), and the leases b's members: a run that does not commit
// leaves its transaction for b.settle to roll back.
func (h *batchTxHandler) run(ctx context.Context, ds []*amqp.Delivery, leases []lock.Lease, value func(int, []byte) ([]byte, error), b *heldBatch) ([]amqpidem.BatchResult, error) {
	var conn *pgx.Conn
	var xid string
	var t *handlerTx
	var err error
	if b != nil {
		xid, err = b.beginHeld(ctx)
		if err == nil {
			conn = b.conn.Conn()
			// pooled: a closed connection goes back to the pool at
			// once (releaseClosed), as for a single held lease, so that
			// the questions after it are asked on another; b forgets it
			// then (sync).
			t = &handlerTx{conn: conn, pooled: b.conn}
			defer func() {
				b.sync(t)
				b.settle(ctx, nil)
			}()
		}
	} else {
		var pooled *pgxpool.Conn
		pooled, err = h.s.pool.Acquire(ctx)
		if err == nil {
			conn = pooled.Conn()
			t = &handlerTx{conn: conn, pooled: pooled}
			defer h.s.endConn(t)
			xid, err = h.s.begin(ctx, conn, h.tx)
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("pgstore: begin: %w", err)
		}
		return nil, fmt.Errorf("pgstore: begin: %w", classify(err))
	}
	rs, ferr := callFn(func() ([]amqpidem.BatchResult, error) { return h.fn(ctx, t, ds) })
	if ferr == nil && rs != nil && len(rs) != len(ds) {
		ferr = fmt.Errorf("pgstore: the batch function returned %d results for %d messages", len(rs), len(ds))
	}
	if pc := t.conn.PgConn(); ferr == nil && !pc.IsClosed() && pc.TxStatus() == 'T' &&
		slices.ContainsFunc(rs, func(r amqpidem.BatchResult) bool { return r.Err != nil }) {
		// Messages failed, which runs the others again (or retries the
		// failed): not if fn committed its work itself and began again.
		// A transaction that is not xid is rolled back here, and ending
		// decides as for one fn ended (see begunAgain).
		h.s.begunAgain(ctx, t, xid, 'T')
	}
	end, err := h.s.ending(ctx, t, xid, ferr, b != nil)
	b.sync(t)
	if end == endFailed && (errors.Is(err, ErrTxEnded) || errors.Is(err, errWorkUnknown)) {
		return eachFailed(len(ds), err), nil
	}
	if end == endFailed {
		return nil, err
	}
	if end == endCommitted {
		// fn committed its work itself: a message it answered with an
		// error has its writes committed too, so it must not run again.
		rs = slices.Clone(rs)
		for i := range rs {
			if rs[i].Err != nil && !amqpidem.IsPermanent(rs[i].Err) {
				rs[i].Err = amqpidem.Permanent(fmt.Errorf("%w, %w; it answered this message with an error, so it is not run again: %w",
					ErrTxEnded, errWorkCommitted, rs[i].Err))
			}
		}
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if leases == nil {
		failed := 0
		for i := range rs {
			if rs[i].Err != nil {
				failed++
			}
		}
		switch {
		case end == endCommitted:
			return rs, nil
		case failed == len(ds):
			return rs, nil // nothing to commit: endConn rolls it back
		case failed > 0:
			// The failed messages' writes may be in the transaction:
			// endConn rolls it back, and complete runs the rest again.
			return rs, errRunAgain
		}
		if err := commit(cctx, conn, xid); errors.Is(err, ErrTxEnded) {
			return eachFailed(len(ds), err), nil
		} else if err != nil {
			return rs, err
		}
		return rs, nil
	}
	if rs == nil {
		rs = make([]amqpidem.BatchResult, len(ds))
	} else {
		rs = slices.Clone(rs)
	}
	// The records to complete, in key order (the order finish_tx is
	// called in for the records the batch's UPDATE leaves to it).
	var done []int
	values := make([][]byte, len(ds))
	for i := range rs {
		if rs[i].Err != nil {
			continue
		}
		v, err := value(i, rs[i].Result)
		if err == nil && len(v) > h.s.cfg.MaxResultSize {
			err = fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", lock.ErrResultTooLarge, leases[i].Key, len(v), h.s.cfg.MaxResultSize)
		}
		if err != nil {
			rs[i] = amqpidem.BatchResult{Err: err}
			continue
		}
		values[i] = v
		done = append(done, i)
	}
	slices.SortFunc(done, func(a, b int) int { return cmp.Compare(leases[a].Key, leases[b].Key) })
	switch {
	case len(done) == 0:
		return rs, nil // nothing to commit: endConn rolls it back
	case len(done) < len(ds) && end != endCommitted:
		// The failed messages' writes may be in the transaction:
		// endConn rolls it back, and complete runs the rest again.
		return rs, errRunAgain
	case end == endCommitted:
		// fn committed its work itself: the records are completed on
		// their own, one by one (no longer atomic with the work, as with
		// TxHandler).
		for _, i := range done {
			if err := h.finishOne(cctx, t, b, leases[i], values[i]); err != nil {
				rs[i] = amqpidem.BatchResult{Err: recordAfterCommit(err)}
			}
		}
		return rs, nil
	}
	if b != nil {
		err = h.s.finishHeldBatch(cctx, b, xid, leases, values, done)
	} else {
		err = h.s.finishBatch(cctx, conn, xid, leases, values, done)
	}
	if errors.Is(err, ErrTxEnded) {
		return eachFailed(len(ds), err), nil
	}
	if err != nil && h.s.workCommitted(cctx, t, xid) && b.sync(t) {
		// Done, though the records' write and commit failed (see
		// workCommitted): each record is completed on its own, as after
		// fn's own COMMIT, and a message whose record cannot be is never
		// run again. With a timeout of its own: a commit whose answer
		// never came used up cctx.
		fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
		defer fcancel()
		for _, i := range done {
			if err := h.finishOne(fctx, t, b, leases[i], values[i]); err != nil {
				rs[i] = amqpidem.BatchResult{Err: recordNotConfirmed(err)}
			}
		}
		return rs, nil
	}
	return rs, err
}

// finishOne completes the record of l on its own, its run's work having
// committed without it: on t's connection (or the pool's) for a
// record-row lease, with finishOwn for a member of b.
func (h *batchTxHandler) finishOne(ctx context.Context, t *handlerTx, b *heldBatch, l lock.Lease, value []byte) error {
	if b != nil {
		return h.s.finishOwn(ctx, b, l, value)
	}
	return h.s.finish(ctx, t.querier(h.s), l, "complete", "c", value)
}

// eachFailed is the answer of a run whose function ended the transaction
// itself (and its work committed, may have, or was rolled back, after
// which its later statements, a library's transactions, ran on their
// own), or may have (err): as a batch error this would be split and its
// halves run again, committing their work a second time. Each message
// fails on its own instead (Permanent, or the store's unavailability:
// never run again in place), its record not completed.
func eachFailed(n int, err error) []amqpidem.BatchResult {
	rs := make([]amqpidem.BatchResult, n)
	for i := range rs {
		rs[i].Err = err
	}
	return rs
}

// finishBatch completes the records of leases[i], for i in done, with
// values[i] in the transaction open on conn and commits it, in one round
// trip: the guard (txGuardSQL: the transaction open is fn's), the
// settings of its statement (set_config, for the transaction),
// the statement (finishBatchSQL: one UPDATE for the records still held,
// finish_tx for the others, which raises leaseLostCode where a lease is no
// longer held, aborting the transaction) and the COMMIT, which the server
// skips once it was aborted.
func (s *Store) finishBatch(ctx context.Context, conn *pgx.Conn, xid string, leases []lock.Lease, values [][]byte, done []int) error {
	keys := keyBytes(len(done), func(j int) string { return leases[done[j]].Key })
	owners := make([]string, len(done))
	fences := make([]int64, len(done))
	vals := make([][]byte, len(done))
	rets := make([]int64, len(done))
	for j, i := range done {
		l := leases[i]
		owners[j], fences[j], vals[j], rets[j] = l.Owner, l.Fence, values[i], l.Retention.Milliseconds()
		if vals[j] == nil {
			vals[j] = []byte{} // NULL would not be a result
		}
	}
	b := &pgx.Batch{}
	// A generic plan of the statement, which a prepared statement gets
	// after five runs, guesses ten keys and pairs each record with each
	// key: a custom plan, made for the batch's arrays, costs a fifth of it.
	// And a row another transaction holds is waited for at most as long
	// as the functions wait (lockTimeout), not until commitTimeout.
	b.Queue(txGuardSQL, xid)
	b.Queue("SELECT set_config('plan_cache_mode', 'force_custom_plan', true), set_config('lock_timeout', '" + lockTimeout + "', true)")
	b.Queue(s.sql.finishBatch, s.cfg.Prefix, byteaArray(keys), textArray(owners), int8Array(fences), byteaArray(vals), int8Array(rets))
	b.Queue("COMMIT")
	br := conn.SendBatch(ctx, b)
	_, gerr := br.Exec()
	_, serr := br.Exec()
	_, ferr := br.Exec()
	tag, cerr := br.Exec()
	ferr = cmp.Or(gerr, serr, ferr)
	err := cmp.Or(ferr, cerr, br.Close())
	var pe *pgconn.PgError
	switch {
	case isTxGuard(gerr):
		return errTxRolledBack
	case ferr != nil && errors.As(ferr, &pe) && pe.Code == leaseLostCode:
		return fmt.Errorf("%w: complete batch of %d: %s", lock.ErrLeaseLost, len(done), pe.Message)
	case ferr != nil && errors.As(ferr, &pe):
		// The server refused the completion: the COMMIT was skipped,
		// nothing committed.
		return fmt.Errorf("pgstore: complete batch of %d: %w", len(done), classify(ferr))
	case err != nil:
		// Whatever the error, the COMMIT may have landed: said as
		// lock.ErrUnavailable, so that the batch is not run again.
		return fmt.Errorf("%w: pgstore: commit of a batch of %d (its outcome may be unknown: the records tell): %w",
			lock.ErrUnavailable, len(done), classify(err))
	case tag.String() != "COMMIT":
		return fmt.Errorf("pgstore: commit of a batch of %d answered %q: nothing committed", len(done), tag.String())
	}
	return lostAnswer()
}

var _ lock.BatchAcquirer = (*Store)(nil)

// AcquireBatch takes the leases of reqs (lock.BatchAcquirer) with one
// statement, in key order (so that two batches with keys in common do not
// deadlock), in one round trip and one autocommit transaction: each answer
// is Acquire's. Keys without a record get their leases from one INSERT;
// the others, from the acquire function, one call each (see
// acquireBatchSQL). A key
// that comes twice in reqs is taken for its first request and then asked
// again with Acquire, which answers the second InProgress. The statement
// is not retried: if it fails, every request gets its error (wrapping
// lock.ErrUnavailable when the server may not have answered), and a
// lease it may have taken blocks its key for its TTL.
func (s *Store) AcquireBatch(ctx context.Context, reqs []lock.Request) ([]lock.Result, []error) {
	ctx, cancel := bounded(ctx)
	defer cancel()
	results := make([]lock.Result, len(reqs))
	errs := make([]error, len(reqs))
	start := s.cfg.Now()
	var order, again []int
	seen := make(map[string]bool, len(reqs))
	for i := range reqs {
		req, err := s.cfg.CheckRequest(reqs[i])
		switch {
		case err != nil:
			errs[i] = err
			continue
		case seen[req.Key]:
			again = append(again, i)
		default:
			seen[req.Key] = true
			order = append(order, i)
		}
		reqs[i] = req
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(reqs[a].Key, reqs[b].Key) })
	keys := keyBytes(len(order), func(j int) string { return reqs[order[j]].Key })
	owners := newOwners(len(order))
	ttls := make([]int64, len(order))
	rets := make([]int64, len(order))
	fps := make([][]byte, len(order))
	for j, i := range order {
		r := reqs[i]
		ttls[j], rets[j], fps[j] = r.TTL.Milliseconds(), r.Retention.Milliseconds(), []byte(r.Fingerprint)
	}
	if len(order) > 0 {
		rows, err := s.pool.Query(ctx, s.sql.acquireBatch, s.cfg.Prefix, byteaArray(keys), textArray(owners), int8Array(ttls), int8Array(rets), byteaArray(fps))
		j := 0
		if err == nil {
			// Scanned into once for every row, not a new set of
			// variables each (each would be an allocation): pgx makes
			// a new value slice for every row.
			var status, attempts int
			var fence, remaining int64
			var value []byte
			for rows.Next() && j < len(order) {
				if err = rows.Scan(&status, &fence, &attempts, &remaining, &value); err != nil {
					break
				}
				i := order[j]
				results[i], errs[i] = s.result(reqs[i], status, fence, attempts, remaining, value, owners[j], start)
				j++
			}
			rows.Close()
			err = cmp.Or(err, rows.Err())
			if err == nil && j != len(order) {
				err = fmt.Errorf("pgstore: acquire batch answered %d rows for %d keys", j, len(order))
			}
		}
		if err != nil {
			err = fmt.Errorf("pgstore: acquire batch of %d: %w", len(order), classify(err))
			for _, i := range order {
				results[i], errs[i] = lock.Result{}, err
			}
		}
	}
	for _, i := range again {
		results[i], errs[i] = s.Acquire(ctx, reqs[i])
	}
	return results, errs
}
