#!/usr/bin/env bash
# dynamodb-local.sh makes sure Amazon's DynamoDB Local answers for the
# tests on 127.0.0.1:8001, installing and starting it when it does not. It
# is idempotent: a server that answers is left alone. The tests run their
# DynamoDB suites on it and on minidyn (scripts/dynamo.sh, port 8000); see
# internal/testenv's DynamoLocalEndpoint and EachDynamo.
#
#   bash scripts/dynamodb-local.sh [start]   check, and install and start it on 127.0.0.1:8001 if needed
#   bash scripts/dynamodb-local.sh install   only install it (into DYNAMODB_LOCAL_DIR)
#   bash scripts/dynamodb-local.sh stop      stop the server this script started (its PID file)
#
#   DYNAMODB_LOCAL_ENDPOINT=http://host:port   check that server instead (never started)
#   DYNAMODB_LOCAL_DIR=dir                     where it is installed, and its log and PID file
#                                              (default: ${XDG_CACHE_HOME:-$HOME/.cache}/amqpidem/dynamodb-local)
#
# What it installs: DynamoDB Local 1.25.1 (DynamoDBLocal.jar and its
# DynamoDBLocal_lib), as the npm package amplify-dynamodb-simulator@2.9.30
# ships it under package/emulator/. `npm pack` fetches that package's
# tarball (no install, no scripts run) from the registry npm is configured
# with; this script checks the tarball's SHA-512 (the registry's
# "integrity") and the jar's SHA-256 against the values pinned below
# before unpacking the emulator directory into DYNAMODB_LOCAL_DIR/<version>.
# Nothing is written into the repository: DynamoDB Local is under Amazon's
# DynamoDB Local licence (LICENSE.txt beside the jar), and this project
# neither commits nor redistributes it; it is a test dependency each
# machine fetches, as Docker users pull amazon/dynamodb-local.
#
# How it runs: java (11 or later) with DynamoDB Local's own options
# -port 8001 -inMemory -disableTelemetry, and without -sharedDb: as its
# default, it keeps a database per access key ID and region, as if each
# were its own account, so the tests prove that their clients and the
# processes they start sign alike (testenv.DynamoAccessKeyID). DynamoDB
# Local has no option for the address it listens on, and would listen on
# every interface; scripts/dynamodb-local/Loopback.java, compiled with
# javac into DYNAMODB_LOCAL_DIR, starts it on 127.0.0.1 only. The heap is
# capped at 512 MB (-Xmx512m) and the serial collector spares the
# machine's cores. It runs daemonized (setsid), logging to
# DYNAMODB_LOCAL_DIR/dynamodb-local.log, its PID in
# DYNAMODB_LOCAL_DIR/dynamodb-local.pid. Its data lives in memory: a
# restart empties it. It answers about 2 seconds after the JVM starts.
#
# Needs: npm (first run only), java and javac 11 or later (Debian:
# apt-get install npm openjdk-17-jdk-headless), sha512sum or shasum.
# Exits non-zero, after saying what to do, if the server does not answer.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${DYNAMODB_LOCAL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/amqpidem/dynamodb-local}
log=$dir/dynamodb-local.log
pidfile=$dir/dynamodb-local.pid
host=127.0.0.1
port=8001

# The pin: the npm package, its tarball's integrity as the registry
# publishes it (npm view amplify-dynamodb-simulator@2.9.30 dist.integrity),
# and the DynamoDB Local it ships, with its jar's SHA-256.
npm_package=amplify-dynamodb-simulator@2.9.30
npm_integrity=sha512-xTeeRLvzEfqyd5lh3bH4c0kHvSHHmmhD5ZDsHFKAQ5g2Zl6JqlFdutaQhCLHzxEp6Ry1o7TB6niIoXuQAnSewQ==
ddb_version=1.25.1
jar_sha256=454305e9bc3e6ebcca5b62569869e31563b8d7e346474e94557b2600702146c7

home=$dir/$ddb_version
jvm_opts=(-Xmx512m -XX:+UseSerialGC)
ddb_opts=(-port "$port" -inMemory -disableTelemetry)

say() { printf 'dynamodb-local: %s\n' "$*"; }

# bounded, dynamo_ready, port_open and endpoint_hostport.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# sha FILE BITS: prints the hex SHA-BITS digest of FILE.
sha() {
	if command -v "sha$2sum" >/dev/null; then
		"sha$2sum" "$1" | cut -d' ' -f1
	else
		shasum -a "$2" "$1" | cut -d' ' -f1
	fi
}

# integrity FILE: prints FILE's npm integrity string (sha512-<base64>).
integrity() {
	local hex
	hex=$(sha "$1" 512) || return 1
	printf 'sha512-%s\n' "$(printf '%b' "$(printf '%s' "$hex" | sed 's/../\\x&/g')" | base64 | tr -d '\n')"
}

# installed: true if the pinned jar is in place, unaltered.
installed() {
	[[ -f $home/DynamoDBLocal.jar && -d $home/DynamoDBLocal_lib ]] && [[ $(sha "$home/DynamoDBLocal.jar" 256) == "$jar_sha256" ]]
}

