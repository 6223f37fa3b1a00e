// Command redisfloor measures what the Redis server (and the go-redis
// client) spends per new message on three lease protocols, for issue 40:
//
//	a   amqpidem's: lock.RedisStore's native Acquire (MULTI, SET ... NX PX
//	    ... GET, PEXPIRETIME, EXEC) and Complete (finish.lua, EVALSHA);
//	    AcquireBatch then CompleteBatch of -k keys (exactly k keys a call),
//	    or with -callers n, n goroutines each Acquire then Complete, as a
//	    consumer's handlers drive the store (the batcher groups them);
//	b   the floor of a correct protocol without amqpidem's record format:
//	    acquire is a pipeline of k `SET key p<owner> NX PX ttl GET`,
//	    completion one EVALSHA of a minimal compare-and-set script over the
//	    same k keys (GET, compare with p<owner>, SET key c<result> PX
//	    retention);
//	c   an incorrect lower bound: acquire a pipeline of k `SET key
//	    p<owner> NX PX ttl`, completion a pipeline of k `SET key c<result>
//	    XX PX retention` (no owner check: a lease that expired and was taken
//	    by another consumer is overwritten).
//
// Keys are new, of the form lock's records have (<prefix>:{32 hex digits}).
// Against -addr (a private redis-server, never the shared one: the run
// flushes it), it runs -warm messages, then -n measured, and prints the
// INFO commandstats and CPU (used_cpu_user, used_cpu_sys) deltas of the
// measured part per message. With -callgrind PID (the server started under
// valgrind --tool=callgrind), it runs callgrind_control -z before and -d
// after the measured part, so that each dump holds the measured messages'
// instructions only; split.py splits a dump by command. bench_test.go
// measures the client side (ns/op, allocs/op, cpu-ns/op per message).
//
// The figures of issue 40 (Debian's redis-server 7.0.15) came from:
//
//	valgrind --tool=callgrind --separate-callers=3 --callgrind-out-file=/tmp/cg/cg.%p \
//	    redis-server --port 6393 --bind 127.0.0.1 --save "" --appendonly no &
//	go build -o /tmp/redisfloor ./test/redisfloor
//	for m in a b c; do /tmp/redisfloor -addr 127.0.0.1:6393 -mode $m -k 16 -n 8192 -callgrind PID; done
//	/tmp/redisfloor -addr 127.0.0.1:6393 -callers 32 -n 8192 -callgrind PID
//	python3 test/redisfloor/split.py 8192 /tmp/cg/cg.PID.1 ...
//
// and, for CPU time, the same runs against an unprofiled private server
// (-n 65536 -warm 4096), and
//
//	REDISFLOOR_ADDR=127.0.0.1:6394 flock /tmp/bench.lock go test -run '^$' \
//	    -bench BenchmarkFloor -benchtime=32768x -count=3 ./test/redisfloor/
package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/lock"
)

// Protocol parameters shared by the three modes.
const (
	ttl       = 30 * time.Second // lease TTL (lock.DefaultLeaseTTL)
	retention = time.Minute      // how long a completed record is kept
)

// result is every message's stored outcome.
var result = []byte("ok")

// casLua is the minimal correct completion (b): for key i, ARGV[2i] is the
// value the acquire wrote (p<owner>), ARGV[2i+1] the record to write;
// ARGV[1] the retention in ms. 1 when written, 0 when the lease is lost.
const casLua = `local out = {}
local r = ARGV[1]
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[2 * i] then
    redis.call('SET', KEYS[i], ARGV[2 * i + 1], 'PX', r)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out`

var casScript = redis.NewScript(casLua)

// driver runs one protocol over groups of keys.
type driver struct {
	client *redis.Client
	store  *lock.RedisStore
	prefix string
	k      int
	seq    atomic.Int64

	// per group, reused (the floor's client need not allocate per key)
	keys   []string
	owners []string
	cas    []any
	cmds   []*redis.StatusCmd
	reqs   []lock.Request
	res    [][]byte
}

func newDriver(client *redis.Client, prefix string, k int) (*driver, error) {
	store, err := lock.NewRedisStore(client, lock.Config{Prefix: prefix, Retention: retention, LeaseTTL: ttl})
	if err != nil {
		return nil, err
	}
	d := &driver{client: client, store: store, prefix: prefix, k: k,
		keys: make([]string, k), owners: make([]string, k), cas: make([]any, 1+2*k),
		cmds: make([]*redis.StatusCmd, k),
		reqs: make([]lock.Request, k), res: make([][]byte, k)}
	for i := range d.res {
		d.res[i] = result
	}
	return d, nil
}

