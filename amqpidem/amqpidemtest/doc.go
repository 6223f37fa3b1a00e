// Package amqpidemtest runs a handler through amqpidem's processing, on an
// in-memory store and without a broker, so that handlers can be tested
// the way asynq users test theirs: give a Kit synthetic deliveries
// (duplicates, redeliveries, headers, copies coming back for another
// attempt) and assert on what became of each: its outcome and reason, the
// ack or nack, the copy requeued and its delay, the dead letter and its
// headers, the reply, and the messages the handler staged (Stage).
//
//	func TestCharge(t *testing.T) {
//		k := amqpidemtest.New(t, amqpidem.Config{MaxAttempts: 2}, amqpidem.HandlerFunc(charge))
//		r := k.Deliver(amqpidemtest.Message{ID: "pay-1", Body: []byte(`{"cents":100}`)})
//		if r.Outcome != amqpidem.Completed || !r.Acked {
//			t.Fatalf("first: %v %q %v", r.Outcome, r.Reason, r.Err)
//		}
//		if r := k.Deliver(amqpidemtest.Message{ID: "pay-1", Body: []byte(`{"cents":100}`)}); r.Outcome != amqpidem.Duplicate {
//			t.Fatalf("copy: %v", r.Outcome)
//		}
//	}
//
// # Guarantees
//
// Each Deliver goes through the same code as a Wrapper's Handle: key
// extraction, the store's answer, the heartbeat, the handler, the stored
// outcome, retries with Config.RetryDelay or Backoff, MaxAttempts, dead
// letters with their headers, replies, and the outbox. The store is a
// lock.MemoryStore (or the one given to NewWithStore), so duplicates,
// failed records and attempts counted in the store behave as in
// production. Deliver returns once the delivery is settled.
//
// # Limits
//
// There is no broker: every publish succeeds at once, unless Kit.Refuse
// made publishes to a routing key fail; a copy requeued is returned in
// Result.Requeued, not delivered again by itself (Redeliver delivers it,
// without waiting its delay); Config.DelayInProcess is ignored for that
// reason. What a Consumer adds around the processing is not exercised:
// Concurrency and delivery order, prefetch, reconnections, the delivery
// limit of quorum queues. Leases do expire by the clock: a handler that
// runs past Config.LeaseTTL without its heartbeat is cancelled, as in
// production.
package amqpidemtest
