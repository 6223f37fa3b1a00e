.PHONY: services test bench lint demo chaos

# services starts local Redis and RabbitMQ if they are down (see scripts/services.sh).
services:
	bash scripts/services.sh

test: services
	go test -race -count=1 -timeout 20m ./...

# bench runs the lock and heartbeat micro benchmarks, then the end-to-end
# measurement of test/bench (issue 4): a bare amqp091-go consumer, amqpidem with
# unique and with duplicate messages, and the naive SET NX + SET approach, side
# by side on classic and quorum queues. It ends with "ratio <variant>/bare
# <queue type> 0.00" lines. About 5-10 minutes; flags go in BENCH_FLAGS, e.g.
#   make bench BENCH_FLAGS='-repeats 5 -cpuprofile unique.pprof'
#   make bench BENCH_FLAGS=-short      # a smoke run of a few seconds
# REDIS_ADDR and AMQP_URL pick other services than the local defaults.
BENCH_FLAGS ?=
bench: services
	go test -run '^$$' -bench . -benchmem -count 1 ./lock/ ./heartbeat/
	go run ./test/bench $(BENCH_FLAGS)

lint:
	@unformatted="$$(gofmt -l .)"; \
	if [ -n "$$unformatted" ]; then echo "gofmt -l lists files that need gofmt -w:"; echo "$$unformatted"; exit 1; fi
	go vet ./...

# demo runs the example consumer against the local services.
demo: services
	go run ./examples/orders

# chaos runs every fault-injection scenario of test/chaos at full size
# (CHAOS_FULL=1), scenario 6 included (it lowers the broker's consumer
# timeout for a minute and restores it): about 5 minutes. `make test` runs
# the same scenarios at short sizes. CHAOS_RESULTS=file also appends the
# scenario lines to file.
chaos: services
	CHAOS_FULL=1 go test -count=1 -timeout 30m -v -run '^TestChaos' ./test/chaos/
