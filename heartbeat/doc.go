// Package heartbeat keeps leases from package lock alive while their
// handlers run, and tells a handler, through its context, when it can no
// longer count on its lease.
//
// A consumer acquires a lease per message (lock.Store.Acquire), passes it to
// Keeper.Keep, runs the handler with the returned context, and finishes with
// Complete, Fail or Release:
//
//	ctx, stop := keeper.Keep(ctx, res.Lease)
//	defer stop()
//	out, err := handle(ctx, msg) // reads heartbeat.LeaseFromContext(ctx)
//
// One Keeper serves every lease of a process with two goroutines: a loop that
// watches each lease's deadline and, every tick, sends all due leases to the
// store in one Extend call (one pipelined round trip on Redis), and an
// extender that makes that call, so a store that hangs (a paused or
// unreachable Redis, a client that ignores context deadlines) never delays a
// deadline check. Each lease is extended about every TTL/3 (sooner after a
// transport error, about every TTL/10), so leases with different TTLs can
// share a Keeper.
//
// A caller that runs the work of many leases under one context of its own
// (a batch, say) can spare a context per lease with KeepWith: the lease is
// kept on the same schedule, by the same Extend calls, and where Keep
// would cancel its context the Keeper calls a LossHandler instead, which
// cancels the batch's context:
//
//	kept, err := keeper.KeepWith(res.Lease, handler) // handler.LeaseLost(cause)
//	if err != nil { ... } // what Keep's context would have been cancelled with
//	defer kept.Stop()
//
// # Guarantees
//
// The Keeper tracks, for every lease, a conservative local deadline: the
// local time just before the last confirmed Extend (or the Acquire) was sent,
// plus the TTL, less lock.DeadlineSlack. The server's deadline is never
// earlier, because the server set it after that moment, from its clock
// rounded down to the millisecond at most. The Keeper never trusts the server's clock: it
// compares readings of this process's clock only (monotonic readings, for
// leases from a store whose clock is time.Now, the default).
//
// The handler's context is cancelled (a KeepWith lease's LossHandler told),
// with a cause from context.Cause (LeaseLost's argument):
//   - wrapping lock.ErrLeaseLost within about one extension interval after an
//     Extend reports the lease lost (taken over, completed or released
//     elsewhere, expired from Redis);
//   - wrapping ErrLeaseUnconfirmed at the local deadline minus
//     Config.SafetyMargin, when no extension was confirmed in time;
//   - with ErrClosed when the Keeper shuts down;
//   - with the parent's cause when the parent context is done (Keep only:
//     a KeepWith lease has no parent).
//
// # Limits
//
// Cancellation is cooperative: the Keeper cancels a context, it cannot stop
// a goroutine. A handler that ignores ctx keeps running, and keeps writing,
// after its lease has run out and another consumer has taken the message
// over. The safety margin must cover the time a handler takes to notice
// cancellation and stop, and the difference in clock rate between this host
// and Redis over one TTL.
//
// It must also exceed the host's scheduling latency: the Keeper's loop and
// the handler are goroutines, and on a starved CPU they run late. With
// GOMAXPROCS 1 and goroutines spinning beside them (Go preempts a running
// goroutine after about 10 ms), a hung store's handler saw its context
// cancelled up to 35 ms after the local deadline on an idle host, and up
// to 90 ms after it (110 ms after the deadline minus a 20 ms margin) on a
// host with a load average of 5 to 9 (TestKeepLatenessUnderStarvation,
// HEARTBEAT_STARVATION=1). A margin of a few milliseconds, or even the
// 200 µs one a short TTL tempts, is crossed by such a pause.
//
// A lease is not a mutex. A process stopped for longer than the margin (a
// long GC pause, SIGSTOP, a VM migration, an overloaded host) can resume
// after its lease expired and act before it looks at its context. Where a
// duplicate write matters, make the write itself safe: carry the fencing
// token (LeaseFromContext(ctx).Fence) to the downstream system and have it
// reject a write whose fence is lower than the highest it has seen.
package heartbeat