// check loads the scripts.
func (d *driver) check(ctx context.Context) error {
	if err := d.store.Check(ctx); err != nil {
		return err
	}
	return casScript.Load(ctx, d.client).Err()
}

// key returns a new message's Redis key, shaped as lock's (keys.go).
func (d *driver) key() string {
	n := d.seq.Add(1)
	h := sha256.Sum256([]byte(d.prefix + "\x00m" + strconv.FormatInt(n, 10)))
	return d.prefix + ":{" + hex.EncodeToString(h[:16]) + "}"
}

// owner returns the acquire's value: p and a random 128-bit token in hex.
func owner() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "p" + hex.EncodeToString(b[:])
}

// group runs one group of k new messages in mode.
func (d *driver) group(ctx context.Context, mode string) error {
	switch mode {
	case "a":
		for i := range d.reqs {
			n := d.seq.Add(1)
			d.reqs[i] = lock.Request{Key: "m" + strconv.FormatInt(n, 10)}
		}
		results, errs := d.store.AcquireBatch(ctx, d.reqs)
		leases := make([]lock.Lease, len(results))
		for i, r := range results {
			if errs[i] != nil || r.Status != lock.Acquired {
				return fmt.Errorf("acquire: %v %v", r.Status, errs[i])
			}
			leases[i] = r.Lease
		}
		for _, err := range d.store.CompleteBatch(ctx, leases, d.res) {
			if err != nil {
				return err
			}
		}
		return nil
	case "b", "c":
		for i := range d.keys {
			d.keys[i], d.owners[i] = d.key(), owner()
		}
		pipe := d.client.Pipeline()
		for i, k := range d.keys {
			if mode == "b" {
				d.cmds[i] = pipe.SetArgs(ctx, k, d.owners[i], redis.SetArgs{Mode: "NX", TTL: ttl, Get: true})
			} else {
				d.cmds[i] = pipe.SetArgs(ctx, k, d.owners[i], redis.SetArgs{Mode: "NX", TTL: ttl})
			}
		}
		if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
			return fmt.Errorf("acquire: %w", err)
		}
		for i := range d.keys {
			if mode == "b" {
				if err := d.cmds[i].Err(); err != redis.Nil {
					return fmt.Errorf("acquire: key was there: %v", err)
				}
			} else if d.cmds[i].Val() != "OK" {
				return fmt.Errorf("acquire: key was there: %v", d.cmds[i].Err())
			}
		}
		done := "c" + string(result)
		if mode == "b" {
			d.cas[0] = retention.Milliseconds()
			for i := range d.keys {
				d.cas[1+2*i], d.cas[2+2*i] = d.owners[i], done
			}
			n, err := casScript.EvalSha(ctx, d.client, d.keys, d.cas...).Int64Slice()
			if err != nil {
				return fmt.Errorf("complete: %w", err)
			}
			for _, v := range n {
				if v != 1 {
					return fmt.Errorf("complete: lease lost")
				}
			}
			return nil
		}
		pipe = d.client.Pipeline()
		for i, k := range d.keys {
			d.cmds[i] = pipe.SetArgs(ctx, k, done, redis.SetArgs{Mode: "XX", TTL: retention})
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return fmt.Errorf("complete: %w", err)
		}
		for i := range d.keys {
			if d.cmds[i].Val() != "OK" {
				return fmt.Errorf("complete: key gone")
			}
		}
		return nil
	}
	return fmt.Errorf("unknown mode %q", mode)
}

// callers runs n messages from callers goroutines, each Acquire then
// Complete through the store, as a consumer's handlers do (mode a only).
func (d *driver) callers(ctx context.Context, n, callers int) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, callers)
	for range callers {
		wg.Go(func() {
			for next.Add(1) <= int64(n) {
				key := "m" + strconv.FormatInt(d.seq.Add(1), 10)
				res, err := d.store.Acquire(ctx, lock.Request{Key: key})
				if err != nil || res.Status != lock.Acquired {
					errc <- fmt.Errorf("acquire: %v %v", res.Status, err)
					return
				}
				if err := d.store.Complete(ctx, res.Lease, result); err != nil {
					errc <- err
					return
				}
			}
		})
	}
	wg.Wait()
	select {
	case err := <-errc:
		return err
	default:
		return nil
	}
}
