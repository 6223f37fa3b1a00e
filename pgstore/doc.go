// Package pgstore keeps amqpidem's idempotency records in PostgreSQL, and
// lets a handler write its effects in the same transaction that completes
// the record: for effects that live in that database, a message then takes
// effect exactly once, crashes included.
//
//	pool, _ := pgxpool.New(ctx, "postgres://app@db/payments?pool_max_conns=12") // > Concurrency
//	_ = pgstore.Migrate(ctx, pool, pgstore.Config{})   // once; or apply pgstore.MigrationSQL
//	store, _ := pgstore.New(pool, pgstore.Config{})
//	defer store.Close()
//	h := store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
//		_, err := tx.Exec(ctx, "INSERT INTO payments (id, amount) VALUES ($1, $2)", d.MessageId, 100)
//		return nil, err
//	})
//	c, _ := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{...}, h)
//
// # Guarantees
//
// Store is a lock.Store with the Redis store's state machine, answers and
// limits; it passes the same conformance suite (internal/storetest). It
// also implements lock.Admin, for operators' tools: Inspect reads a record
// by key (its Location names the table, namespace and key of the row), and
// Forget deletes it compare-and-delete on the state and fence Inspect saw,
// each in one statement. And it implements lock.Amender, for amqpidem's
// outbox: Amend changes the value of a completed record, compare-and-set
// on its fence and value, and nothing else.
//
//   - Atomic: each call is one statement. Acquire is a PL/pgSQL function
//     that reads the record and writes it only by compare-and-set on the
//     row as read (reading again when another statement changed it
//     first); Complete, Fail, Release and Cancel lock the row and check
//     owner and fence; Amend is one UPDATE of the value column of a
//     completed row whose fence and value are the ones the caller saw
//     (expires_at and every other column unchanged); Extend renews all
//     of a heartbeat's leases in one UPDATE, skipping a row another
//     transaction holds (that lease is reported unconfirmed,
//     lock.ErrUnavailable, not lost). A call that waits for a row more
//     than 2 s (lock_timeout: a transaction stuck in COMMIT holds it)
//     fails as lock.ErrUnavailable rather than wait on.
//   - Expiry by the database's clock (clock_timestamp()), never the
//     client's; the client's clock only estimates Lease.Deadline
//     conservatively.
//   - Fencing: each new lease's fence is the higher of the last fence + 1
//     and the database clock in microseconds, read by the statement that
//     writes it, so fences strictly increase per key, across a record
//     deleted after its retention too, as long as the database clock does
//     not step back past the deleted record's last fence. (Cleanup keeps an
//     expired record a minute longer, so that even an Acquire stalled
//     between reading the clock and inserting cannot go below it.)
//   - Retry-safe: Acquire retries a lost answer with the same owner token
//     (up to 3 times, about 350 ms) and gets the same lease back; a
//     retried Complete, Fail, Release or Cancel that finds its own write
//     answers nil, and so does a retried Amend that finds its value.
//   - Bounded: keys (any bytes, up to lock.MaxKeyLen), fingerprints and
//     results are limited as in package lock. Every record expires
//     Retention after its last change (TTL + Retention while a lease is
//     held); an expired record is treated as absent at once, and deleted
//     (a minute later) by Cleanup, which the Store runs every
//     CleanupInterval in batches of CleanupBatch rows found through the
//     index on expires_at, with FOR UPDATE SKIP LOCKED: short statements,
//     no long locks, safe from many processes at once.
//   - Names: the functions run with the search_path of the migration, so
//     a handler that sets its own search_path cannot send the completion
//     to another table. With an empty Config.Schema, the Store calls them
//     by their unqualified names: a handler's search_path must still
//     include their schema (or set Config.Schema).
//   - Errors: lock.ErrUnavailable when the database could not answer
//     (connection errors, shutdown, too many connections, a serialization
//     failure or deadlock, a read-only standby, and a missing table or
//     function, whose error says to run Migrate); lock.ErrLeaseLost when
//     the lease is no longer held; lock.ErrChanged when Amend finds no
//     completed record with the fence and value it was given. A call
//     whose context has no sooner deadline (Check, Acquire, Extend,
//     Complete, Release, Fail, Cancel, Amend, Inspect, Forget,
//     AcquireBatch, a TxHandler's acquire) gives up after 10 s with
//     lock.ErrUnavailable: a database that accepts connections and never
//     answers does not hang the consumer silently.
//
// # The transactional handler
//
// TxHandler runs the handler's function in a transaction and, in the same
// transaction, writes the completed record (compare-and-set on the lease),
// then commits. The completion locks the record's row, so a consumer that
// would take the key over waits for the commit and then finds the record
// completed. So:
//
//   - a crash or a lost connection before the commit rolls back the
//     effects and leaves the lease, which expires: the next delivery runs
//     the work again, once;
//   - a holder that lost its lease (paused past it, say) cannot commit: its
//     completion finds another owner, and its effects roll back;
//   - a commit whose outcome is unknown is requeued, and the redelivery
//     reads the record: completed (a duplicate, acked) or not (it runs
//     again, since the effects rolled back with it).
//
// The completion and the COMMIT go to the server together, in one round
// trip: the completion raises (SQLSTATE AQ001) where the lease is no
// longer held, so that the server skips the COMMIT sent after it and the
// transaction rolls back. A database migrated by an earlier release lacks
// the functions TxHandler uses: its completion fails as unavailable
// (nothing commits; the message waits) and Check says to run Migrate.
//
// # Leases held by transactions
//
// A lease is a record row with a deadline, renewed by package heartbeat
// (one UPDATE per tick for all of a consumer's leases), for every handler
// form: that is what Acquire takes. TxHandler takes the lease of a first
// delivery (a message not redelivered by the broker) differently, because
// its transaction will be open anyway: in one round trip it begins the
// handler's transaction, takes the key's advisory lock unless a live
// record is there (pg_try_advisory_xact_lock and pg_try_advisory_lock:
// the same lock at transaction and at session level), reads the record by
// a statement of its own (another holder may have finished just before
// the lock), and sets the SAVEPOINT the handler's work begins at. The lock
// is the lease; nothing is written until the outcome, a plain INSERT of
// the record in the same transaction as the handler's effects, sent with
// the release of the session-level lock and the COMMIT (the
// transaction-level lock lasts until the record is visible). A new message
// then costs one commit instead of two, three round trips instead of four,
// no PL/pgSQL, and 5 WAL records of about 410 bytes instead of 10 of about
// 800. These statements name the table in full (in the schema of
// <Table>_held_key, the key of the lock, asked of the server once), so
// that a handler's SET search_path cannot move them.
//
//   - A duplicate is answered at once: the advisory lock is tried, never
//     waited for (busy: requeued with InProgressDelay), and Acquire tries
//     it too, so a record-row lease and a held one exclude each other.
//     A completed or failed record is answered as with Acquire.
//   - A holder that leaves its transaction idle loses its lease: the
//     transaction's idle_in_transaction_session_timeout is the lease's
//     TTL (at most 2^31-1 ms; a longer lease is a record row), after which
//     the server ends its session, and the transaction and the lock with
//     it; its work, resumed, commits nothing. The heartbeat's Extend asks
//     the server (pg_locks) whether the holder's backend still holds the
//     lock, and cancels the handler's context with lock.ErrLeaseLost once
//     it does not, as for a record-row lease taken over. A handler that
//     keeps its transaction idle longer than the TTL (a slow call
//     elsewhere in the middle of it) loses its session the same way: the
//     attempt is then recorded (released, one attempt), and its retry
//     takes a record-row lease, which the heartbeat renews. A holder that
//     vanishes in the middle of a statement, or whose COMMIT waits for a
//     synchronous standby, is not idle: it keeps the lock until the server
//     notices (TCP keepalives).
//   - That recorded attempt is written late, after the session ended, by
//     a holder that can no longer tell whether another lease came and
//     went meanwhile: it is written whenever the key is free and has no
//     live record. So when a later lease was cancelled (or its session
//     ended too) before it, the record is the earlier holder's outcome,
//     with a lower fence than the later lease's; when a later lease
//     completed and its record was forgotten, the earlier holder's record
//     comes back. Its work rolled back with its session, so no effect is
//     duplicated; what can be off is the outcome recorded (a failure or a
//     release of an older attempt). This is not linearizable
//     (test/linearizable's pgstore-held-late-write shows it), and kept:
//     without it, a handler that outlives its session every time would
//     never have its attempts counted nor reach MaxAttempts.
//   - A handler that ends the transaction itself (see "Writing a
//     TxHandler") keeps the key: the session-level lock outlives its
//     COMMIT, and the record is written on the same session before the
//     lock is released. But that session is then idle outside a
//     transaction, which no server timeout ends: a holder paused after its
//     own COMMIT keeps the key busy until it resumes or its connection
//     closes.
//   - An execution is counted when its outcome is written, not before it
//     starts: an attempt that crashes the consumer on a first delivery is
//     not counted. Its redelivery is marked redelivered by the broker, and
//     a redelivered message, or a key whose record counts attempts
//     (released, cancelled, or a lease that expired), takes a record-row
//     lease, counted before the handler runs: a message that crashes its
//     consumer reaches Config.MaxAttempts one execution later than with
//     record-row leases only.
//   - Fences come from the same clock as Acquire's, above any earlier
//     record's; the handler's amqpidem.FromContext gives the lease's fence
//     as usual.
//   - The lease holds a pooled connection from the acquire to the commit,
//     as the handler's transaction did already; a failed handler's
//     outcome (release, failure) is written after a rollback to the
//     savepoint, under the same lock, and committed with it.
//   - Behind a pooler in transaction mode (PgBouncer's pool_mode =
//     transaction, say), both locks are released while the transaction is
//     open, on the server session that took them; only a handler that ends
//     the transaction itself makes the release come after it, possibly on
//     another server session, leaving the lock held (the key busy) until
//     the first one closes. Handlers that pass tx.Conn() to code that
//     commits need a direct connection, a pooler in session mode, or
//     Config.RowLeases.
//
// Only under READ COMMITTED (Config.TxOptions, and the server's default
// when it sets no level): under a higher level, the acquire's snapshot may
// be older than the lock and miss a lease committed just before, so
// TxHandler takes record-row leases. While a lease is held this way, the
// key has no record: Inspect finds none. A key whose record is past its
// retention but not yet deleted takes a record-row lease (which replaces
// it). On a database not migrated by this release (no
// <Table>_held_key), TxHandler takes record-row leases, and looks again
// a minute later. Never run an earlier release's Migrate after this
// one's: its acquire would not see leases held by transactions (effects in
// this database would still commit once, but two handlers could run at
// once). Config.RowLeases turns leases held by transactions off: every
// lease is a record row, as for the other handler forms.
//
// # Lease batches held by a session
//
// BatchTxHandler takes a batch consumer's leases the same way
// (amqpidem.BatchLeaseTaker), for a lease batch at once: in one round
// trip on one pooled connection, it begins the transaction the batch
// will run in, takes the session-level advisory lock of each key with no
// live record (the lock of a single held lease, so the three kinds of
// lease exclude each other), reads the keys' records by a statement of
// its own, and sets the handler's savepoint. Keys not acquired (busy,
// duplicates) are unlocked in one more round trip, in that transaction.
// The batch's records are written once, completed, by one INSERT sent
// with the COMMIT, which takes each key's transaction-level lock and
// releases its session-level one: a batch of new keys then costs one
// commit and two round trips, where record-row leases cost two and three
// (BenchmarkBatchCommits). What is said above of a held lease holds for
// each, with these differences:
//
//   - The locks are the session's, not a transaction's: a run that fails
//     (a batch error, which amqpidem answers by running the halves again,
//     or messages that failed, which BatchTxHandler answers by running
//     the rest again) rolls back and the next run begins another
//     transaction on the same session, the keys still held. While the
//     session holds a lock of the batch it is kept in a transaction (one
//     is begun again after each run that leaves leases of the batch),
//     whose idle_in_transaction_session_timeout is the leases' TTL: a
//     holder paused (SIGSTOP) or cut off loses its session, and every
//     lease of the batch with it, as a single held lease does; a holder
//     killed commits nothing, and its locks end with its session.
//   - A lease of the batch ended without its record committed by the
//     batch (released, failed, cancelled, its message settled some other
//     way) writes its outcome, when there is one, with finish_held in
//     the session's open transaction and commits it, releasing its key;
//     once every lease of the batch ended, the connection goes back to
//     the pool with no lock (any left is released first), or is closed
//     when it cannot be made clean.
//   - A commit that failed after the INSERT ran (the server refused the
//     COMMIT: a deferred constraint, say) may have released the keys'
//     session-level locks: the leases of its messages count as lost, and
//     a rerun answers them lock.ErrLeaseLost.
//   - A run batch may hold messages of several lease batches (and of
//     record-row leases): each lease batch runs on its own session, in a
//     transaction of its own, and the record-row leases in one of a
//     pooled connection, one commit each. When the first part fails as
//     a batch, the whole run fails (amqpidem splits it); a later part
//     that fails as a batch is split in halves by BatchTxHandler itself,
//     down to single messages, whose error is then their own (an earlier
//     part may have committed, and must not run again). amqpidem never
//     runs such a batch: a run batch of a BatchLeaseTaker holds the
//     leases of one lease batch, and AcquireLeaseBatch holds a lease
//     batch whole or makes it record rows whole. A caller of
//     HandleBatchComplete that mixes lease batches meets two more
//     limits: while one part runs longer than the TTL, a later part's
//     session idles in its transaction and the server ends it (its
//     messages answered lock.ErrUnavailable); and a part that committed
//     releases its keys, after which Extend answers its leases lost,
//     which cancels, with a heartbeat that cancels the batch on a lost
//     lease, the parts still running.
//   - The heartbeat's Extend asks, for all of a consumer's held leases
//     at once, whether their backends still hold their locks (one
//     statement per tick).
//   - The lease batch holds a pooled connection from its acquire until
//     every lease of it ended, not only while its batch runs: a lease
//     batch acquired while the pool has one connection free or none
//     takes record-row leases instead, so that the heartbeat and the
//     records written on the pool still find one. Redelivered messages,
//     keys whose records count attempts, an isolation level above READ
//     COMMITTED and Config.RowLeases take record-row leases
//     (AcquireBatch), as with TxHandler.
//
// # Writing a TxHandler
//
// The tx a TxFunc gets is a nested transaction of the one TxHandler
// commits with the record, as pgx's tx.Begin makes one: its statements run
// in that transaction, Commit keeps the work (it does not commit by
// itself), and Rollback undoes it; after either, tx's statements answer
// pgx.ErrTxClosed. So the idioms pgx users write out of habit are safe,
// and come to the same on a held lease and on a record-row one:
//
//	h := store.TxHandler(func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) ([]byte, error) {
//		defer tx.Rollback(ctx) // harmless after Commit
//		if _, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance - $1 WHERE id = $2", 100, 7); err != nil {
//			return nil, err // rolled back; retried or dead-lettered as the error says
//		}
//		return nil, tx.Commit(ctx) // committed by TxHandler, with the record, once
//	})
//
// What else a handler may do, and what it comes to:
//
//   - Savepoints of its own (tx.Begin, SAVEPOINT, ROLLBACK TO, RELEASE),
//     tx.LargeObjects, CopyFrom, SendBatch: as in any transaction.
//   - Roll its work back and return nil (a deferred tx.Rollback without
//     Commit, say): its work did not happen, so the message is not acked as
//     done: the error wraps ErrRolledBack, Permanent (dead-lettered). To
//     do nothing, return nil without calling Rollback.
//   - Return nil after a statement failed (its error swallowed, a unique
//     violation taken for "already done", say): the transaction is aborted
//     and nothing can commit: the error wraps pgx.ErrTxCommitRollback and
//     is retried. Use a savepoint (tx.Begin) around a statement that may
//     fail, or ON CONFLICT.
//   - End the transaction itself (a COMMIT or ROLLBACK statement, or a
//     library given tx.Conn() that begins and commits a transaction of its
//     own on it, since BEGIN inside a transaction does nothing): if it
//     committed and the handler returns nil, the record is completed after
//     it, on its own (the effect happens once, but the record no longer
//     commits with it: a crash in between runs it again); otherwise the
//     error wraps ErrTxEnded, Permanent, since what it did after that is
//     neither undone nor known. A ROLLBACK followed by a BEGIN is found at
//     the commit (its first statement checks that the open transaction is
//     the handler's, or that one committed): nothing commits, and the error
//     wraps ErrTxEnded too. Don't: pass tx to libraries, not tx.Conn().
//   - Keep the transaction idle longer than the lease (a slow call in the
//     middle of it): on a held lease the server ends the session, the
//     handler's context is cancelled, and its retry takes a record-row
//     lease. Slow work belongs before the first statement, or outside the
//     transaction (the plain handler form).
//
// internal/txtest in the repository runs each of these through a Consumer
// on both leases.
//
// A BatchTxFunc's tx is the same, for the whole batch: Commit once, after
// the last message (a Commit per message closes tx, and the next
// message's statements answer pgx.ErrTxClosed: the batch fails and is
// split). A savepoint per message (tx.Begin, then Rollback on its
// failure) keeps a failed message's writes out. A batch function that
// ended the transaction itself and committed (or the server could not say
// whether it did), then failed the batch or a message, has each such
// message fail on its own, Permanent, wrapping ErrTxEnded: its work
// committed, so it is never split nor run again. So does a message whose
// work a function (a TxFunc too) committed itself when its record could
// then not be completed (its lease lost, the store out of reach):
// released, the message would run again.
// pgstore's TestBatchTxHandlerIdioms runs each of these.
//
// # The producer outbox
//
// Outbox.Write stores a message in the caller's transaction, in the outbox
// table Migrate creates (Config.OutboxTable), and a Relay publishes the
// committed rows (mandatory, confirmed by the broker) and marks them sent
// after the confirm. So:
//
//   - a committed transaction's message is published at least once, a
//     rolled-back one's never; every publish of a row carries the same
//     MessageId (the caller's, or one Write generates and stores), so an
//     amqpidem consumer downstream runs it once;
//   - relays claim pending rows FOR UPDATE SKIP LOCKED, in id order, for
//     RelayConfig.ClaimTTL: several may run on one table, and a crashed
//     relay's rows go to the others once its claim ends (a paused one may
//     publish copies after that: duplicates, with one MessageId; so may
//     a relay killed between the broker's confirm and the row's mark, and
//     one whose confirm came back after RelayConfig.PublishTimeout);
//   - a claim the database does not answer within ClaimTTL less
//     PublishTimeout (a hung server, a lock held on the table) is given
//     up, logged and retried with backoff: its rows wait, never lost;
//   - rows committed late are not skipped: a claim looks for pending rows,
//     not past a high-water mark;
//   - with RelayConfig.Ordered, one Message.OrderKey's messages are
//     published one at a time, in the order their transactions committed:
//     Write numbers a key's messages from a counter row whose lock the
//     writing transaction holds until it ends, so the writers of one key
//     take turns from their Write to their commit;
//   - a message the broker refuses is retried with backoff and, after
//     RelayConfig.MaxAttempts refusals, kept dead for an operator (List,
//     Redrive), never dropped; a lost connection is not a refusal.
//
// docs/relay.md in the repository tells every case, the table and its cost.
//
// # Limits
//
// Exactly-once covers what the handler writes through tx, in this
// database, and the messages written with Outbox.Write in a transaction
// (published at least once, one MessageId each: exactly once for an
// amqpidem consumer). Anything else it does (an HTTP call, a message published, a
// write to another database) happens at least once, as with the Redis
// store: make it idempotent or fence it with amqpidem.FromContext(ctx).Fence.
//
// A TxHandler holds one pooled connection and an open transaction for as
// long as the handler runs (and, with a lease held by its transaction,
// from the acquire on). Size the pool above the number of handlers that
// can run at once (ConsumerConfig.Concurrency, over every consumer sharing
// it): leases are renewed through the same pool, and a pool whose every
// connection is held by a handler cannot renew them. The Store reports its
// pool's size (MaxConns, amqpidem.ConnPool), and amqpidem.NewConsumer
// refuses a TxHandler whose Concurrency is not below it
// (amqpidem.ErrPoolTooSmall); it cannot see other consumers sharing the
// pool. Long transactions
// hold back VACUUM on the whole database for their duration: keep
// handlers that run for minutes out of the transaction (the plain
// handler form works on this store too, with Complete in its own
// statement). Under REPEATABLE READ or SERIALIZABLE (Config.TxOptions), a
// handler on a record-row lease that runs longer than a heartbeat interval
// fails at its completion with a serialization failure, because the
// heartbeat changed the record after the transaction's snapshot: use READ
// COMMITTED (the default) for such handlers.
//
// A lease is not a mutex: the store refuses a stale holder's record
// writes, and TxHandler rolls its transactional effects back, but work a
// paused holder does outside the transaction is not undone.
//
// The records table is written on every message: plan for its write
// volume (one insert per unique message with a held lease, else an insert
// and one or two updates; an index on expires_at), and keep autovacuum
// on. A server where a statement can block on sending to a stalled client
// (a result larger than the socket buffers) does not count that time as
// idle: such a holder keeps its held lease until TCP gives up on it.
//
// For operators' tools the Store is a lock.Lister (List reads a bounded
// page of the primary key's index) and a lock.Counter (Count counts a
// prefix's records by state in one statement whose statement_timeout is
// the request's budget: its cost grows with the records counted, the
// budget bounds it).
package pgstore
