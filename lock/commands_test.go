package lock_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/testenv"
	"github.com/amqpidem/amqpidem/lock"
)

// monitored is a command MONITOR showed: who ran it ("lua" for a script,
// else the client's address), and its arguments, the command's name first.
type monitored struct {
	source string
	args   []string
}

// parseMonitor reads one MONITOR line: a timestamp, [db source], then the
// arguments, each quoted with \" \\ and \xHH escapes.
func parseMonitor(line string) (monitored, bool) {
	_, rest, ok := strings.Cut(line, "[")
	if !ok {
		return monitored{}, false
	}
	head, rest, ok := strings.Cut(rest, "] ")
	if !ok {
		return monitored{}, false
	}
	_, source, _ := strings.Cut(head, " ")
	m := monitored{source: source}
	for {
		i := strings.IndexByte(rest, '"')
		if i < 0 {
			break
		}
		rest = rest[i+1:]
		var b strings.Builder
		for len(rest) > 0 && rest[0] != '"' {
			if rest[0] == '\\' && len(rest) > 1 {
				if rest[1] == 'x' && len(rest) > 3 {
					n, _ := strconv.ParseUint(rest[2:4], 16, 8)
					b.WriteByte(byte(n))
					rest = rest[4:]
					continue
				}
				b.WriteByte(rest[1])
				rest = rest[2:]
				continue
			}
			b.WriteByte(rest[0])
			rest = rest[1:]
		}
		if len(rest) > 0 {
			rest = rest[1:]
		}
		m.args = append(m.args, b.String())
	}
	return m, len(m.args) > 0
}

// monitorKeys runs f under MONITOR, on a connection of its own to the
// server at addr, and returns the commands that named a record key of
// prefix (prefix + ":{"), in order. Other clients of the server do not
// count: their keys are others'.
func monitorKeys(t *testing.T, addr string, client *redis.Client, prefix string, f func()) []monitored {
	t.Helper()
	ctx := context.Background()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := conn.Write([]byte("MONITOR\r\n")); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(conn)
	// The server monitors this connection once it answered +OK; a marker
	// key seen in it says where f's commands start and end.
	if l, err := r.ReadString('\n'); err != nil || l != "+OK\r\n" {
		t.Fatalf("MONITOR: %q %v", l, err)
	}
	await := func(marker string) []string {
		client.Exists(ctx, marker)
		var seen []string
		for {
			l, err := r.ReadString('\n')
			if err != nil {
				t.Fatalf("MONITOR, waiting for %s: %v", marker, err)
			}
			if strings.Contains(l, `"`+marker+`"`) {
				return seen
			}
			seen = append(seen, strings.TrimSuffix(l, "\r\n"))
		}
	}
	await(prefix + "-start")
	f()
	var out []monitored
	for _, l := range await(prefix + "-end") {
		if !strings.Contains(l, `"`+prefix+`:{`) {
			continue
		}
		if m, ok := parseMonitor(l); ok {
			out = append(out, m)
		}
	}
	return out
}

// commandCounts counts cmds by name, a script's commands as "lua NAME",
// and says how many keys and arguments their EVALSHAs carried.
func commandCounts(cmds []monitored) (counts map[string]int, evalKeys, evalArgs int) {
	counts = map[string]int{}
	for _, c := range cmds {
		name := strings.ToUpper(c.args[0])
		if c.source == "lua" {
			name = "lua " + name
		}
		counts[name]++
		if name == "EVALSHA" && len(c.args) >= 3 {
			n, _ := strconv.Atoi(c.args[2])
			evalKeys += n
			evalArgs += len(c.args) - 3 - n
		}
	}
	return counts, evalKeys, evalArgs
}

// What Redis runs for a new message, Acquire then Complete, exactly: the
// native transaction's SET NX PX GET and PEXPIRETIME, then one finish
// script call whose key reads the expiry and swaps the record in one SET
// ... GET: two commands in the script, no GET, five arguments a key.
// AcquireBatch and CompleteBatch run the same per key, the script once
// for all of them.
func TestRedisCommandsPerMessage(t *testing.T) {
	client := testenv.RedisClient(t)
	prefix := testenv.Name(t)
	store := newRedisStore(t, client, lock.Config{Prefix: prefix})
	ctx := context.Background()
	if err := store.Check(ctx); err != nil {
		t.Fatal(err)
	}
	// The first call asks the server what it is (INFO): not counted.
	if _, err := store.Acquire(ctx, lock.Request{Key: "warm-up"}); err != nil {
		t.Fatal(err)
	}
	const n = 4
	want := func(keys int, scripts int) map[string]int {
		return map[string]int{"SET": keys, "PEXPIRETIME": keys, "EVALSHA": scripts,
			"lua PEXPIRETIME": keys, "lua SET": keys}
	}
	check := func(t *testing.T, cmds []monitored, keys, scripts int) {
		t.Helper()
		counts, evalKeys, evalArgs := commandCounts(cmds)
		if fmt.Sprint(counts) != fmt.Sprint(want(keys, scripts)) || evalKeys != keys || evalArgs != 5*keys {
			t.Errorf("%d keys: commands %v, EVALSHA keys %d and arguments %d; want %v, %d and %d",
				keys, counts, evalKeys, evalArgs, want(keys, scripts), keys, 5*keys)
		}
	}

	t.Run("single", func(t *testing.T) {
		cmds := monitorKeys(t, testenv.RedisAddr(t), client, prefix, func() {
			for i := range n {
				res, err := store.Acquire(ctx, lock.Request{Key: fmt.Sprint("single-", i)})
				if err != nil || res.Status != lock.Acquired {
					t.Fatalf("Acquire: %+v %v", res, err)
				}
				if err := store.Complete(ctx, res.Lease, []byte("done")); err != nil {
					t.Fatal(err)
				}
			}
		})
		check(t, cmds, n, n)
	})

	t.Run("batch", func(t *testing.T) {
		reqs := make([]lock.Request, 2*n)
		for i := range reqs {
			reqs[i] = lock.Request{Key: fmt.Sprint("batch-", i)}
		}
		cmds := monitorKeys(t, testenv.RedisAddr(t), client, prefix, func() {
			results, errs := store.AcquireBatch(ctx, reqs)
			leases := make([]lock.Lease, len(reqs))
			for i := range results {
				if errs[i] != nil || results[i].Status != lock.Acquired {
					t.Fatalf("AcquireBatch %d: %+v %v", i, results[i], errs[i])
				}
				leases[i] = results[i].Lease
			}
			for i, err := range store.CompleteBatch(ctx, leases, make([][]byte, len(leases))) {
				if err != nil {
					t.Fatalf("CompleteBatch %d: %v", i, err)
				}
			}
		})
		check(t, cmds, 2*n, 1)
	})
}
