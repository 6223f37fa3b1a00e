// Package dynamostore keeps amqpidem's idempotency records in Amazon
// DynamoDB, and lets a handler write its own DynamoDB items in the same
// TransactWriteItems that completes the record: for effects that live in
// DynamoDB, a message then takes effect exactly once, crashes included.
//
//	cfg, _ := config.LoadDefaultConfig(ctx)             // github.com/aws/aws-sdk-go-v2/config
//	client := dynamodb.NewFromConfig(cfg)
//	_ = dynamostore.CreateTable(ctx, client, dynamostore.Config{}) // once, at deployment
//	store, _ := dynamostore.New(client, dynamostore.Config{})
//	h := store.TxHandler(func(ctx context.Context, tx *dynamostore.Tx, d *amqp.Delivery) ([]byte, error) {
//		tx.Put(&types.Put{
//			TableName:           aws.String("payments"),
//			Item:                map[string]types.AttributeValue{"id": &types.AttributeValueMemberS{Value: d.MessageId}},
//			ConditionExpression: aws.String("attribute_not_exists(id)"),
//		})
//		return nil, nil
//	})
//	c, _ := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{...}, h)
//
// # The table
//
// One table holds the records of every Store that names it (Config.Table,
// default "amqpidem_records"); Config.Prefix separates them. CreateTable
// makes it; TableInput is its definition, for CloudFormation or Terraform:
//
//	partition key  pk   B   the prefix, a zero byte, then the idempotency key (up to 1089 bytes)
//	sort key       none
//	billing        PAY_PER_REQUEST (any mode works)
//	TTL            on the attribute ttl (Unix seconds)
//
// A record is one item. Its other attributes: st (S: the state, one letter
// as lock.State.Letter writes it, or "d" for a forgotten record), ow (S:
// the latest lease's owner token), fe (N: its fence), dl (N: its deadline,
// Unix ms), at (N: leases granted), fp (B: the fingerprint), cr and en (N:
// created, and ended or 0, Unix ms), ex (N: when the record expires, Unix
// ms), v (B: the result or error text), ttl. The binary attributes hold a
// zero byte in front of their bytes, so that none is ever empty.
//
// # Guarantees
//
// Store is a lock.Store with the Redis store's state machine, answers and
// limits; it passes the same conformance suite (internal/storetest). It
// implements lock.Admin (Inspect reads an item with a strongly consistent
// GetItem; Forget is compare-and-set on state and fence) and lock.Amender
// (Amend is compare-and-set on state, fence and value, and changes only
// the value).
//
//   - Atomic: every write is one conditional UpdateItem (or, for TxHandler,
//     one TransactWriteItems) whose ConditionExpression checks what the
//     writer relies on: a lease's writes check owner, fence, state and that
//     the record has not expired; Acquire checks the item exactly as it read
//     it (state, fence, deadline, expiry), and a failed condition returns
//     the item (ReturnValuesOnConditionCheckFailure), from which Acquire
//     decides again. A new key or a duplicate costs one request; taking
//     over an expired or released lease, two.
//   - Heartbeats: Extend renews each lease with a conditional UpdateItem of
//     its own, Config.ExtendConcurrency at once, so one lost lease fails
//     alone. (One TransactWriteItems for all would fail whole.)
//   - Retry-safe: Acquire resends a lost answer with the same owner token
//     and gets its own lease back; a retried Complete, Fail, Release or
//     Cancel that finds its own write answers nil, and so does a retried
//     Amend that finds its value.
//   - Errors: lock.ErrUnavailable when DynamoDB did not answer or said "not
//     now": throttling (ProvisionedThroughputExceeded, Throttling,
//     RequestLimitExceeded), InternalServerError, ServiceUnavailable,
//     transaction conflicts, a 5xx, a transport error, a missing table
//     (its error says to create it), and a context deadline that passed
//     (a cancelled context is returned as it is). The SDK
//     retries some of these itself first (its retryer, 3 attempts by
//     default), always within the caller's context: heartbeats and
//     handlers bound it. lock.ErrLeaseLost when the lease is no longer
//     held; lock.ErrBadRecord for an item this store cannot read.
//
// # Time: the clocks of the consumers, not of DynamoDB
//
// A DynamoDB condition cannot read the server's clock. So a lease's
// deadline and a record's expiry are written as numbers computed from the
// writer's clock (Config.Now), and compared with the clock of the process
// that reads them, in the condition (ex > :now, and a takeover's
// condition on the deadline it saw). This store therefore assumes that the
// clocks of all processes sharing a table differ by at most
// Config.MaxClockSkew (default 1 s; NTP or Amazon Time Sync keeps them
// within milliseconds). An expired lease is taken over only once its
// deadline is MaxClockSkew past by the taker's clock, whatever the
// Retention (a lease whose item expired within the skew, as with a
// Retention below MaxClockSkew, is still held), so a holder whose clock
// is behind by up to that much keeps its lease until its own
// Lease.Deadline. A clock off by more than that can let a lease be taken
// over while its holder still believes it holds it: two executions at
// once, both fenced (the older one's writes are refused), but not undone.
// Keep the lease TTL well above the skew.
//
// Expiry is judged in the conditions, never by the item's absence.
// DynamoDB's TTL deletes expired items lazily (within days); the ttl
// attribute is set Config.TTLDelay (default 24 h) after the record's
// expiry, for cleanup only. An expired item that is still there is no
// record to every method.
//
// # Fences
//
// Each new lease's fence is the higher of the last fence + 1 and the
// taker's clock in microseconds (as the Redis store does with the server's
// clock), so fences strictly increase per key while its item exists,
// whatever the clocks do. The item outlives the record: it stays, expired,
// until TTL deletes it at least TTLDelay later, and Forget leaves a
// tombstone that keeps the fence. So a record made again after its item
// was deleted gets a higher fence unless the taker's clock is behind the
// deleted fence, that is behind by more than TTLDelay (plus the skew).
//
// # The transactional handler
//
// TxHandler runs the handler's function, which adds its writes (Put,
// Update, Delete, ConditionCheck) to a Tx, then sends them with the
// record's completion (conditional on owner, fence and state) in one
// TransactWriteItems: the effects and the record commit together or not
// at all. See TxHandler for what a cancelled transaction becomes, and
// MaxTxItems and MaxTxBytes for the limits.
//
// Writing one: fn reads what it needs, with a client of its choice, and
// adds its writes to the Tx; it returns the result, or an error, and
// nothing is sent unless it returns no error. What it writes with its own
// client instead is not part of the transaction: it happens at least once.
// It may not write the record's item, nor add two writes of one item
// (DynamoDB refuses the transaction). A condition that may fail because
// the work is already done ("attribute_not_exists(id)") cancels the whole
// transaction, the record's completion with it: Tx.OnConditionFailed
// decides the handler's error then, and answering nil does not make it a
// success. Where the effect may be there already, read it in fn and add no
// write for it, so that the record commits alone.
//
// # Batches
//
// With amqpidem.NewBatchConsumer, the Store takes a batch's leases with
// AcquireBatch: the conditional writes of up to MaxTxItems keys in one
// TransactWriteItems, each key decided as Acquire decides it, on the same
// item, with the same fencing. A batch of new keys costs one round trip,
// one with duplicates, keys in progress or taken over two (measured on
// DynamoDB Local, TestAcquireBatchRoundTrips: 100 new keys 1, against
// Acquire's 100); keys whose items change under 3 transactions in a row,
// and every key of a transaction whose answer was lost, are taken one by
// one with Acquire's writes and retries. BatchTxHandler sends the
// handler's writes and the batch's records in one TransactWriteItems.
//
// The largest batch one transaction commits is bounded by DynamoDB's
// limits, records included: MaxTxItems (100) items, so 100/(k+1)
// messages whose handler writes k items each (50 with one item each), and
// MaxTxBytes (4 MB). A batch over them is not refused: nothing is sent,
// and amqpidem splits it in halves, each run again (fn included) until
// they fit, no message refused and no attempt counted. Only a single
// message whose own writes do not fit with its record fails, as with
// TxHandler. Set ConsumerConfig.BatchSize to what fits to spare the
// reruns. A transactional write costs twice the write capacity of a
// plain one, for the leases of AcquireBatch too, and a cancelled
// transaction (a batch with duplicates) is charged as well.
//
// # Limits
//
// A record is one item, at most 400 KB: Config.MaxResultSize may not
// exceed MaxResultSizeLimit (396 KB), and the default is 64 KB
// (lock.DefaultMaxResultSize). A write costs one write request unit per
// KB of the item, the larger of before and after, and so does a
// conditional write whose condition fails. A record in progress holds no
// result, so an Acquire of a new key and the heartbeats (Extend) cost one
// unit each (with keys up to a few hundred bytes); a result is paid for
// by the write that stores it (Complete, or TxHandler's transaction, which
// counts twice), by Amend and Forget, and by the Acquire of every
// duplicate delivery, a conditional write that fails on the completed
// item and returns it.
//
// Exactly-once covers what the handler writes through Tx, in DynamoDB and
// in the same region (a transaction does not span regions, and global
// tables replicate it asynchronously: use one region's table for the
// records of a consumer). Anything else the handler does happens at least
// once: make it idempotent or fence it with amqpidem.FromContext(ctx).Fence.
//
// IAM: a consumer needs dynamodb:GetItem, UpdateItem and DescribeTable
// (Check) on the records table. There is no action for a
// TransactWriteItems as such: each of its items needs the action of its
// kind on its table, so TxHandler's transaction needs UpdateItem on the
// records table (the record's completion) and, on the tables of the
// handler's items, PutItem, UpdateItem, DeleteItem or ConditionCheckItem
// for its Put, Update, Delete and ConditionCheck. The amqpidem command's
// inspect and forget need GetItem and UpdateItem; CreateTable needs
// CreateTable, DescribeTable and UpdateTimeToLive.
//
// This package's tests run each test on two servers: minidyn
// (github.com/truora/minidyn, an open-source in-memory DynamoDB that
// scripts/dynamo.sh builds and starts) and Amazon's DynamoDB Local 1.25.1
// (scripts/dynamodb-local.sh installs it into a cache directory and starts
// it); so do the amqpidem command's DynamoDB tests and the chaos
// scenarios. minidyn checks conditions, update expressions and
// transactions as DynamoDB does, but reports only the first failed
// condition among a cancelled transaction's reasons, enforces none of the
// size and count limits above, has no TTL (scripts/dynamo answers its API,
// moves the TTL attribute when asked and deletes nothing), and keeps
// numbers as 64-bit floats; it serves one request at a time and copies
// every table a transaction writes (its rollback snapshot), so its
// transactions slow down as the tables grow. DynamoDB Local enforces the
// item and transaction size limits, reports every failed condition and
// refuses TTL on a second attribute, as DynamoDB does; it deletes items
// whose TTL has passed within seconds (DynamoDB within days), and keeps a
// database per access key and region unless started with -sharedDb. The
// service itself differs from both emulators in its throttling and
// timing.
package dynamostore
