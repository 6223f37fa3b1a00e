// Package metrics tests what promamqpidem exports of pgstore's producer
// outbox relay, against the real PostgreSQL: a package of its own, as a
// test of promamqpidem importing pgstore (or of pgstore importing
// promamqpidem) would put pgx (or Prometheus) in the go.sum of the other's
// users (scripts/check-user-module.sh). It has no code but its tests.
package metrics
