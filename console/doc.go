// Package console serves a web console for operators of amqpidem
// consumers: an http.Handler to mount in an admin server, behind the
// server's own authentication, or run by "amqpidem console".
//
// Pages (server-rendered, no script, no resource from elsewhere):
//
//   - the overview (/): the configured queues with the depth of their
//     dead-letter queues, their endpoints' records counted by state
//     (failed, expired: in progress with an expired lease, stalled: a
//     live lease whose heartbeat stalled, in progress, completed), exactly
//     when the store is a lock.Counter that counts within
//     Config.CountBudget, else among the first 1000 or so the store lists
//     (marked "at least" unless those were all); with Config.Metrics,
//     small charts of each queue's delivery rates over the last minutes;
//     and forms to look up a key, an endpoint's records or a queue;
//   - an endpoint's records (/records?endpoint=E[&state=S][&cursor=C]),
//     by state, expired, stalled or unpublished (completed with staged messages
//     pending or returned), page by page with lock.Lister: a page reads at
//     most about Config.ListScan records of the store and shows about 50,
//     linking to the next page, which goes on where it stopped (never a
//     full scan: a page costs the same on 100,000 records as on 100);
//   - a key (/key?endpoint=E&key=K): its record as lock.Admin.Inspect
//     reads it (state, attempts, fence, lease, times, error, result size,
//     staged messages), under amqpidem.StoreKey(E, K);
//   - the dead letters of a queue (/dlq?queue=Q[&dlq=D][&limit=N]): key,
//     reason, error, attempts, first seen and origin (signed, unsigned, bad
//     signature, unchecked) of each, read as "amqpidem dlq list" reads
//     them;
//   - with Config.Relay, the producer outbox's dead and pending rows
//     (/relay?state=dead|pending[&after=ID]), 50 a page in ID order, with
//     the backlog (pending rows, the oldest one's age, dead rows), which
//     the overview shows too;
//   - with Config.Actions, confirmation pages for forgetting a failed
//     record (/forget?endpoint=E&key=K) and replaying the dead letters of
//     a key, with or without forgetting its failed record first
//     (/replay?queue=Q&key=K[&forget=1]), and, when Actions is also a
//     Redriver, for redriving a dead outbox row (/redrive?id=N), and
//     their POSTs.
//
// Guarantees:
//
//   - Without Config.Actions it changes nothing: records are only read
//     (Inspect), and the pages name the command to run instead.
//   - With it, nothing changes but through Actions, and Actions is asked
//     to change something only by a POST from a confirmation page: the
//     page says what the action means and shows what Actions reports for
//     a dry run of it, and the POST must carry the page's CSRF token (an
//     HMAC, under a key of this Console, of a random SameSite=Strict
//     cookie it set) and must not come from another origin
//     (http.CrossOriginProtection). A forget names the fence of the
//     failed record shown, so that Actions can leave any other. The
//     console offers forget only for a failed record; every other rule is
//     Actions' ("amqpidem console" gives the command's). Each action is logged at
//     Info (what, the key escaped, the status, the report, the remote
//     address).
//   - Dead letters are read with basic.get without acknowledgement and
//     given back when the page's connection closes, in order, marked
//     redelivered: on a quorum dead-letter queue with a delivery limit each
//     page load counts as a delivery of every message it read (as each
//     "dlq list" does). One page reads or replays at a time.
//   - Every value that comes from a message, a record or a store (keys,
//     reasons, errors, exchanges, owners, results) is shown through the
//     command's own escaping (control characters, bidi overrides and bytes
//     that are not UTF-8 as Go-style escapes) and html/template's; none is
//     put into a script or a style; in an attribute only as a URL's query,
//     which html/template percent-encodes, or hex-encoded in a
//     confirmation's hidden field (a form would change a lone newline). Responses forbid scripts,
//     framing and other origins (Content-Security-Policy), are not cached
//     and send no Referer.
//   - Bad input (an unknown key, a malformed parameter, an unknown queue)
//     and a service down give a page saying what happened and what to do,
//     with the status code that fits (400, 403, 404, 405, 409, 503), never a stack
//     trace; a panic in a page gives a 500 page and a log line.
//   - Config.StoreName and Config.BrokerName, and the errors of Admin,
//     Dial and Actions, are shown (escaped) as given: make them name no
//     password ("amqpidem console"'s do not). The console itself names no
//     URL or DSN.
//
// Leases: a record keeps its lease's deadline, not its last renewal. The
// console is told the consumers' lease TTL (Config.LeaseTTL, default
// lock.DefaultLeaseTTL) and shows TTL minus the time left as how long ago
// a lease was renewed; more than 2/3 of the TTL (two heartbeat intervals:
// package heartbeat renews every TTL/3) is a stalled heartbeat. Told a
// TTL longer than the consumers', it flags healthy leases; shorter, it
// flags stalls late.
//
// Rates: Config.Metrics (promamqpidem's Metrics or Scraper; the console
// imports neither) is read by one goroutine of the Console every
// Config.MetricsInterval into a ring of at most 1000 samples; Close stops
// it. Without Metrics, New starts no goroutine.
//
// Limits: the console has no authentication of its own; mount it behind
// the admin server's (the CSRF token protects a signed-in operator from
// other sites, not the console from anyone who can reach it). It reads one dead-letter queue at a time (page loads
// wait their turn, so that two never split a queue's messages between
// them) and at most Config.DeadLetterLimit of its messages per page. On a
// store that cannot count within the budget (Redis, DynamoDB: a count
// would be a full scan) its counts by state are of the records one page
// reads, and say so. A store whose Admin is no
// lock.Lister has no records pages: its keys are looked up by name.
//
// Mounted under a path, strip it: links are relative, so
//
//	mux.Handle("/amqpidem/", http.StripPrefix("/amqpidem", h))
//
// serves it at /amqpidem/.
package console
