.PHONY: services test check-user-module alerts bench lint demo chaos linearizable browser screenshots

# CONTAINERS is the Docker fallback of internal/testenv: a program in a
# module of its own, so that testcontainers-go stays out of this module's
# go.mod and go.sum.
CONTAINERS := internal/testenv/containers

# services starts local Redis, RabbitMQ and PostgreSQL if they are down, and
# the two DynamoDB servers the DynamoDB tests run on: minidyn on port 8000
# (built by scripts/dynamo.sh) and Amazon's DynamoDB Local on port 8001
# (installed from npm into a cache directory and started by
# scripts/dynamodb-local.sh; needs npm, java and javac) (see
# scripts/services.sh; with Docker, `docker compose up -d --wait` instead).
services:
	bash scripts/services.sh

# test checks that a module importing amqpidem inherits none of the tests'
# dependencies and that the example alerting rules pass their unit tests,
# runs every test with the race detector, then the console's tests in
# Chromium (browser). The timeout is per test binary: test/chaos, the longest,
# takes 12 to 14 minutes under CI's load, and each batch scenario adds about
# a minute.
test: services check-user-module alerts
	go test -race -count=1 -timeout 30m ./...
	$(MAKE) --no-print-directory browser

# check-user-module fails if a fresh module importing amqpidem, heartbeat and
# lock gets testcontainers, the Docker client, pgx, toxiproxy, zerolog, porcupine,
# Prometheus, OpenTelemetry, cobra or the AWS SDK in its go.sum (one
# importing pgstore too: any of them but pgx; dynamostore: any but the AWS
# SDK; promamqpidem or otelamqpidem: any but their own), and prints their
# go.sum line counts.
check-user-module:
	bash scripts/check-user-module.sh

# alerts checks the example alerting rules of docs/alerts with promtool
# (promtool check rules) and runs their unit tests (promtool test rules).
# It uses promtool from PROMTOOL or PATH, else fetches Debian's with
# apt-get download into a cache directory, else says what to install
# (see scripts/promtool.sh).
alerts:
	bash scripts/promtool.sh

# bench runs the lock and heartbeat micro benchmarks, then the end-to-end
# measurement of test/bench: a bare amqp091-go consumer, amqpidem with
# unique and with duplicate messages, amqpidem whose handler stages one
# message per message (outbox) or publishes it itself with confirms
# (publish, the at-least-once baseline), and the naive SET NX + SET approach, side
# by side on classic and quorum queues, and on PostgreSQL (pgstore's TxHandler,
# unique and duplicate, against a hand-written INSERT ON CONFLICT consumer), and
# on DynamoDB (dynamostore's TxHandler, unique and duplicate, on the server of
# DYNAMODB_ENDPOINT, default minidyn's 127.0.0.1:8000). It ends with "ratio
# <variant>/bare <queue type> 0.00" lines, then "ratio outbox/unique <queue
# type> 0.00" and "ratio outbox/publish <queue type> 0.00", then issue 14's,
# 40's ("machine_us <variant> <queue type> 0.0": CPU per message of this
# process, redis-server, RabbitMQ and PostgreSQL where used; "machine_x
# unique <queue type> 0.00": unique's over bare's) and 26's figures, "ratio
# dynamo-unique/bare classic 0.00" and dynamo-duplicate's, then the producer
# outbox relay's "relay_msgs_per_s classic 0", "relay_p99_ms classic 0.0" and
# "relay_ordered_drain_ms 1000 0" (issue 34: ms for an ordered relay to drain
# 1,000 messages of one order key, "timeout" after -relay-ordered-timeout),
# then PostgreSQL's lines. About 10 minutes; flags go in
# BENCH_FLAGS, e.g.
#   make bench BENCH_FLAGS='-repeats 5 -cpuprofile unique.pprof'
#   make bench BENCH_FLAGS=-short      # a smoke run of a few seconds
# REDIS_ADDR, AMQP_URL, PG_DSN and DYNAMODB_ENDPOINT pick other services than
# the local defaults.
BENCH_FLAGS ?=
bench:
	bash scripts/services.sh
	go test -run '^$$' -bench . -benchmem -count 1 ./lock/ ./heartbeat/
	go run ./test/bench $(BENCH_FLAGS)

