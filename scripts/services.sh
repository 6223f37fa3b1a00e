#!/usr/bin/env bash
# shellcheck disable=SC2016 # the bash -c scripts read their arguments as $1 and $2
# services.sh makes sure the services the tests use are up, starting local
# ones when they are down. It is idempotent: running services are left alone.
#
#   bash scripts/services.sh [redis] [rabbitmq] [postgres] [dynamodb] [dynamodb-local]   (default: all five)
#
# Redis and RabbitMQ serve every integration test (and the demo); PostgreSQL,
# database "test" with trust authentication, serves the pgstore tests and
# example and holds the ledger of the test/chaos scenarios; two DynamoDB
# servers serve the DynamoDB tests, which run on both: minidyn
# (scripts/dynamo.sh builds and starts it on 127.0.0.1:8000,
# DYNAMODB_ENDPOINT=http://host:port checks another) and Amazon's DynamoDB
# Local (scripts/dynamodb-local.sh installs it from npm into a cache directory
# and starts it on 127.0.0.1:8001, DYNAMODB_LOCAL_ENDPOINT checks another).
# What it checks and how it starts each:
#
#   REDIS_ADDR=host:port     check that Redis instead of 127.0.0.1:6379 (never started)
#   AMQP_URL=amqp://...      check that RabbitMQ instead of 127.0.0.1:5672 (never started)
#   PG_DSN=postgres://...    check that PostgreSQL instead of 127.0.0.1:5432 (never started;
#                            CHAOS_PG_DSN, its older name, is read when PG_DSN is not set)
#   RABBIT_WAIT=60           seconds to wait for a starting RabbitMQ
#   REDIS_DIR=dir            where a Redis started by a user other than root keeps
#                            its files and log (default: $TMPDIR/amqpidem-redis-$UID)
#
# As root (CI, a Debian or Ubuntu machine with the packages installed) it
# starts redis-server (--dir /var/lib/redis, log /var/log/redis/ci.log),
# rabbitmq-server -detached and pg_ctlcluster, and creates the database "test"
# if it is missing. As another user it starts redis-server in REDIS_DIR and
# rabbitmq-server -detached where RabbitMQ is installed for that user (macOS
# with Homebrew, say), and otherwise says what to run with sudo. It needs
# bash 3.2 or later and no timeout(1): every probe is bounded by the script
# itself.
#
# Exits non-zero, after saying what to start, if a service is still
# unreachable. With Docker instead, `docker compose up -d --wait` starts Redis,
# RabbitMQ, PostgreSQL and a DynamoDB Local in minidyn's place on the same
# ports (docker-compose.yml); the tests' second DynamoDB server, on 8001, then
# comes from scripts/dynamodb-local.sh or internal/testenv's Docker fallback.
set -uo pipefail

RABBIT_WAIT=${RABBIT_WAIT:-60} # seconds
uid=$(id -u)

say() { printf 'services: %s\n' "$*"; }

