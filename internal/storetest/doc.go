// Package storetest is the conformance suite every lock.Store passes: the
// same state machine, answers and limits whatever the backend (the memory
// store, standalone Redis, a Redis Cluster, Redis behind Sentinel). It
// guarantees nothing by itself; the guarantees are lock's, and this suite is
// where they are shown.
package storetest