# install: fetches the pinned package with npm pack, checks it and
# unpacks its emulator directory into $home, unless it is there already.
install() {
	local tmp tgz got
	installed && return 0
	if ! command -v npm >/dev/null; then
		say "npm is not on PATH: cannot fetch $npm_package (apt-get install npm; brew install node)" >&2
		return 1
	fi
	mkdir -p "$dir" || return 1
	tmp=$(mktemp -d "$dir/install.XXXXXX") || return 1
	say "fetching $npm_package (DynamoDB Local $ddb_version, about 57 MB) with npm pack" >&2
	if ! (cd "$tmp" && bounded 600 npm pack "$npm_package" --ignore-scripts --silent >/dev/null); then
		say "npm pack $npm_package failed" >&2
		rm -rf "$tmp"
		return 1
	fi
	tgz=$(ls "$tmp"/*.tgz 2>/dev/null | head -n 1)
	got=$(integrity "$tgz")
	if [[ $got != "$npm_integrity" ]]; then
		say "$npm_package's tarball has integrity $got, want $npm_integrity: not installing it" >&2
		rm -rf "$tmp"
		return 1
	fi
	mkdir -p "$tmp/x" && tar -xzf "$tgz" -C "$tmp/x" package/emulator || {
		rm -rf "$tmp"
		return 1
	}
	got=$(sha "$tmp/x/package/emulator/DynamoDBLocal.jar" 256)
	if [[ $got != "$jar_sha256" ]]; then
		say "the tarball's DynamoDBLocal.jar has SHA-256 $got, want $jar_sha256: not installing it" >&2
		rm -rf "$tmp"
		return 1
	fi
	rm -rf "$home"
	mv "$tmp/x/package/emulator" "$home" && rm -rf "$tmp" || return 1
	say "installed DynamoDB Local $ddb_version into $home" >&2
}

# launcher: compiles scripts/dynamodb-local/Loopback.java into
# $dir/launcher/<hash> if it is not there yet, and prints that directory.
launcher() {
	local src=$root/scripts/dynamodb-local/Loopback.java hash out
	hash=$( (cat "$src" && printf '%s' "$ddb_version") | sha /dev/stdin 256 | cut -c1-16)
	out=$dir/launcher/$hash
	if [[ ! -f $out/Loopback.class ]]; then
		if ! command -v javac >/dev/null; then
			say "javac is not on PATH: cannot compile $src (apt-get install openjdk-17-jdk-headless)" >&2
			return 1
		fi
		mkdir -p "$out.tmp" || return 1
		bounded 120 javac -nowarn -cp "$home/DynamoDBLocal.jar:$home/DynamoDBLocal_lib/*" -d "$out.tmp" "$src" >&2 || return 1
		rm -rf "$out" && mv "$out.tmp" "$out" || return 1
	fi
	printf '%s\n' "$out"
}

start() {
	local h p cp
	if [[ -n ${DYNAMODB_LOCAL_ENDPOINT:-} ]]; then
		read -r h p < <(endpoint_hostport "$DYNAMODB_LOCAL_ENDPOINT")
		if dynamo_ready "$h" "$p"; then
			say "DynamoDB Local at DYNAMODB_LOCAL_ENDPOINT=$DYNAMODB_LOCAL_ENDPOINT answers"
			return 0
		fi
		say "DynamoDB Local at DYNAMODB_LOCAL_ENDPOINT=$DYNAMODB_LOCAL_ENDPOINT does not answer."
		say "  Start it there, or unset DYNAMODB_LOCAL_ENDPOINT to use http://$host:$port."
		return 1
	fi
	if dynamo_ready "$host" "$port"; then
		say "DynamoDB Local at http://$host:$port answers; leaving it alone"
		return 0
	fi
	if port_open "$host" "$port"; then
		say "port $host:$port is open but does not answer DynamoDB requests: stop what listens there,"
		say "  or set DYNAMODB_LOCAL_ENDPOINT=http://host:port to a DynamoDB Local"
		return 1
	fi
	if ! command -v java >/dev/null; then
		say "java is not on PATH (apt-get install openjdk-17-jdk-headless; brew install openjdk),"
		say "  or set DYNAMODB_LOCAL_ENDPOINT=http://host:port to a running DynamoDB Local"
		return 1
	fi
	if ! install || ! cp=$(launcher); then
		say "could not install DynamoDB Local. Start one on $host:$port, or set DYNAMODB_LOCAL_ENDPOINT=http://host:port"
		return 1
	fi
	say "DynamoDB Local at http://$host:$port is down; starting DynamoDB Local $ddb_version (log $log)"
	local detach=()
	command -v setsid >/dev/null && detach=(setsid) # not on macOS; nohup alone does there
	(cd "$home" && exec "${detach[@]}" nohup java "${jvm_opts[@]}" -Djava.library.path="$home/DynamoDBLocal_lib" \
		-cp "$home/DynamoDBLocal.jar:$home/DynamoDBLocal_lib/*:$cp" Loopback "$host" "${ddb_opts[@]}" \
		>>"$log" 2>&1 </dev/null) &
	echo $! >"$pidfile"
	await_dynamo "DynamoDB Local" "$host" "$port" "$pidfile" "$log" 150
}

stop() { stop_pidfile "$pidfile" java; }

case ${1:-start} in
start) start ;;
install) install ;;
stop) stop ;;
*)
	say "usage: bash scripts/dynamodb-local.sh [start|install|stop]"
	exit 2
	;;
esac
