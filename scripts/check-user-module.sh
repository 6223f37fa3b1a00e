#!/usr/bin/env bash
# check-user-module.sh checks what a module that imports amqpidem inherits:
# it makes a fresh module in a temporary directory that imports the public
# packages (amqpidem, heartbeat, lock) of this checkout, runs `go mod tidy`
# there, and fails if its go.sum names a test-only dependency of this
# repository: testcontainers, the Docker client (docker, moby), pgx, toxiproxy
# or zerolog. Those belong to the tests alone (internal/testenv/containers is
# a module of its own for that reason) and must never reach a user's go.sum.
#
# It prints the go.sum line and module counts. `make test` runs it.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
module=$(cd "$root" && go list -m)
forbidden='testcontainers|docker|moby|pgx|toxiproxy|zerolog'

tmp=$(mktemp -d "${TMPDIR:-/tmp}/check-user-module.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

export GOWORK=off GOFLAGS=-mod=mod
cd "$tmp"
go mod init example.com/usermodule >/dev/null 2>&1
go mod edit -require "$module@v0.0.0" -replace "$module=$root"
cat >main.go <<GO
package main

import (
	_ "$module/amqpidem"
	_ "$module/heartbeat"
	_ "$module/lock"
)

func main() {}
GO
if ! out=$(go mod tidy 2>&1); then
	printf 'check-user-module: go mod tidy failed in a module importing %s:\n%s\n' "$module" "$out" >&2
	exit 1
fi
go build ./...

lines=$(wc -l <go.sum | tr -d ' ')
modules=$(cut -d' ' -f1 go.sum | sort -u | wc -l | tr -d ' ')
if bad=$(cut -d' ' -f1 go.sum | sort -u | grep -E "$forbidden"); then
	printf 'check-user-module: FAIL: a module importing amqpidem, heartbeat and lock has %s go.sum lines (%s modules), including test-only dependencies of %s:\n%s\n' \
		"$lines" "$modules" "$module" "$bad" >&2
	printf 'check-user-module: see which package pulls them in with: go mod why -m <module> (in a module like the one above)\n' >&2
	exit 1
fi
printf 'check-user-module: ok: a module importing amqpidem, heartbeat and lock has %s go.sum lines (%s modules), none of them %s\n' \
	"$lines" "$modules" "${forbidden//|/, }"
