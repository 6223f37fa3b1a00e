// Package amqpidem makes RabbitMQ consumers idempotent: the handler for a
// message runs once per idempotency key, however often the broker delivers
// it, and every delivery is settled without loss.
//
// Two ways in: Wrap, for a delivery loop you keep (its Handle method takes
// an amqp.Delivery and does everything, acks included), and Consumer,
// which runs the loop for you (prefetch, bounded concurrency, reconnection,
// graceful Shutdown).
//
// # What happens to a delivery
//
//	what happened                          broker                                  record
//	new key, handler succeeded             ack after the record is completed       completed, result stored
//	duplicate of completed work            ack; stored reply re-sent to ReplyTo    unchanged
//	another consumer holds a live lease    delayed requeue (InProgressDelay)       unchanged
//	retryable failure                      delayed requeue after Backoff(attempt)  lease released, attempts kept
//	permanent failure, attempts exhausted  dead letter with fault headers          failed, error stored
//	duplicate of failed work               dead letter (or ack, by policy)         unchanged
//	same key, different payload            dead letter, reason "key conflict"      unchanged
//	no usable key                          dead letter (or run unkeyed, by policy) none
//	lease lost while running               ctx cancelled, result discarded,        untouched
//	                                       delayed requeue
//	store unavailable                      delayed requeue (or run, FailOpen)      none
//	shutdown while running                 ctx cancelled, copy back to the queue   lease released
//	shutdown before the handler started    copy back to the queue                  none, or lease given up, attempt taken back
//
// A delayed requeue publishes a copy (properties, headers and body kept;
// the attempt count in HeaderAttempt) to a delay queue "<queue>.delay.<ms>"
// whose queue-level TTL dead-letters it back to the queue; one queue per
// delay tier, so a short delay never waits behind a long one, and each
// deletes itself when unused. The copy is published with mandatory set and
// confirmed before the original is acked; if it cannot be published the
// original is nacked with requeue instead. No plugin is needed. Because the
// original is acked and a new message published, requeues do not count
// against a quorum queue's delivery limit.
//
// Dead letters go to "<queue>.dlq" (declared on demand) or a configured
// exchange, with HeaderReason, HeaderError, HeaderAttempt, HeaderFirstSeen,
// HeaderConsumer, HeaderKey and the original exchange and routing key,
// confirmed before the original is acked. A dead letter the broker cannot
// route is requeued with HeaderDeadLetterPending and tried again after
// UnavailableDelay: it is never dropped.
//
// # Guarantees and where exactly-once ends
//
// The handler runs at most once at a time per key (while leases hold; see
// package lock), and a completed key never runs again within the retention
// window. The broker's at-least-once delivery is absorbed: duplicates are
// acked without running.
//
// Exactly-once ends at the handler's side effects. If a process dies after
// the side effect and before the outcome is stored, the next delivery takes
// the expired lease over and runs the handler again. The handler's context
// carries the key, the attempt and the fencing token (FromContext). A sink
// that records the key with the effect (a unique constraint) absorbs that
// re-execution. The fence guards against something else: a lease is not a
// mutex, and a paused process can outlive its lease and write late; a sink
// that keeps the highest fence per key and refuses lower ones rejects those
// stale writes. (The re-execution after a crash carries a higher fence, so
// the fence alone does not absorb it.) The handler's context is cancelled
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
