#!/usr/bin/env bash
# shellcheck disable=SC2016 # the bash -c scripts read their arguments as $1 and $2
# dynamo.sh makes sure a DynamoDB-compatible server answers for the tests,
# building and starting a local one when none does. It is idempotent: a
# server that answers is left alone.
#
#   bash scripts/dynamo.sh [start]   check, and start one on 127.0.0.1:8000 if needed
#   bash scripts/dynamo.sh stop      stop the server this script started (its PID file)
#
#   DYNAMODB_ENDPOINT=http://host:port   check that server instead (never started)
#   DYNAMO_DIR=dir                       where the server's binary, log and PID file
#                                        live (default: ${XDG_CACHE_HOME:-$HOME/.cache}/amqpidem/dynamo)
#
# The server is the HTTP server of github.com/truora/minidyn, an open-source
# in-memory DynamoDB, at the version pinned in scripts/dynamo/go.mod and
# go.sum, wrapped by scripts/dynamo/main.go. It is built with the go command
# (from the Go module proxy, or the module cache) into DYNAMO_DIR/bin,
# keyed by the hash of those files, so a change of the pin builds anew. It
# runs daemonized (setsid), logging to DYNAMO_DIR/dynamo.log, its PID in
# DYNAMO_DIR/dynamo.pid. Its data lives in memory: a restart empties it.
# Amazon's DynamoDB Local, whose licence is not open source, is the tests'
# second server, on port 8001: scripts/dynamodb-local.sh installs it into a
# cache directory and starts it (users with Docker can also run it here,
# on port 8000, instead of minidyn: docker compose up -d --wait dynamodb).
#
# "Answers" means a DescribeTable request of the DynamoDB JSON protocol
# gets ResourceNotFoundException, or another error of that protocol (a
# "__type"), back: something that speaks DynamoDB.
# Exits non-zero, after saying what to start, if none answers.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${DYNAMO_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/amqpidem/dynamo}
log=$dir/dynamo.log
pidfile=$dir/dynamo.pid
host=127.0.0.1
port=8000

say() { printf 'dynamo: %s\n' "$*"; }

# bounded, dynamo_ready, port_open and endpoint_hostport.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# build: builds the pinned server into $dir/bin/<hash>/dynamo-server if it
# is not there yet, and prints its path.
build() {
	local src=$root/scripts/dynamo hash bin
	hash=$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-16)
	bin=$dir/bin/$hash/dynamo-server
	if [[ ! -x $bin ]]; then
		if ! command -v go >/dev/null; then
			say "the go command is not on PATH: cannot build the server" >&2
			return 1
		fi
		say "building the server (github.com/truora/minidyn, pinned in scripts/dynamo/go.mod) into $bin" >&2
		mkdir -p "$(dirname "$bin")" || return 1
		(cd "$src" && GOWORK=off GOFLAGS=-mod=readonly bounded 300 go build -o "$bin.tmp" .) >&2 || return 1
		mv "$bin.tmp" "$bin" || return 1
	fi
	printf '%s\n' "$bin"
}

start() {
	local h p bin
	if [[ -n ${DYNAMODB_ENDPOINT:-} ]]; then
		read -r h p < <(endpoint_hostport "$DYNAMODB_ENDPOINT")
		if dynamo_ready "$h" "$p"; then
			say "DynamoDB at DYNAMODB_ENDPOINT=$DYNAMODB_ENDPOINT answers"
			return 0
		fi
		say "DynamoDB at DYNAMODB_ENDPOINT=$DYNAMODB_ENDPOINT does not answer."
		say "  Start it there, or unset DYNAMODB_ENDPOINT to use http://$host:$port."
		return 1
	fi
	if dynamo_ready "$host" "$port"; then
		say "DynamoDB at http://$host:$port answers; leaving it alone"
		return 0
	fi
	if port_open "$host" "$port"; then
		say "port $host:$port is open but does not answer DynamoDB requests: stop what listens there,"
		say "  or set DYNAMODB_ENDPOINT=http://host:port to a DynamoDB-compatible server"
		return 1
	fi
	mkdir -p "$dir" || return 1
	if ! bin=$(build); then
		say "building the server failed. Start a DynamoDB-compatible server on $host:$port, e.g.:"
		say "  docker compose up -d --wait dynamodb"
		say "  or set DYNAMODB_ENDPOINT=http://host:port"
		return 1
	fi
	say "DynamoDB at http://$host:$port is down; starting $bin (log $log)"
	local detach=()
	command -v setsid >/dev/null && detach=(setsid) # not on macOS; nohup alone does there
	"${detach[@]}" nohup "$bin" -addr "$host:$port" >>"$log" 2>&1 </dev/null &
	echo $! >"$pidfile"
	await_dynamo "DynamoDB" "$host" "$port" "$pidfile" "$log" 50
}

stop() { stop_pidfile "$pidfile" dynamo-server; }

case ${1:-start} in
start) start ;;
stop) stop ;;
*)
	say "usage: bash scripts/dynamo.sh [start|stop]"
	exit 2
	;;
esac
