// Package console serves a read-only web console for operators of amqpidem
// consumers: an http.Handler to mount in an admin server, behind the
// server's own authentication, or run by "amqpidem console".
//
// Pages (server-rendered, no script, no resource from elsewhere):
//
//   - the overview (/): the configured queues with the depth of their
//     dead-letter queues, and forms to look up a key or a queue;
//   - a key (/key?endpoint=E&key=K): its record as lock.Admin.Inspect
//     reads it (state, attempts, fence, lease, times, error, result size,
//     staged messages), under amqpidem.StoreKey(E, K);
//   - the dead letters of a queue (/dlq?queue=Q[&dlq=D][&limit=N]): key,
//     reason, error, attempts, first seen and origin (signed, unsigned, bad
//     signature, unchecked) of each, read as "amqpidem dlq list" reads
//     them.
//
// Guarantees:
//
//   - It changes nothing. It has no action and answers only GET and HEAD.
//     Records are only read (Inspect). Dead letters are read with
//     basic.get without acknowledgement and given back when the page's
//     connection closes, in order, marked redelivered: on a quorum
//     dead-letter queue with a delivery limit each page load counts as a
//     delivery of every message it read (as each "dlq list" does). Replay,
//     forget and redrive stay the command's (amqpidem dlq replay, forget,
//     outbox redrive); its pages name the command to run.
//   - Every value that comes from a message, a record or a store (keys,
//     reasons, errors, exchanges, owners, results) is shown through the
//     command's own escaping (control characters, bidi overrides and bytes
//     that are not UTF-8 as Go-style escapes) and html/template's; none is
//     put into a script, a style or an attribute other than a URL's query,
//     which html/template percent-encodes. Responses forbid scripts,
//     framing and other origins (Content-Security-Policy), are not cached
//     and send no Referer.
//   - Bad input (an unknown key, a malformed parameter, an unknown queue)
//     and a service down give a page saying what happened and what to do,
//     with the status code that fits (400, 404, 405, 503), never a stack
//     trace; a panic in a page gives a 500 page and a log line.
//   - Config.StoreName and Config.BrokerName are shown as given: pass them
//     without credentials. Nothing else names a URL or a DSN.
//
// Limits: the console has no authentication of its own; mount it behind
// the admin server's. It reads one dead-letter queue at a time (page loads
// wait their turn, so that two never split a queue's messages between
// them) and at most Config.DeadLetterLimit of its messages per page; it
// lists no records by state (the stores have no listing yet): a key is
// looked up by name.
//
// Mounted under a path, strip it: links are relative, so
//
//	mux.Handle("/amqpidem/", http.StripPrefix("/amqpidem", h))
//
// serves it at /amqpidem/.
package console
