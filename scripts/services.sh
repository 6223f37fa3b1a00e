#!/usr/bin/env bash
# services.sh makes sure the Redis and RabbitMQ the integration tests use are
# up, starting local ones when they are down. It is idempotent: running
# services are left alone.
#
#   REDIS_ADDR=host:port     check that Redis instead of 127.0.0.1:6379 (never started)
#   AMQP_URL=amqp://...      check that RabbitMQ instead of 127.0.0.1:5672 (never started)
#
# Exits non-zero, after saying what to start, if a service is still unreachable.
set -uo pipefail

REDIS_CMD=(redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no
	--dir /var/lib/redis --logfile /var/log/redis/ci.log)
RABBIT_WAIT=${RABBIT_WAIT:-60} # seconds

say() { printf 'services: %s\n' "$*"; }

# split_hostport ADDR: prints "host port"; handles [v6]:port.
split_hostport() {
	local addr=$1 host port
	port=${addr##*:}
	host=${addr%:*}
	host=${host#[}
	host=${host%]}
	printf '%s %s\n' "${host:-127.0.0.1}" "$port"
}

# redis_ping HOST PORT: true if Redis there answers PING with PONG.
redis_ping() {
	timeout 3 bash -c '
		exec 3<>"/dev/tcp/$1/$2" || exit 1
		printf "*1\r\n\$4\r\nPING\r\n" >&3
		IFS= read -r -t 2 line <&3 || exit 1
		[[ $line == "+PONG"* ]]' _ "$1" "$2" 2>/dev/null
}

# port_open HOST PORT: true if something accepts TCP connections there.
port_open() {
	timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" 2>/dev/null
}

# amqp_ready HOST PORT: true if an AMQP 0-9-1 server there answers the
# protocol header with a method frame (frame type 1, Connection.Start).
amqp_ready() {
	timeout 5 bash -c '
		exec 3<>"/dev/tcp/$1/$2" || exit 1
		printf "AMQP\x00\x00\x09\x01" >&3
		IFS= read -r -d "" -n 1 -t 4 b <&3 || exit 1
		[[ $b == $'"'"'\x01'"'"' ]]' _ "$1" "$2" 2>/dev/null
}

# amqp_hostport URL: prints "host port" of an amqp:// or amqps:// URL.
amqp_hostport() {
	local url=$1 rest port=5672
	[[ $url == amqps://* ]] && port=5671
	rest=${url#*://}
	rest=${rest##*@}
	rest=${rest%%/*}
	rest=${rest%%\?*}
	if [[ $rest == \[*\]:* || ( $rest != \[* && $rest == *:* ) ]]; then
		split_hostport "$rest"
	else
		rest=${rest#[}
		printf '%s %s\n' "${rest%]}" "$port"
	fi
}

failed=0

# ---- Redis ----------------------------------------------------------------
if [[ -n ${REDIS_ADDR:-} ]]; then
	read -r host port < <(split_hostport "$REDIS_ADDR")
	if redis_ping "$host" "$port"; then
		say "Redis at REDIS_ADDR=$REDIS_ADDR answers PING"
	else
		say "Redis at REDIS_ADDR=$REDIS_ADDR does not answer PING."
		say "  Start Redis there, or unset REDIS_ADDR to use 127.0.0.1:6379."
		failed=1
	fi
elif redis_ping 127.0.0.1 6379; then
	say "Redis at 127.0.0.1:6379 answers PING; leaving it alone"
else
	if command -v redis-server >/dev/null; then
		say "Redis at 127.0.0.1:6379 is down; starting: $(printf '%q ' "${REDIS_CMD[@]}")"
		mkdir -p /var/lib/redis /var/log/redis
		"${REDIS_CMD[@]}" || say "redis-server exited with status $?"
		for _ in $(seq 50); do
			redis_ping 127.0.0.1 6379 && break
			sleep 0.2
		done
	else
		say "Redis at 127.0.0.1:6379 is down and redis-server is not installed"
	fi
	if redis_ping 127.0.0.1 6379; then
		say "Redis at 127.0.0.1:6379 answers PING"
	else
		say "Redis at 127.0.0.1:6379 still does not answer PING (see /var/log/redis/ci.log). Start it with:"
		say "  mkdir -p /var/lib/redis /var/log/redis && redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log"
		say "  or set REDIS_ADDR=host:port, or run: docker compose up -d redis"
		failed=1
	fi
fi

# ---- RabbitMQ -------------------------------------------------------------
if [[ -n ${AMQP_URL:-} ]]; then
	read -r host port < <(amqp_hostport "$AMQP_URL")
	if amqp_ready "$host" "$port"; then
		say "RabbitMQ at $host:$port (from AMQP_URL) answers AMQP"
	else
		say "RabbitMQ at $host:$port (from AMQP_URL) does not answer AMQP."
		say "  Start RabbitMQ there, or unset AMQP_URL to use 127.0.0.1:5672."
		failed=1
	fi
elif amqp_ready 127.0.0.1 5672; then
	say "RabbitMQ at 127.0.0.1:5672 answers AMQP; leaving it alone"
else
	if command -v rabbitmq-server >/dev/null; then
		if port_open 127.0.0.1 5672; then
			say "port 127.0.0.1:5672 is open but does not answer AMQP yet; waiting"
		else
			say "RabbitMQ at 127.0.0.1:5672 is down; starting: rabbitmq-server -detached"
			# Fails harmlessly if a node is already booting.
			rabbitmq-server -detached || say "rabbitmq-server -detached exited with status $?"
		fi
		if command -v rabbitmqctl >/dev/null; then
			say "waiting for RabbitMQ: rabbitmqctl await_startup (up to ${RABBIT_WAIT}s)"
			timeout $((RABBIT_WAIT + 5)) rabbitmqctl await_startup --timeout "$RABBIT_WAIT" >/dev/null 2>&1 ||
				say "rabbitmqctl await_startup did not succeed; polling the port"
		fi
		for _ in $(seq $((RABBIT_WAIT * 2))); do
			amqp_ready 127.0.0.1 5672 && break
			sleep 0.5
		done
	else
		say "RabbitMQ at 127.0.0.1:5672 is down and rabbitmq-server is not installed"
	fi
	if amqp_ready 127.0.0.1 5672; then
		say "RabbitMQ at 127.0.0.1:5672 answers AMQP"
	else
		say "RabbitMQ at 127.0.0.1:5672 still does not answer AMQP. Start it with:"
		say "  rabbitmq-server -detached && rabbitmqctl await_startup"
		say "  or set AMQP_URL=amqp://user:pass@host:port/, or run: docker compose up -d rabbitmq"
		failed=1
	fi
fi

exit "$failed"