# lint: gofmt, go vet and tidy go.mod and go.sum, in this module and in the
# nested module of $(CONTAINERS), which `go vet ./...` here does not reach.
lint:
	@unformatted="$$(gofmt -l .)"; \
	if [ -n "$$unformatted" ]; then echo "gofmt -l lists files that need gofmt -w:"; echo "$$unformatted"; exit 1; fi
	go vet ./...
	go mod tidy -diff
	cd $(CONTAINERS) && go vet ./... && go mod tidy -diff
	cd console/internal/browser && GOWORK=off go vet ./... && GOWORK=off go mod tidy -diff

# demo runs the example consumer against the local services.
demo:
	bash scripts/services.sh redis rabbitmq
	go run ./examples/orders

# linearizable records every operation of concurrent clients on each store
# while faults run (memory; Redis on a redis-server of its own, killed with
# SIGKILL and restarted from its AOF, stopped with SIGSTOP, or reached
# through toxiproxy with latency and cuts; a Redis Sentinel failover with
# Replicas 1, which must be ok, and without, which must be a violation;
# pgstore (record-row leases, and leases held by TxHandler's transactions)
# with its backends terminated, and on a PostgreSQL of its own
# restarted in immediate mode; dynamostore on minidyn and DynamoDB Local
# with call timeouts) and
# checks each history with porcupine against the model of one key's record
# (test/linearizable, docs/testing.md), at full size: about a minute per
# store and fault. It prints "linearizable <store>-<fault> ops=N keys=K
# clients=C result=ok|violation checked_ms=X" lines, and on a violation
# writes the history and porcupine's visualization under
# LINEARIZABLE_DIR (default $$TMPDIR/amqpidem-linearizable). `make test` runs
# the same tests at a short size (go test ./... without LINEARIZABLE_FULL).
linearizable: services
	@out=$$(mktemp); \
	LINEARIZABLE_FULL=1 go test -count=1 -timeout 30m -v -run 'TestMemory|TestMutations|TestRedis|TestRedisToxiproxy|TestRedisSentinel|TestPostgres|TestPostgresRestart|TestDynamo' ./test/linearizable/ >$$out 2>&1; rc=$$?; \
	grep -E '^(linearizable |--- |ok|FAIL)' $$out; [ $$rc = 0 ] || tail -n 60 $$out; rm -f $$out; exit $$rc

# chaos runs every fault-injection scenario of test/chaos at full size
# (CHAOS_FULL=1), scenario 6 included (it lowers the broker's consumer
# timeout for a minute and restores it): about 10 minutes. `make test` runs
# the same scenarios at short sizes. CHAOS_RESULTS=file also appends the
# scenario lines to file.
chaos: services
	CHAOS_FULL=1 go test -count=1 -timeout 30m -v -run '^TestChaos' ./test/chaos/

# browser runs the console's tests in Chromium (chromedp; Debian's chromium
# package, or CHROMIUM=path; scripts/chromium.sh finds it, or installs it
# as root on Debian), in their own module so that chromedp stays out of
# this module's go.mod (see console/internal/browser). make test runs it.
browser: services
	chromium=$$(bash scripts/chromium.sh) && cd console/internal/browser && \
		CHROMIUM=$$chromium GOWORK=off go test -count=1 ./...

# screenshots runs the browser tests writing their screenshots into
# docs/images, where docs/console.md and the README show them (other runs
# write them into a temporary directory).
screenshots: services
	chromium=$$(bash scripts/chromium.sh) && cd console/internal/browser && \
		CHROMIUM=$$chromium SCREENSHOTS=1 GOWORK=off go test -count=1 ./...
