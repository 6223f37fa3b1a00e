.PHONY: services test bench lint demo

# services starts local Redis and RabbitMQ if they are down (see scripts/services.sh).
services:
	bash scripts/services.sh

test: services
	go test -race -count=1 -timeout 20m ./...

bench:
	go test -run '^$$' -bench . -benchmem -count 1 ./...

lint:
	@unformatted="$$(gofmt -l .)"; \
	if [ -n "$$unformatted" ]; then echo "gofmt -l lists files that need gofmt -w:"; echo "$$unformatted"; exit 1; fi
	go vet ./...

# demo runs the example consumer against the local services.
demo: services
	go run ./examples/orders
