.PHONY: services test bench lint demo

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
