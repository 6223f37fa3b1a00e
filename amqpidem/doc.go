// Package amqpidem makes RabbitMQ consumers idempotent: the handler for a
// message runs once per idempotency key, however often the broker delivers
// it, and every delivery is settled without loss.
//
// Two ways in: Wrap, for a delivery loop you keep (its Handle method takes
// an amqp.Delivery and does everything, acks included), and Consumer,
// which runs the loop for you (prefetch, bounded concurrency, reconnection,
// graceful Shutdown).
//
// # Connections
//
// A Consumer opens two connections with ConsumerConfig.Dial: one to
// consume on (acks go there) and one to publish its copies on (delayed
// requeues, dead letters, replies), as RabbitMQ advises, since a broker
// that blocks publishers (a memory or disk alarm) blocks the whole
// connection; connection.blocked is logged. Dialling, to consume or to
// publish a copy, is given up when the Consumer stops, and a copy waits
// for the publishing connection no longer than its settle timeout: a
// broker that accepts connections and never answers holds up neither
// Shutdown nor Run's context. After the consuming connection is lost, Run
// reconnects at once: handlers already running finish and
// store their outcome, their ack fails with the dead channel, and the
// broker's redelivery is acked as a duplicate (or requeued as busy while
// the lease is held); deliveries of the dead channel whose handler had not
// started are not run. Errors no retry can mend (wrong credentials, a
// missing vhost, a queue declared with other arguments, a missing queue)
// end Run with an error that says what to fix. A Wrapper publishes on the
// ChannelOpener given to Wrap: give it a connection of its own too.
//
// amqp091-go's automatic recovery (amqp.Config.Recovery) is refused, on
// every connection amqpidem consumes or publishes on (ErrAutoRecovery: a
// Dial that returns such a connection ends Run, Wrap refuses one): it
// rebuilds a connection under the same channels, whose delivery tags then
// start again at 1 while acks of the old deliveries are on their way, so
// that such an ack would settle a new delivery whose handler still runs,
// and a crash would lose it. Reconnecting is the Consumer's job; a loop
// around a Wrapper must not consume on a recovering connection either.
//
// # A delivery's way through
//
// Every delivery, whether Handle or a Consumer's worker took it, goes the
// same four steps:
//
//  1. Arrival: amqpidem's headers are read once, under the rules of
//     "Headers a publisher can forge" below; a Consumer's
//     delivery waits for its turn at the gate (Concurrency, in delivery
//     order); its key is taken (Config.Key) and the store looked up
//     (Acquire): one store call. A handler that is a LeaseTaker
//     (pgstore's TxHandler) takes the lease itself instead, in the
//     transaction its work then runs in.
//  2. The store's answer decides, row by row of the table below:
//     duplicate, busy, conflict, failed, expired or pending, or run.
//  3. Run: the heartbeat keeps the lease while the handler runs; then
//     the outcome is stored (Complete, or a Completer's own transaction)
//     or the failure judged: lease lost, stale fence, retry with
//     backoff, or a terminal failure (Fail).
//  4. Settlement, exactly one of: ack (after the reply, if the message
//     has a ReplyTo), requeue (a copy confirmed by the broker, then an
//     ack), dead letter (a copy confirmed by the broker, then an ack),
//     and, only when no copy can be published at all, a nack with
//     requeue.
//
// # What happens to a delivery
//
//	what happened                          broker                                  record
//	new key, handler succeeded             ack after the record is completed       completed, result stored
//	handler staged messages (Stage),       each published, confirmed, after the    completed with them; then
//	succeeded                              record is completed; then ack           marked published
//	duplicate of completed work            ack; stored reply re-sent, only to the  unchanged
//	                                       ReplyTo it was made for
//	duplicate of completed work whose      the rest published (same MessageIds),   marked published
//	staged messages were not all           then ack; busy while the execution
//	published                              that stored them may still publish them
//	staged message refused by the broker   requeued, tried again; given up after   marked returned
//	(IsRefused: returned, or its channel   MaxAttempts tries (logged), then ack
//	closed by the broker over it)          as OutboxGivenUp
//	staged message's publish failed on     requeued after UnavailableDelay, not    unchanged
//	the way (connection or confirm lost)   a try: published again, never given up
//	another consumer holds a live lease    delayed requeue: 0.25 s, doubled at     unchanged
//	                                       each look, never past that lease's
//	                                       expiry or InProgressDelay
//	retryable failure, HandlerTimeout      delayed requeue after RetryAfter's      lease released, attempts kept
//	                                       delay, else RetryDelay's, else
//	                                       Backoff's
//	handler returned ErrStale              short requeue, not an attempt           lease given up, attempt taken back
//	permanent failure, attempts exhausted, dead letter with fault headers          failed, error stored
//	result too large for the store
//	duplicate of failed work               dead letter (or ack, by policy)         unchanged
//	same key, different payload            dead letter, reason "key conflict"      unchanged
//	no key                                 dead letter (or run unkeyed, by policy) none
//	invalid key (too long, KeyFunc or      dead letter, never run unkeyed          none
//	Fingerprint panic)
//	expired (HeaderExpiresAt passed)       dead letter, reason "expired"           none
//	lease lost while running               ctx cancelled, result discarded,        untouched
//	                                       delayed requeue
//	store unavailable                      delayed requeue (or run, FailOpen)      none
//	a store call that settles panicked     as store unavailable (not tried again)  untouched; the lease expires
//	(Complete, Fail, Amend)
//	the key's record unusable              delayed requeue, dead letter after      untouched
//	(wrong type, unknown format), or the   MaxAttempts tries; never run
//	lookup panicked (AcquireLease)
//	headers so near frame_max that a copy  dead letter: the largest headers        as the row it is in says
//	with amqpidem's would not fit          dropped to fit, HeaderHeadersDropped
//	                                       says which; a requeue is held for its
//	                                       delay here, then nacked (headers kept)
//	shutdown while running                 ctx cancelled, copy back to the queue   lease released
//	shutdown before the handler started    copy back to the queue                  none, or lease given up, attempt taken back
//
// # Batches
//
// NewBatchConsumer runs a BatchHandler on batches of new deliveries (up to
// ConsumerConfig.BatchSize, gathered for at most BatchWait); every
// delivery's key, fingerprint and lease are taken first, and duplicates,
// conflicts, busy and failed keys are settled on their own, as in the
// table above: the handler gets new deliveries only, answers per message
// (BatchResult), and each message is settled as a single one would be. A
// batch's error or panic splits it in halves, run again, down to single
// messages, so that one poison message costs its neighbours reruns, not
// attempts. With pgstore's BatchTxHandler the handler's writes and the
// batch's records commit in one transaction (a lease lost by any member:
// nothing of it commits). Stage and FromContext work on the context of
// one message of the batch, DeliveryContext(ctx, d): its staged messages
// are stored with its own record, with the batch's commit. WrapBatch is
// Wrap's batch form, for a delivery loop of one's own that calls Handle
// from a goroutine per delivery; see docs/batches.md in the repository
// for the table of a batch's failures and the limits.
//
// # The outbox
//
// Stage adds a message to the handler execution's outbox: it is stored
// with the handler's outcome, in the same write (a Completer's
// transaction included), and published, confirmed, after it and before
// the ack; a copy of the message that finds messages stored but not
// published publishes them, with the same MessageIds. So nothing staged is
// published for work whose outcome was not stored, and every staged
// message is published at least once after it was, with one MessageId
// however often: exactly once for an amqpidem consumer downstream, which
// is where exactly-once reaches across a chain of services. The record
// marks each confirmed message (lock.Amender), so later duplicates publish
// nothing; StoredOutbox reads them. See Stage, and docs/outbox.md in the
// repository.
//
// # Records belong to an endpoint
//
// A message's record is kept under StoreKey(Config.Endpoint, key), and
// Endpoint defaults to the queue: each queue is its own inbox, as
// MassTransit and NServiceBus scope theirs. An event fanned out to two
// queues runs once on each, even when both consumers share one store; a
// publisher to one queue cannot pre-complete, fail or conflict the message
// ids of another. Consumers that must share one inbox across queues set
// the same Endpoint, knowingly: then a key runs on whichever queue takes it
// first and is a duplicate on the others.
//
// A stored result carries a digest of the ReplyTo its reply went to
// (ResultOverhead bytes), and a duplicate's reply is re-sent only to that
// same ReplyTo: a message that reuses an id cannot have someone else's
// result sent where it chooses. The ReplyTo itself, though, is the
// publisher's to choose, as in any AMQP RPC: amqpidem publishes a reply to
// whatever queue a message names, through the default exchange, with the
// consumer's credentials. A publisher allowed on the consumer's queue can
// so have results delivered to any queue the consumer's user may write
// to. Limit that user's write permission (RabbitMQ's per-vhost "write"
// pattern) to the reply queues, or check d.ReplyTo in the handler and
// return a Permanent error for one you do not serve.
//
// A delayed requeue publishes a copy (properties, headers and body kept;
// the attempt count in HeaderAttempt), confirmed and with mandatory set,
// to a delay queue whose queue-level TTL dead-letters it back to the queue;
// one queue per delay tier, so a short delay never waits behind a long
// one, and each deletes itself when unused. Only then is the original
// acked. No plugin is needed, and because the original is acked and a new
// message published, requeues do not count against a quorum queue's
// delivery limit.
//
// On a quorum work queue (Config.QueueType "quorum") the delay queues are
// quorum queues "<queue>.delayq.<ms>" with at-least-once dead-lettering
// (RabbitMQ 3.10 or later): the copy is replicated while it waits and
// stays in the delay queue until the work queue has confirmed it. On a
// classic work queue they are classic queues "<queue>.delay.<ms>", and
// classic dead-lettering is at-most-once: the delay queue is not
// replicated and the broker does not wait for the work queue to take the
// copy, so a broker crash while a copy waits, or a failure on its way back
// (the work queue unavailable or rejecting publishes), can lose it after
// the original was acked. Use a quorum work queue when that matters.
// Classic delay queues delete themselves when unused (after twice the
// delay plus a minute). Quorum delay queues do not expire: an expiring
// queue is deleted with the copies in it, and RabbitMQ after 3.10 does
// not renew a quorum queue's expiry on re-declaration. They stay, empty
// when unused, one per delay tier (at most 90 per decade of delays);
// delete unused ones at will, amqpidem declares them again when needed (a
// copy returned unroutable from a delay queue deleted since it was
// declared declares it again, and is published once more).
//
// That safety is the broker's: on a three-node cluster running RabbitMQ
// 3.10.8, killing or cutting off the node that leads a quorum delay queue
// left its copies stuck in it, never dead-lettered back (chaos scenarios
// 13 and 14; docs/scale.md). Config.DelayInProcess avoids
// delay queues altogether: the consumer holds the delivery, unacked, for
// the delay and then publishes the copy straight back, at the cost of
// prefetch held by waiting deliveries.
//
// A message published with an expiration (per-message TTL) keeps it
// across requeues: the first copy records the deadline in
// HeaderExpiresAt, copies carry no expiration property (the broker would
// drop an expired copy silently), and a delivery past its deadline that
// would run is dead-lettered with reason "expired" instead, never dropped
// (a duplicate of completed work is still acked as one). Dead
// letters carry no expiration either; the original value is in
// HeaderOriginalExpiration.
//
// Dead letters go to "<queue>.dlq" (declared on demand) or a configured
// exchange, with HeaderReason, HeaderError, HeaderAttempt, HeaderFirstSeen,
// HeaderConsumer, HeaderKey and the original exchange and routing key,
// confirmed before the original is acked. A dead letter the broker cannot
// route is requeued with HeaderDeadLetterPending and tried again after
// UnavailableDelay: it is never dropped. So is a message whose failure
// could not be stored for sure (Fail is tried for up to 10 s): when the
// copy comes back it is dead-lettered, whatever FailedDuplicate says, and
// if the failure was not stored after all, it is stored then, without
// running the handler again.
//
// A result whose reply cannot be sent is requeued so that its redelivery,
// a duplicate, sends the stored reply; after MaxAttempts tries
// (HeaderReplyTries) the reply is given up, logged, and the message acked.
//
// A copy that cannot be published (a delay queue that exists with other
// arguments, a broker refusing publishes) does not spin: the message is
// held for its delay (at most UnavailableDelay), then sent straight back
// to the queue, and nacked with requeue only if that fails too.
//
// # Headers a publisher can forge
//
// The headers amqpidem writes can also come from a publisher. None of them
// can make a message run more often than its record allows. HeaderAttempt
// counts with the record (the higher count wins, so that a lost record
// does not restart the retries) but is read as at most MaxAttempts, and a
// negative or non-integer value as 0: a forged value can bring a dead
// letter closer, never postpone one. A dead letter moved back to its
// queue (it carries HeaderError) starts its count afresh, so that it runs
// once its record has expired or been removed. HeaderDeadLetterPending,
// present with any value, only brings a dead letter closer too: a
// duplicate of failed work is dead-lettered instead of dropped, with the
// record's reason, and a key that is free is failed and dead-lettered
// without running. HeaderExpiresAt (an integer of any AMQP type) can only
// bring an "expired" dead letter closer. HeaderReplyTries is read as at
// most MaxAttempts. HeaderOriginalExchange, HeaderOriginalRoutingKey and
// HeaderUserID are informational: the consumer decides nothing from them,
// and copies carry them only when they are short strings (255 bytes at
// most).
//
// An operator's tool does act on headers: `amqpidem dlq replay --forget`
// deletes the record HeaderEndpoint and HeaderKey name, and
// --to-original-exchange publishes where HeaderOriginalExchange and
// HeaderOriginalRoutingKey say. A message can reach a dead-letter queue
// with headers its publisher chose (dead-lettered by the broker, or
// published there), so with Config.SigningKey every copy a consumer
// publishes carries HeaderSignature, an HMAC of those headers and the
// body (VerifySignature), and the CLI acts on them only when it verifies
// under the same key, or with --trust-headers. Original exchange and
// routing key are then carried from a delivery only when its signature
// verifies. Config.ReplyTo limits where replies go. docs/security.md
// has the threat model.
//
// A publisher can also send headers so near the connection's frame_max
// that no copy with amqpidem's headers added fits in a frame (the broker
// would close the connection over it). Such a copy is never published
// (ErrTooLarge): a dead letter drops the delivery's headers, the largest
// first, never amqpidem's own, until it fits, and says which in
// HeaderHeadersDropped, the Event's Err and an error log line, its body
// whole; a requeue is held in the process for its delay and nacked back,
// headers intact, so that its retries run (a quorum queue counts each
// nack against its delivery limit) and it is dead-lettered so once they
// are exhausted. Such a message is never lost silently, and never loops.
//
// # Observing it
//
// Config.Observer is told of every processed delivery (an Event: outcome,
// reason, attempt, fence, durations); one that is also a HandlerObserver is
// told when handlers start and return, and one that is also a
// StoreObserver of every store call, the heartbeat's renewals included.
// Config.Tracer follows each delivery from before its record is read to
// its settlement: the handler's context, the messages it stages and the
// copies amqpidem publishes (requeues, dead letters, replies) carry what
// it starts; one that is also a PublishTracer follows each of those
// publishes too. Packages
// promamqpidem and otelamqpidem implement them for Prometheus and
// OpenTelemetry, in packages of their own so that only their users get
// those dependencies. Consumer.Ready is a readiness check: consuming, and
// the store answering. The command cmd/amqpidem reads and forgets records
// (lock.Admin) and lists and replays dead letters.
//
// # Guarantees and where exactly-once ends
//
// The handler runs at most once at a time per key and endpoint (while
// leases hold; see package lock), and a completed key never runs again
// within the retention window, as long as the store keeps its record. The
// broker's at-least-once delivery is absorbed: duplicates are acked without
// running.
//
// A record the store lost (Redis restarted without persistence, a failover
// to a replica that had not received it, eviction, a Retention shorter than
// the time the message spends in queues) is forgotten work: the next
// delivery runs the handler again. Fences stay higher than the lost
// record's (they come from the server's clock, see package lock), so a
// fenced sink still refuses the old holder; attempts keep counting through
// HeaderAttempt, so MaxAttempts still ends the retries.
//
// Exactly-once ends at the handler's side effects. If a process dies after
// the side effect and before the outcome is stored, the next delivery takes
// the expired lease over and runs the handler again. The handler's context
// carries the key, the attempt and the fencing token (FromContext). A sink
// that records the key with the effect (a unique constraint) absorbs that
// re-execution. The fence guards against something else: a lease is not a
// mutex, and a paused process can outlive its lease and write late; a sink
// that keeps the highest fence per key and refuses lower ones rejects those
// stale writes; the handler then returns ErrStale, and amqpidem discards
// that execution without counting it. (The re-execution after a crash carries a higher fence, so
// the fence alone does not absorb it.) A Completer (pgstore's TxHandler)
// closes the window for effects in the store's own database: it writes
// them in the transaction that completes the record, so both commit or
// neither does, and a re-execution finds nothing of the first. The
// handler's context is cancelled
// when the lease is lost or cannot be confirmed; cancellation is
// cooperative: a handler that ignores its context runs on, and its result
// is then refused by the store.
//
// Messages returned to the queue by amqpidem (requeues, shutdown) are
// copies published with confirms, and the original is acked: a quorum queue
// does not count them against its delivery limit. Only when no copy can be
// published is the original nacked with requeue.
//
// Completion is compare-and-set on the lease: a result is stored only if
// nobody took the lease over meanwhile. If the keeper merely could not
// confirm the lease (Redis slow) but nobody took it over, a handler that
// finished anyway still has its result stored.
//
// Acks can fail after the outcome is stored (the channel died): the broker
// redelivers and the delivery is then a duplicate. Copies published before
// a failed ack make duplicates too, never losses.
package amqpidem
