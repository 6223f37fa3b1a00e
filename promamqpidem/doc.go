// Package promamqpidem exports what amqpidem's consumers do as Prometheus
// metrics: one Metrics is an amqpidem.Observer (with the HandlerObserver
// and StoreObserver hooks) and a prometheus.Collector.
//
//	m := promamqpidem.New(promamqpidem.Options{})
//	prometheus.MustRegister(m) // or a registry of your own
//	cfg := amqpidem.Config{Queue: "payments", Observer: m}
//	// with other observers: Observer: amqpidem.Observers(m, other)
//
// # Metrics
//
// Names are as with the default Options.Namespace, "amqpidem":
//
//	amqpidem_messages_total{queue,outcome,reason}                   counter
//	amqpidem_handler_duration_seconds{queue,outcome}                histogram
//	amqpidem_processing_duration_seconds{queue,outcome}             histogram
//	amqpidem_end_to_end_duration_seconds{queue,outcome}             histogram
//	amqpidem_handlers_in_flight{queue}                              gauge
//	amqpidem_oldest_handler_age_seconds{queue}                      gauge
//	amqpidem_store_call_duration_seconds{queue,op,result}           histogram
//	amqpidem_lease_extensions_total{queue,result}                   counter
//	amqpidem_requeues_total{queue,outcome,delay_tier}               counter
//	amqpidem_outbox_messages_total{queue,result}                    counter
//	amqpidem_batch_size{queue}                                      histogram
//	amqpidem_batch_duration_seconds{queue}                          histogram
//	amqpidem_batch_handler_runs_total{queue}                        counter
//
// messages_total counts every delivery processed, once, by its
// amqpidem.Outcome in lower case (completed, duplicate, busy, retried,
// dead_lettered, dropped, abandoned, outbox_given_up: the rows of
// amqpidem's outcome table)
// and amqpidem.Event.Reason. Dead letters are its outcome="dead_lettered"
// series; there is no other dead-letter counter. Busy, retried and
// abandoned deliveries come back, so one message can be counted several
// times; completed, duplicate, dead_lettered, dropped and outbox_given_up
// are final.
//
// handler_duration_seconds is how long the handler ran, for deliveries
// whose handler ran (not for duplicates, busy deliveries or dead letters
// that were never run). processing_duration_seconds is the whole
// processing of a delivery, store calls, handler, publishes and ack
// included (amqpidem.Event.Total).
//
// end_to_end_duration_seconds is the time from a message's first
// publication (amqpidem.Event.Published) to the end of its processing,
// requeue delays included, for messages that say when they were
// published. It is precise to the millisecond only for messages with the
// amqpidem.HeaderTimestampMillis header ("timestamp_in_ms": amqpidem's
// Publisher and RabbitMQ's message_timestamp plugin set it); with only the
// timestamp property, which has whole seconds, it is up to a second too
// long. It also depends on the publisher's clock agreeing with the
// consumer's; a negative difference is recorded as 0.
//
// handlers_in_flight is the number of handlers running now in this
// process. oldest_handler_age_seconds is the age of the oldest of them,
// per queue, read at each scrape; 0 when none runs (a queue keeps its
// series once a handler ran on it). A handler that does not return keeps
// its lease alive through the heartbeat, holding its key (and a
// concurrency slot) for as long as it runs: alert when this age passes
// the handler's expected worst case (HandlerTimeout, if set, cuts off only
// a handler that watches its context). It is kept from HandlerStarted and
// HandlerEnded, which must get the same context, as amqpidem's calls do;
// with Observers, so does every observer.
//
// batch_size, batch_duration_seconds and batch_handler_runs_total are a
// batch consumer's (amqpidem.NewBatchConsumer, through
// amqpidem.BatchObserver): each batch's deliveries (BatchSizeBuckets),
// how long it took from the end of its gathering to its records'
// completion, and how many times its handler was called (more than
// once when a batch error split it: batch_handler_runs_total over
// batch_size_count is the rerun cost). Each message of a batch is still
// counted on its own in the other metrics.
//
// store_call_duration_seconds times every call amqpidem makes to its
// lock.Store (op: acquire, extend, complete, fail, release, cancel, and
// amend, which records what became of staged messages), the heartbeat's
// renewals included, by result: error when the store gave an error other
// than lock.ErrLeaseLost for any of the call's leases (the store
// unreachable or timing out, but also answers that are errors, such as
// lock.ErrBadRecord), else lost when it answered that a lease was no
// longer held (lock.ErrLeaseLost), else ok.
//
// lease_extensions_total counts the heartbeat's renewals per lease, by
// result: renewed, lost or error. One extend call renews many leases, and
// some of them may be lost or fail while the others are renewed (a store
// renews them per Redis Cluster node, or skips a row another transaction
// holds).
//
// requeues_total counts the busy, retried and abandoned deliveries sent
// back after a delay (amqpidem.Event.Delay > 0), by the delay tier they
// waited in: amqpidem.DelayTier(Event.Delay) in seconds, in the shortest
// decimal form ("0.25", "1.5", "30"; see DelayTierLabel). A copy whose
// delay queue could not be published to waits its delay in the consumer
// instead and is counted in the same tier; a copy sent back at once (on
// shutdown, or by a nack) reports no delay and is not counted.
//
// outbox_messages_total counts the messages handlers stage with
// amqpidem.Stage (amqpidem.Event.Outbox), by result: staged, the messages
// a handler staged and had stored with its outcome, counted by the
// delivery whose execution stored them; published, the staged messages a
// delivery published, each confirmed by the broker; republished, those of
// the published that an earlier delivery had stored but not finished
// publishing (its process died, or a publish failed), so that published
// minus republished went out with the delivery that staged them; returned,
// the staged messages given up after the broker returned them (no queue
// bound) or refused them MaxAttempts times, which stay in their record
// for `amqpidem outbox redrive`. Publishing is at least once: a message
// whose confirmed publish could not be recorded is published, and
// counted, again. The messages of a delivery whose process died after
// storing them are not counted as staged (that delivery is never
// observed, see Limits), only as republished by the delivery that
// publishes them: published can exceed staged. A delivery that staged and
// published nothing adds to no series.
//
// # Cardinality
//
// No label holds message data: keys, message ids, consumer names and
// errors never become labels. Per queue there are 7 outcomes; reason is
// one of a few dozen fixed strings amqpidem chooses ("in progress
// elsewhere", "handler error", "handler timeout", "permanent failure",
// "attempts exhausted", "key conflict", "lease lost", "store unavailable",
// "shutdown", ...), empty for most completed and duplicate deliveries; op
// has 7 values, result 3 (4 in outbox_messages_total). delay_tier is
// bounded by amqpidem's delay tiers: delays are rounded to two
// significant digits of milliseconds, so at most 90 tiers per decade of
// delays; in practice a few per Backoff step (its 10% jitter spreads a
// step over several tiers) and a few dozen for busy deliveries, which wait
// about what the holder's lease has left, up to InProgressDelay. Tell
// consumers in different processes apart with the target's instance
// label, or with Options.ConstLabels.
//
// # The console's rate charts
//
// The console (package console) charts messages_total's rates without
// importing this package: Metrics.Outcomes reads a Metrics' own counters
// (for a console mounted in the consumer's process), and a Scraper reads
// a consumer's /metrics URL ("amqpidem console --metrics-url"), parsing
// the Prometheus text format with prometheus/common's expfmt. Both give
// the counts by queue and outcome, summed over reasons.
//
// # Limits
//
//   - A delivery is observed after it was settled. One being processed
//     when the process dies is never counted; its redelivery is. Nor are
//     the prefetched deliveries a Consumer gives back unprocessed when it
//     shuts down.
//   - A Completer's completion (pgstore's TxHandler commits the record
//     with the handler's transaction) is part of the handler, timed in
//     handler_duration_seconds, not a store call. Consumer.Ready's store
//     ping is not a store call either.
//   - The metrics are per process and start at zero: use rate() and
//     increase(), and sum over instances.
//   - A series appears with its first sample: there is no
//     amqpidem_messages_total{outcome="dead_lettered"} before a first dead
//     letter, so write alerts that treat a missing series as zero. Series
//     stay once they appeared, also after their consumer stopped.
//
// Examples of queries:
//
//	sum by (queue, reason) (rate(amqpidem_messages_total{outcome="dead_lettered"}[5m]))
//	histogram_quantile(0.99, sum by (queue, le) (rate(amqpidem_handler_duration_seconds_bucket{outcome="completed"}[5m])))
//	sum by (queue) (rate(amqpidem_lease_extensions_total{result!="renewed"}[5m])) > 0
//	sum by (queue) (increase(amqpidem_outbox_messages_total{result="returned"}[15m])) > 0
package promamqpidem
