// Package lock keeps one record per idempotency key and hands out leases on
// it: the state behind "run this operation once".
//
// A record moves, per key:
//
//	                                               ┌──────┐ Amend (new value)
//	                                               ▼      │
//	absent ──Acquire──▶ in progress ──Complete──▶ completed (result)
//	                      │    ▲     ──Fail──────▶ failed (error)
//	       Release/Cancel │    │
//	                      ▼    │ Acquire (new lease, fence+1, attempt+1)
//	                   released
//
// Cancel is Release for work that never started: it also takes back the
// attempt its Acquire counted, so the next lease has the same attempt
// number (and a higher fence).
//
// Amend (Amender: every store of this module) changes the value of a
// completed record and nothing else: the record stays completed, with
// the same fence, attempts and expiry. amqpidem's outbox records in it
// what became of the messages a handler staged.
//
// Acquire answers one of five things, atomically: Acquired (a
// Lease: owner token and fencing token), Completed (the stored result),
// Failed (the stored error), InProgress (another owner's lease is live, and
// how long it has left) or Conflict (the key was first seen with a
// different payload fingerprint). An in-progress record whose lease has
// expired is taken over by the next Acquire, with a higher fence.
//
// # Guarantees
//
//   - Atomic: every transition is one Lua script or one MULTI transaction
//     on RedisStore (one locked section on MemoryStore); there is no
//     read-then-write window. The transaction only creates a record that
//     does not exist (SET NX) or reads one; every change to an existing
//     record is a script.
//   - Expiry by the server's clock: scripts read Redis TIME, and a record
//     made by the transaction takes its times from the key's expiry, which
//     the server sets. A client whose clock is wrong can neither steal a
//     live lease nor keep a dead one. The client's own clock is used only
//     to estimate its lease's deadline conservatively (Lease.Deadline is
//     never later than the server's: it is counted from just before the
//     request was sent, less DeadlineSlack, since the server starts a
//     lease at its current millisecond rounded down).
//   - Fencing: while a key's record exists, each new lease's fence is
//     strictly higher than the last, whatever the clocks do. A new lease's
//     fence is the higher of the last fence + 1 and the server's clock in
//     microseconds (Redis TIME); a record made by the transaction starts
//     at the first microsecond after the millisecond it was made in. So a
//     record that was lost (expired after its retention, evicted,
//     forgotten by a restart without persistence or by a failover) and
//     made again still hands out fences above every fence of the lost
//     record, as long as the clock of the server granting the new lease is
//     past the lost record's last fence, which is less than a millisecond
//     ahead of the clock that granted it: a key gets fewer than one lease
//     per microsecond (each lease is a script or transaction that reads the
//     clock, between two leases on a key comes another such call or a TTL
//     of at least 1 ms, and Redis runs them one at a time), and a first
//     fence is rounded up by less than a millisecond. Forget keeps the
//     fence for a second, for a record made again at once. A clock stepped
//     back, or a failover to a server whose clock is behind, can break
//     that. Attempts, unlike fences, restart at 1 with a new record.
//     Extend, Complete, Fail and Release are compare-and-set on owner and
//     fence: a holder whose lease was taken over gets ErrLeaseLost and
//     changes nothing.
//   - Amend is compare-and-set on state (completed), fence and value: of
//     writers that saw the same value, one changes it and the others get
//     ErrChanged and change nothing, as does a writer whose record
//     expired, was forgotten or made again meanwhile. It keeps the
//     record's expiry as the completion set it (SET ... KEEPTTL on
//     RedisStore): amending never lengthens the idempotency window.
//   - Retry-safe: go-redis resends a command after a network error. A
//     resent Acquire that finds its own owner token answers Acquired while
//     that lease is held, and takes nothing once its caller released or
//     cancelled it (a copy that arrives late, after one sent again got the
//     lease: it answers InProgress and changes nothing); a resent
//     Complete, Fail, Release or Cancel that finds its own write answers
//     nil (and a resent Cancel takes back no second attempt), and so does
//     a resent Amend that finds its value in the record.
//     RedisStore.Acquire also tries again itself, with the same owner
//     token, when a reply does not come (a timeout, a broken connection),
//     so that a lease taken by a call whose reply was lost is not left
//     blocking the key. What remains: if the store stays unreachable past
//     those few tries (about 350 ms), Acquire returns ErrUnavailable and a
//     lease it may have taken blocks the key for its TTL, with its attempt
//     counted.
//   - Errors say what they are: ErrUnavailable when the store could not
//     answer (the call may or may not have taken effect), ErrBadRecord or
//     ErrKeyCollision when one key's record cannot be used (other keys are
//     unaffected), ErrLeaseLost when the lease is no longer held.
//   - Bounded: keys are 1 to MaxKeyLen bytes (any bytes) and hashed into
//     Redis keys "<prefix>:{<digest>}", so user input cannot pick a Cluster
//     slot or cross a namespace. Results are limited (Config.MaxResultSize).
//     Every record expires: Retention after its last change, or TTL +
//     Retention while a lease is held. Nothing lives forever.
//   - Portable: one key per record, passed in KEYS, so RedisStore works on
//     a standalone server, Sentinel and Cluster (any redis.UniversalClient).
//     Concurrent calls are merged into one script call over many keys
//     only when the server says (INFO server, asked once) that it is a
//     standalone Redis, not a proxy that might run the call on the shard of
//     its first key; a merged call refused as a whole (CROSSSLOT) is sent
//     again one call per key, and merging stops for that store. The
//     native Acquire transaction is used on such a server only (Redis 7.0
//     or later); when one is refused, that Acquire runs the acquire
//     script, and unless the refusal was of writes (OOM, MISCONF,
//     NOREPLICAS) every later one does too, with a warning logged once.
//
// # Records in Redis
//
// A RedisStore record is one string value: a binary MessagePack sequence
// of a format version, then state, owner, fence, lease deadline, attempts,
// fingerprint, the caller's key, created and ended times and the stored
// value, in that order (scripts/record.lua describes each). It is written
// with SET ... PX, so record and expiry change in one command, or, by
// Amend, with SET ... KEEPTTL, which keeps the expiry. To inspect
// one, GET it and decode the bytes with any MessagePack decoder; it is not
// a hash, and HGETALL answers WRONGTYPE.
//
// Format 1 is what the Lua scripts write. Format 2 is what Acquire writes
// for a key with no record, without a script: one transaction of SET ...
// NX PX ... GET and PEXPIRETIME, which cannot put the server's time in the
// value, so the record's created time, lease deadline and first fence are
// computed from the key's expiry (the server's clock) by Go and the scripts
// alike; the first script that rewrites the record makes it format 1. The
// same transaction answers a duplicate of completed or failed work with no
// script at all, which is what makes duplicates cheap. That native path
// needs a standalone or Sentinel-managed Redis 7.0 or later; on a Cluster
// or an older server every Acquire runs the acquire script, with the same
// answers. Releases of this package before format 2 cannot read format 2
// records (ErrBadRecord for those keys): upgrade every consumer of a
// Config.Prefix together. A record of an unknown format version, or of
// another type (a hash written by an earlier release of this package), is
// an error for its key alone: other keys in the same call are answered as
// usual.
//
// The outcome of a lease whose record Acquire made natively (Complete,
// Fail, Release or Cancel before any Extend: the commonest case) is written
// without decoding the record: the call carries the format 2 record as
// that Acquire wrote it, the expiry it was written with, and the start of
// the format 1 record to write, packed by Go; finish.lua compares the
// stored bytes and expiry with those (the owner token in them is unique to
// that Acquire, and the expiry gives the fence), and on a match writes the
// new record with its end time and value appended, the record the decoding
// path would write. It reads the expiry first and, when that matches,
// writes and reads the record in one SET ... GET (two commands a key, not
// three); a record it replaced that was not the made one (another record
// expiring in the same millisecond) is put back as it was, bytes and
// expiry, within the same script, and judged as any. Any other record
// (extended, taken over, of another lease) is decoded and judged field by
// field as before. The record
// formats are unchanged, so consumers of the release before this one and
// of this one read, complete and take over each other's records during a
// rolling upgrade.
//
// RedisStore and MemoryStore are a BatchAcquirer and a BatchCompleter
// (pgstore's Store is a BatchAcquirer): AcquireBatch takes many keys'
// leases, each key decided on its own exactly as Acquire decides it, in
// one pipeline of native transactions and a second holding only the keys
// the acquire script must decide (one pipeline on a Cluster or an older
// server, all through the script); CompleteBatch completes many records
// in one pipeline. A batch is a transport, not a transaction: each key's
// transition stays atomic on its own, and one key's answer never decides
// another's.
//
// Forget does not delete a record at once: it leaves a tombstone that
// keeps the key's fence for one second, which every reader takes for no
// record, so that a record made again at once still gets a higher fence
// (a format 2 record's first fence is rounded up to the next millisecond).
//
// # Limits
//
// A lease is not a mutex. A holder can be paused (GC, SIGSTOP, a slow
// disk) past its deadline and go on running while another owner takes
// over; the store then refuses the stale holder's writes, but it cannot
// undo what the stale holder did elsewhere. Side effects outside the store
// must check the fencing token (reject writes with a fence lower than the
// highest seen) or be idempotent themselves. Package heartbeat keeps leases
// alive and cancels handlers that lose them; it narrows the window, it does
// not close it.
//
// Exactly-once ends at the store. If a process dies after the side effect
// and before Complete, the next delivery finds an expired lease, takes it
// over and runs the operation again. Only a side effect that is idempotent
// or fenced absorbs that re-execution.
//
// Redis must not lose records: run it with maxmemory-policy noeviction
// (RedisStore.Check warns otherwise) and with persistence (appendonly) if a
// restart must not forget completed work. A failover to a replica that had
// not yet received a write can forget it too; Redis replication is
// asynchronous. Config.Replicas closes that window for the replicas that
// acknowledged: each write waits (WAIT) until that many replicas have it,
// and one they do not acknowledge in time is ErrUnavailable, so that no
// lease is used and no outcome counted before a replica holds it. It
// costs a round trip's worth of replication per write, and the store is
// unavailable while fewer replicas answer; it does not help a failover to
// a replica that did not acknowledge, nor a restart without persistence.
// Without it, a RedisStore behind Sentinel is not linearizable across a
// failover, and the linearizability checks of docs/testing.md expect that.
//
// go-redis ignores context deadlines unless the client has
// ContextTimeoutEnabled; otherwise a call can block for ReadTimeout (3 s by
// default) or longer. Package heartbeat copes with a blocked call, but set
// ContextTimeoutEnabled, or timeouts well under the lease TTL, so that the
// store answers within a lease.
//
// A key that changes meaning within the retention window (a producer that
// reuses ids) is a duplicate as far as the store knows; payload
// fingerprints turn that into a Conflict instead of a silent skip.
package lock
