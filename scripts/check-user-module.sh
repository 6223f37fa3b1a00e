#!/usr/bin/env bash
# check-user-module.sh checks what a module that imports amqpidem inherits:
# it makes a fresh module in a temporary directory that imports the public
# packages (amqpidem, its test kit amqpidemtest, heartbeat, lock) of this checkout, runs `go mod tidy`
# there, and fails if its go.sum names a test-only dependency of this
# repository: testcontainers, the Docker client (docker, moby), pgx, toxiproxy,
# zerolog or porcupine (test/linearizable's model checker). Those belong to
# the tests alone (internal/testenv/containers is
# a module of its own for that reason) and must never reach a user's go.sum.
#
# A second module imports pgstore as well: it gets pgx, its driver, and
# still none of the others. A third imports dynamostore: it gets the AWS SDK
# (aws-sdk-go-v2, smithy-go), which no other module may get, and none of the
# others either. Modules importing the Prometheus or the
# OpenTelemetry adapter get that adapter's dependencies and none of the
# other's, nor cobra (the CLI's). A module importing the console gets
# nothing more than the core's, and the core packages never import it.
#
# It prints the go.sum line and module counts. `make test` runs it.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
module=$(cd "$root" && go list -m)
forbidden='testcontainers|docker|moby|pgx|toxiproxy|zerolog|porcupine'
aws='aws'

tmp=$(mktemp -d "${TMPDIR:-/tmp}/check-user-module.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export GOWORK=off GOFLAGS=-mod=mod

# check NAME FORBIDDEN PACKAGE...: a fresh module in $tmp/NAME importing the
# packages must build and have no go.sum line matching FORBIDDEN.
check() {
	local name=$1 forbid=$2
	shift 2
	local dir="$tmp/$name" pkgs list
	pkgs=$(printf '%s, ' "$@")
	pkgs=${pkgs%, }
	mkdir "$dir"
	(
		cd "$dir"
		go mod init example.com/usermodule >/dev/null 2>&1
		go mod edit -require "$module@v0.0.0" -replace "$module=$root"
		{
			printf 'package main\n\nimport (\n'
			for p in "$@"; do printf '\t_ "%s/%s"\n' "$module" "$p"; done
			printf ')\n\nfunc main() {}\n'
		} >main.go
		if ! out=$(go mod tidy 2>&1); then
			printf 'check-user-module: go mod tidy failed in a module importing %s:\n%s\n' "$pkgs" "$out" >&2
			exit 1
		fi
		go build ./...
		lines=$(wc -l <go.sum | tr -d ' ')
		modules=$(cut -d' ' -f1 go.sum | sort -u | wc -l | tr -d ' ')
		if bad=$(cut -d' ' -f1 go.sum | sort -u | grep -E "$forbid"); then
			printf 'check-user-module: FAIL: a module importing %s has %s go.sum lines (%s modules), including test-only dependencies of %s:\n%s\n' \
				"$pkgs" "$lines" "$modules" "$module" "$bad" >&2
			printf 'check-user-module: see which package pulls them in with: go mod why -m <module> (in a module like the one above)\n' >&2
			exit 1
		fi
		list=${forbid//|/, }
		printf 'check-user-module: ok: a module importing %s has %s go.sum lines (%s modules), none of them %s\n' \
			"$pkgs" "$lines" "$modules" "$list"
	)
}

# The adapters' dependencies reach only the users of the adapter.
prom='prometheus'
otel='opentelemetry'
cli='cobra|pflag'
check core "$forbidden|$aws|$prom|$otel|$cli" amqpidem amqpidem/amqpidemtest heartbeat lock
# pgstore's users get pgx, and still none of the tests' dependencies.
check pgstore "${forbidden/|pgx/}|$aws|$prom|$otel|$cli" amqpidem pgstore
# dynamostore's get the AWS SDK, and none of the tests' dependencies nor pgx.
check dynamostore "$forbidden|$prom|$otel|$cli" amqpidem dynamostore
# ... and they do get it: else the pattern aws, forbidden above, names nothing.
if ! cut -d' ' -f1 "$tmp/dynamostore/go.sum" | grep -qE "$aws"; then
	printf 'check-user-module: FAIL: a module importing dynamostore has no go.sum line matching %s: fix the pattern\n' "$aws" >&2
	exit 1
fi
# promamqpidem's get Prometheus's client, otelamqpidem's the OpenTelemetry
# API, not its SDK (the application picks one; the tests that use it live in
# otelamqpidem/internal/sdktest for that reason).
check prometheus "$forbidden|$aws|$otel|$cli" amqpidem promamqpidem
check opentelemetry "$forbidden|$aws|$prom|$cli|opentelemetry.io/otel/sdk" amqpidem otelamqpidem
# The console's users (a package they mount in an admin server) get nothing
# the core's do not: html/template and embed are the standard library's.
check console "$forbidden|$aws|$prom|$otel|$cli" amqpidem console
# ... and the core never imports the console.
if deps=$(cd "$root" && go list -deps ./amqpidem ./amqpidem/amqpidemtest ./heartbeat ./lock | grep -E "^$module/(console|internal/operator)$"); then
	printf 'check-user-module: FAIL: the core packages import %s\n' "$deps" >&2
	exit 1
fi
