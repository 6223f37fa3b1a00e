# shellcheck shell=bash disable=SC2016 # the bash -c scripts read their arguments as $1 and $2
# lib.sh holds what scripts/services.sh, scripts/dynamo.sh and
# scripts/dynamodb-local.sh share; they source it.

# bounded SECS CMD [ARG...]: runs CMD and returns its status, or kills it
# and returns 124 (as timeout(1) does) once SECS seconds have passed.
bounded() {
	local secs=$1 pid i
	shift
	"$@" &
	pid=$!
	for ((i = 0; i < secs * 10; i++)); do
		if ! kill -0 "$pid" 2>/dev/null; then
			wait "$pid"
			return
		fi
		sleep 0.1
	done
	kill -KILL "$pid" 2>/dev/null
	wait "$pid" 2>/dev/null
	return 124
}

# dynamo_ready HOST PORT: true if a DynamoDB-compatible server there answers
# DescribeTable of a table that does not exist with ResourceNotFoundException,
# or another error of the DynamoDB JSON protocol (a "__type").
dynamo_ready() {
	bounded 5 bash -c '
		exec 3<>"/dev/tcp/$1/$2" || exit 1
		body="{\"TableName\":\"amqpidem-probe-no-such-table\"}"
		printf "POST / HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/x-amz-json-1.0\r\nX-Amz-Target: DynamoDB_20120810.DescribeTable\r\nAuthorization: AWS4-HMAC-SHA256 Credential=probe/20200101/us-east-1/dynamodb/aws4_request, SignedHeaders=host, Signature=0\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" "$1" "$2" "${#body}" "$body" >&3
		reply=""
		while IFS= read -r -t 4 line <&3; do reply+=$line; done
		reply+=$line # a body without a final newline (DynamoDB Local)
		[[ $reply == *ResourceNotFoundException* || $reply == *\"__type\"* ]]' _ "$1" "$2" 2>/dev/null
}

# port_open HOST PORT: true if something accepts TCP connections there.
port_open() {
	bounded 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" 2>/dev/null
}

# endpoint_hostport URL: prints "host port" of http://host:port[/...].
endpoint_hostport() {
	local rest=${1#*://}
	rest=${rest%%/*}
	local h=${rest%:*} p=${rest##*:}
	[[ $rest == *:* ]] || p=80
	h=${h#[}
	h=${h%]}
	printf '%s %s\n' "$h" "$p"
}

# await_dynamo WHAT HOST PORT PIDFILE LOG TRIES: waits up to TRIES x 0.2 s
# for the server started with its PID in PIDFILE to answer at HOST:PORT
# (dynamo_ready), giving up early if that process ends; says so (WHAT
# names it), with the end of LOG when it did not answer.
await_dynamo() {
	local what=$1 host=$2 port=$3 pidfile=$4 log=$5 tries=$6 i
	for ((i = 0; i < tries; i++)); do
		dynamo_ready "$host" "$port" && break
		kill -0 "$(cat "$pidfile")" 2>/dev/null || break
		sleep 0.2
	done
	if dynamo_ready "$host" "$port"; then
		say "$what at http://$host:$port answers (PID $(cat "$pidfile"))"
		return 0
	fi
	say "$what did not answer on $host:$port; the end of $log:"
	tail -n 20 "$log" 2>/dev/null | sed 's/^/  /'
	return 1
}

# stop_pidfile PIDFILE COMM: stops the process whose PID is in PIDFILE, if
# it still runs and its command name begins with COMM (not another process
# that got its PID since), and removes PIDFILE.
stop_pidfile() {
	local pidfile=$1 comm=$2 pid
	if [[ ! -s $pidfile ]]; then
		say "no PID file at $pidfile: nothing started by this script"
		return 0
	fi
	pid=$(cat "$pidfile")
	if kill -0 "$pid" 2>/dev/null && [[ $(cat "/proc/$pid/comm" 2>/dev/null || echo "$comm") == "$comm"* ]]; then
		kill "$pid" && say "stopped PID $pid"
	else
		say "PID $pid is not running"
	fi
	rm -f "$pidfile"
}
