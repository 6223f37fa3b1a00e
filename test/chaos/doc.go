// Package chaos is amqpidem's fault-injection suite: it tries to break the
// promise "each unique operation takes effect once, nothing is lost" on
// real processes, a real Redis, a real RabbitMQ and a PostgreSQL ledger.
//
// The scenarios are ordinary Go tests (scenarioNN_*_test.go, Linux only).
// They run at short sizes under `make test`, at full sizes with
// CHAOS_FULL=1 (`make chaos`). Consumers are separate processes built from
// cmd/consumer, so that they can be killed and paused; internal/ledger is
// the sink their handler writes to and the classification of every
// operation; internal/workload is the message plans and the publisher;
// internal/worker is the consumer itself. Scenarios 11a-11e run the
// consumers on the PostgreSQL store (pgstore) with a sink that absorbs
// nothing (pgrun_test.go; the run's classification and checks, shared
// with the DynamoDB scenarios, are effectrun_test.go). Scenario 16 runs the producer outbox's relay
// (pgstore.Relay) as separate processes built from cmd/relay. Scenarios
// 17a-17b run the consumers on the DynamoDB store (dynamostore) with a
// plain item per execution put in its TransactWriteItems (dynrun_test.go).
// Scenarios 15a-15d and 19 run the consumer-side outbox as a two-stage
// pipeline, 19 with stage A's staged publishes cut through toxiproxy.
// Scenario 21 plays a hostile publisher against signed consumers and the
// operator's `amqpidem dlq replay`, run as the built CLI.
// See README.md for what each scenario does and the results of a full
// run.
//
// There is nothing to import here: the package holds only tests.
package chaos
