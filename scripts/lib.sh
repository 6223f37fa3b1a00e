# lib.sh holds what scripts/services.sh and scripts/dynamo.sh share; they
# source it.

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
