// Package linearizable checks histories of lock.Store operations for
// linearizability against a sequential model of one key's record, with
// github.com/anishathalye/porcupine, as etcd's robustness tests do (issue
// 38).
//
// A Recorder wraps a store (lock.Store, lock.Admin, lock.Amender) and
// writes down every call: the client, the key, the input, the output or
// error, and the call and return times (monotonic, since the recorder was
// made; a file recorder's are the wall clock's, and it writes each call
// and each return to its file as they happen, so that the histories of
// several processes, some killed in the middle of a call, merge into one:
// ReadHistories). Model is the sequential specification of one key's record,
// partitioned by key; Check runs porcupine on a history with a time budget
// and, on a violation, writes porcupine's HTML visualization of the
// failing partition. Run drives concurrent clients against a store while
// a fault function runs, then checks the history.
//
// The package is for tests only: porcupine is a dependency of this
// package alone, which no public package of the module imports, so it
// never reaches the go.sum of a module that imports amqpidem or lock
// (scripts/check-user-module.sh checks that).
//
// What the model allows, and so what a passing check proves and what it
// does not, is described in docs/testing.md.
package linearizable