# bounded SECS CMD [ARG...] (kills CMD after SECS seconds), port_open HOST PORT.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# split_hostport ADDR: prints "host port"; handles [v6]:port.
split_hostport() {
	local addr=$1 host port
	port=${addr##*:}
	host=${addr%:*}
	host=${host#[}
	host=${host%]}
	printf '%s %s\n' "${host:-127.0.0.1}" "$port"
}

# url_hostport URL DEFAULT_PORT: prints "host port" of a URL such as
# amqp://user:pass@host:port/vhost or postgres://user@host:port/db?opts.
url_hostport() {
	local url=$1 port=$2 rest
	rest=${url#*://}
	rest=${rest%%/*}
	rest=${rest%%\?*}
	rest=${rest##*@}
	if [[ $rest == \[*\]:* || ($rest != \[* && $rest == *:*) ]]; then
		split_hostport "$rest"
	else
		rest=${rest#[}
		rest=${rest%]}
		printf '%s %s\n' "${rest:-127.0.0.1}" "$port"
	fi
}

# redis_ping HOST PORT: true if Redis there answers PING with PONG.
redis_ping() {
	bounded 3 bash -c '
		exec 3<>"/dev/tcp/$1/$2" || exit 1
		printf "*1\r\n\$4\r\nPING\r\n" >&3
		IFS= read -r -t 2 line <&3 || exit 1
		[[ $line == "+PONG"* ]]' _ "$1" "$2" 2>/dev/null
}

# amqp_ready HOST PORT: true if an AMQP 0-9-1 server there answers the
# protocol header with a method frame (frame type 1, Connection.Start).
amqp_ready() {
	bounded 5 bash -c '
		exec 3<>"/dev/tcp/$1/$2" || exit 1
		printf "AMQP\x00\x00\x09\x01" >&3
		IFS= read -r -d "" -n 1 -t 4 b <&3 || exit 1
		[[ $b == $'"'"'\x01'"'"' ]]' _ "$1" "$2" 2>/dev/null
}

# pg_ready HOST PORT: true if a PostgreSQL server there accepts connections:
# pg_isready when installed, else an SSLRequest answered with S or N.
pg_ready() {
	if command -v pg_isready >/dev/null; then
		bounded 5 pg_isready -q -h "$1" -p "$2" -t 3
		return
	fi
	bounded 3 bash -c '
		exec 3<>"/dev/tcp/$1/$2" || exit 1
		printf "\x00\x00\x00\x08\x04\xd2\x16\x2f" >&3
		IFS= read -r -d "" -n 1 -t 2 b <&3 || exit 1
		[[ $b == S || $b == N ]]' _ "$1" "$2" 2>/dev/null
}

# is_debian_rabbitmq: true if rabbitmq-server is Debian's wrapper, which
# only root or the rabbitmq user may run (others get a foreground node
# started as themselves, then an error).
is_debian_rabbitmq() {
	[[ -e /usr/lib/rabbitmq/bin/rabbitmq-script-wrapper ]] && id -u rabbitmq >/dev/null 2>&1
}

failed=0

# ---- Redis ----------------------------------------------------------------
check_redis() {
	local host port dir log i
	if [[ -n ${REDIS_ADDR:-} ]]; then
		read -r host port < <(split_hostport "$REDIS_ADDR")
		if redis_ping "$host" "$port"; then
			say "Redis at REDIS_ADDR=$REDIS_ADDR answers PING"
		else
			say "Redis at REDIS_ADDR=$REDIS_ADDR does not answer PING."
			say "  Start Redis there, or unset REDIS_ADDR to use 127.0.0.1:6379."
			failed=1
		fi
		return
	fi
	if redis_ping 127.0.0.1 6379; then
		say "Redis at 127.0.0.1:6379 answers PING; leaving it alone"
		return
	fi
	if [[ $uid == 0 ]]; then
		dir=/var/lib/redis
		log=/var/log/redis/ci.log
	else
		dir=${REDIS_DIR:-${TMPDIR:-/tmp}/amqpidem-redis-$uid}
		log=$dir/redis.log
	fi
	local cmd=(redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no
		--dir "$dir" --logfile "$log" --pidfile "$dir/redis.pid")
	if command -v redis-server >/dev/null; then
		say "Redis at 127.0.0.1:6379 is down; starting: $(printf '%q ' "${cmd[@]}")"
		if mkdir -p "$dir" "$(dirname "$log")"; then
			bounded 10 "${cmd[@]}" || say "redis-server exited with status $?"
			for ((i = 0; i < 50; i++)); do
				redis_ping 127.0.0.1 6379 && break
				sleep 0.2
			done
		fi
	else
		say "Redis at 127.0.0.1:6379 is down and redis-server is not installed"
	fi
	if redis_ping 127.0.0.1 6379; then
		say "Redis at 127.0.0.1:6379 answers PING"
	else
		say "Redis at 127.0.0.1:6379 still does not answer PING (see $log). Start it with:"
		say "  mkdir -p $(printf '%q' "$dir") && $(printf '%q ' "${cmd[@]}")"
		say "  (install it first if needed: apt-get install redis-server; brew install redis)"
		say "  or set REDIS_ADDR=host:port, or run: docker compose up -d --wait redis"
		failed=1
	fi
}

# ---- RabbitMQ -------------------------------------------------------------
check_rabbitmq() {
	local host port i
	if [[ -n ${AMQP_URL:-} ]]; then
		read -r host port < <(url_hostport "$AMQP_URL" "$([[ $AMQP_URL == amqps://* ]] && echo 5671 || echo 5672)")
		if amqp_ready "$host" "$port"; then
			say "RabbitMQ at $host:$port (from AMQP_URL) answers AMQP"
		else
			say "RabbitMQ at $host:$port (from AMQP_URL) does not answer AMQP."
			say "  Start RabbitMQ there, or unset AMQP_URL to use 127.0.0.1:5672."
			failed=1
		fi
		return
	fi
	if amqp_ready 127.0.0.1 5672; then
		say "RabbitMQ at 127.0.0.1:5672 answers AMQP; leaving it alone"
		return
	fi
	local sudo="" started=0
	[[ $uid == 0 ]] || sudo="sudo "
	if ! command -v rabbitmq-server >/dev/null; then
		say "RabbitMQ at 127.0.0.1:5672 is down and rabbitmq-server is not installed"
	elif [[ $uid != 0 ]] && is_debian_rabbitmq && [[ $uid != "$(id -u rabbitmq)" ]]; then
		say "RabbitMQ at 127.0.0.1:5672 is down; only root or the rabbitmq user can start this installation"
	elif port_open 127.0.0.1 5672; then
		say "port 127.0.0.1:5672 is open but does not answer AMQP yet; waiting"
		started=1
	else
		say "RabbitMQ at 127.0.0.1:5672 is down; starting: rabbitmq-server -detached"
		# Fails harmlessly if a node is already booting.
		if bounded 60 rabbitmq-server -detached; then
			started=1
		else
			say "rabbitmq-server -detached exited with status $?"
		fi
	fi
	if [[ $started == 1 ]]; then
		if command -v rabbitmqctl >/dev/null; then
			say "waiting for RabbitMQ: rabbitmqctl await_startup (up to ${RABBIT_WAIT}s)"
			bounded $((RABBIT_WAIT + 5)) rabbitmqctl await_startup --timeout "$RABBIT_WAIT" >/dev/null 2>&1 ||
				say "rabbitmqctl await_startup did not succeed; polling the port"
		fi
		for ((i = 0; i < RABBIT_WAIT * 2; i++)); do
			amqp_ready 127.0.0.1 5672 && break
			sleep 0.5
		done
	fi
	if amqp_ready 127.0.0.1 5672; then
		say "RabbitMQ at 127.0.0.1:5672 answers AMQP"
	else
		say "RabbitMQ at 127.0.0.1:5672 still does not answer AMQP. Start it with:"
		say "  ${sudo}rabbitmq-server -detached && ${sudo}rabbitmqctl await_startup"
		say "  (install it first if needed: apt-get install rabbitmq-server; brew install rabbitmq)"
		say "  or set AMQP_URL=amqp://user:pass@host:port/, or run: docker compose up -d --wait rabbitmq"
		failed=1
	fi
}

# ---- PostgreSQL -----------------------------------------------------------
check_postgres() {
	local host port i
	local var=PG_DSN
	[[ -n ${PG_DSN:-} || -z ${CHAOS_PG_DSN:-} ]] || var=CHAOS_PG_DSN
	if [[ -n ${!var:-} ]]; then
		read -r host port < <(url_hostport "${!var}" 5432)
		if pg_ready "$host" "$port"; then
			say "PostgreSQL at $host:$port (from $var) accepts connections"
		else
			say "PostgreSQL at $host:$port (from $var) does not accept connections."
			say "  Start PostgreSQL there, or unset $var to use 127.0.0.1:5432."
			failed=1
		fi
		return
	fi
	local up=0
	if pg_ready 127.0.0.1 5432; then
		say "PostgreSQL at 127.0.0.1:5432 accepts connections; leaving it alone"
		up=1
	elif [[ $uid == 0 ]] && command -v pg_lsclusters >/dev/null && command -v pg_ctlcluster >/dev/null; then
		local ver name cport status
		while read -r ver name cport status _; do
			[[ $cport == 5432 && $status != online* ]] || continue
			say "PostgreSQL at 127.0.0.1:5432 is down; starting: pg_ctlcluster $ver $name start"
			bounded 60 pg_ctlcluster "$ver" "$name" start || say "pg_ctlcluster exited with status $?"
		done < <(pg_lsclusters --no-header 2>/dev/null)
		for ((i = 0; i < 50; i++)); do
			pg_ready 127.0.0.1 5432 && break
			sleep 0.2
		done
	else
		say "PostgreSQL at 127.0.0.1:5432 is down"
	fi
	if ! pg_ready 127.0.0.1 5432; then
		say "PostgreSQL at 127.0.0.1:5432 still does not accept connections. Start it with:"
		if command -v pg_ctlcluster >/dev/null; then
			say "  $([[ $uid == 0 ]] || echo 'sudo ')pg_ctlcluster 15 main start   (pg_lsclusters lists the clusters)"
		else
			say "  brew services start postgresql@15   (or pg_ctl -D <data dir> start)"
		fi
		say "  with trust authentication for 127.0.0.1 and a database named test,"
		say "  or set PG_DSN=postgres://user@host:port/db, or run: docker compose up -d --wait postgres"
		failed=1
		return
	fi
	[[ $up == 1 ]] || say "PostgreSQL at 127.0.0.1:5432 accepts connections"
	# The chaos scenarios use the database "test" as the user postgres.
	if command -v psql >/dev/null; then
		local has
		has=$(bounded 10 psql -X -q -A -t -h 127.0.0.1 -U postgres -d postgres \
			-c "SELECT 1 FROM pg_database WHERE datname = 'test'" 2>&1)
		if [[ $has == 1 ]]; then
			:
		elif [[ $has == "" ]]; then
			say "creating the database test: createdb -h 127.0.0.1 -U postgres test"
			bounded 10 createdb -h 127.0.0.1 -U postgres test || {
				say "createdb failed; create the database test for the user postgres by hand"
				failed=1
			}
		else
			say "cannot log in as postgres to 127.0.0.1:5432 without a password: $has"
			say "  the tests use postgres://postgres@127.0.0.1:5432/test (trust authentication); set PG_DSN otherwise"
			failed=1
		fi
	fi
}

# ---- DynamoDB -------------------------------------------------------------
check_dynamodb() {
	bash "$(dirname "${BASH_SOURCE[0]}")/dynamo.sh" start || failed=1
}

check_dynamodb_local() {
	bash "$(dirname "${BASH_SOURCE[0]}")/dynamodb-local.sh" start || failed=1
}

if [[ $# == 0 ]]; then
	set -- redis rabbitmq postgres dynamodb dynamodb-local
fi
for s in "$@"; do
	case $s in
	redis) check_redis ;;
	rabbitmq) check_rabbitmq ;;
	postgres) check_postgres ;;
	dynamodb) check_dynamodb ;;
	dynamodb-local) check_dynamodb_local ;;
	*)
		say "unknown service $s: want redis, rabbitmq, postgres, dynamodb or dynamodb-local"
		failed=1
		;;
	esac
done

exit "$failed"
