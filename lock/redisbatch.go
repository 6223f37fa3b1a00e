package lock

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

var (
	_ BatchAcquirer  = (*RedisStore)(nil)
	_ BatchCompleter = (*RedisStore)(nil)
)

// AcquireBatch is Acquire for each of reqs, all in one pipeline: one round
// trip when the native transaction decides every key (a new key, a
// duplicate, a conflict), two when some need the acquire script (a record
// in progress, released or expired: the second pipeline holds only those),
// and one when every Acquire runs the script (a Cluster, a Redis older
// than 7.0: one pipeline, which a Cluster client sends to each node at
// once). On a standalone server the script runs over up to 64 keys per
// call, as concurrent Acquires do. Each key is decided on its own, as
// Acquire decides it: a key that comes twice in reqs is taken by its first
// request and answered InProgress for the second.
//
// The requests whose answer was lost are sent again together with their
// owner tokens, as Acquire sends one (up to 3 more times over about
// 350 ms, within ctx); their error then wraps ErrUnavailable. A request
// that fails CheckRequest gets that error alone and is not sent.
func (s *RedisStore) AcquireBatch(ctx context.Context, reqs []Request) ([]Result, []error) {
	results := make([]Result, len(reqs))
	errs := make([]error, len(reqs))
	checked := make([]Request, len(reqs))
	todo := make([]int, 0, len(reqs))
	for i := range reqs {
		req, err := s.cfg.CheckRequest(reqs[i])
		if err != nil {
			errs[i] = err
			continue
		}
		checked[i] = req
		todo = append(todo, i)
	}
	keys := newBatchKeys(s.cfg.Prefix, checked, todo)
	uncertain := make([]bool, len(reqs)) // a try may have taken effect
	wait := acquireRetryWait
	for n := 0; len(todo) > 0; n++ {
		s.acquireAll(ctx, checked, keys, todo, results, errs)
		again := todo[:0:0]
		for _, i := range todo {
			uncertain[i] = uncertain[i] || (errors.Is(errs[i], ErrUnavailable) && !notSent(errs[i]))
			if errs[i] != nil && uncertain[i] {
				again = append(again, i)
			}
		}
		if len(again) == 0 || n == acquireRetries || ctx.Err() != nil {
			break
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		if ctx.Err() != nil {
			break
		}
		wait *= 2
		todo = again
	}
	for i := range errs {
		errs[i] = mayHaveTakenEffect(errs[i], uncertain[i])
	}
	return results, errs
}

// acquireAll sends one try of the requests todo (indexes into reqs and
// keys, their owner tokens and record keys): the native transaction
// for all of them in one pipeline where the server allows, then the
// acquire script for those it left undecided, in one more; and sets their
// results and errors.
func (s *RedisStore) acquireAll(ctx context.Context, reqs []Request, keys *batchKeys, todo []int, results []Result, errs []error) {
	start := s.cfg.Now()
	script := todo
	scriptCtx := ctx
	if s.batch.native(ctx) {
		calls := make([]*call, len(todo))
		for j, i := range todo {
			calls[j] = nativeCall(reqs[i], &keys.owners[i], keys.rkey(i))
		}
		s.batch.exec(ctx, calls)
		script = nil
		refused := error(nil)
		for j, i := range todo {
			c := calls[j]
			res, done, err := nativeReply(reqs[i], &keys.owners[i], keys.owner(i), keys.rkey(i), start, c.val, c.exp, c.err)
			putCall(c)
			switch {
			case done:
				results[i], errs[i] = res, nil
			case err == nil:
				script = append(script, i) // the script decides
			case scriptCannotHelp(err):
				results[i], errs[i] = Result{}, err
			default:
				// Refused as a whole: as in acquire, the script runs
				// whatever ctx says.
				refused = err
				script = append(script, i)
			}
		}
		if refused != nil {
			s.nativeRefused(ctx, refused)
			scriptCtx = context.WithoutCancel(ctx)
		}
		if len(script) == 0 {
			return
		}
	}
	calls := make([]*call, len(script))
	for j, i := range script {
		calls[j] = scriptCall(reqs[i], &keys.owners[i], keys.rkey(i))
	}
	s.batch.exec(scriptCtx, calls)
	for j, i := range script {
		c := calls[j]
		results[i], errs[i] = scriptReply(reqs[i], &keys.owners[i], keys.owner(i), keys.rkey(i), start, c.val, c.err)
		putCall(c)
	}
}

// batchKeys are the owner tokens and record keys of an AcquireBatch's
// requests, made once for its tries. Their strings are slices of one
// string (one allocation for the batch, not two a key): all holds every
// request's token, then every request's record key, each klen bytes
// (zeros for a request that failed its check, never sent).
type batchKeys struct {
	owners [][32]byte
	all    string
	klen   int
}

// newBatchKeys makes the tokens and record keys of the requests todo
// (indexes into reqs) under prefix.
func newBatchKeys(prefix string, reqs []Request, todo []int) *batchKeys {
	k := &batchKeys{owners: make([][32]byte, len(reqs)), klen: len(prefix) + 35}
	var b strings.Builder
	b.Grow(len(reqs) * (32 + k.klen))
	for _, i := range todo {
		newOwner(&k.owners[i])
	}
	for i := range k.owners {
		b.Write(k.owners[i][:])
	}
	var stack [maxPrefixLen + 3 + 32]byte
	next := 0
	for i := range reqs {
		key := stack[:k.klen]
		clear(key)
		if next < len(todo) && todo[next] == i {
			key = appendRecordKey(stack[:0], prefix, reqs[i].Key)
			next++
		}
		b.Write(key)
	}
	k.all = b.String()
	return k
}

// owner returns request i's owner token as a string.
func (k *batchKeys) owner(i int) string {
	return k.all[32*i : 32*i+32]
}

// rkey returns request i's record key.
func (k *batchKeys) rkey(i int) string {
	off := 32*len(k.owners) + i*k.klen
	return k.all[off : off+k.klen]
}

// scriptCannotHelp reports whether a native Acquire's error is its answer:
// the acquire script would meet the same (the server is unavailable, the
// record is bad or another key's, the caller gave up).
func scriptCannotHelp(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrBadRecord) || errors.Is(err, ErrKeyCollision) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// CompleteBatch is Complete for each lease, with results[i] for
// leases[i], in one pipeline (one finish script call over up to 64 keys
// on a standalone server). errs[i] is what Complete would answer for
// leases[i]: nil, ErrLeaseLost, ErrResultTooLarge (not sent), or the
// transport error. Like Complete it is not retried here; a resent call
// that finds its own write answers nil.
func (s *RedisStore) CompleteBatch(ctx context.Context, leases []Lease, results [][]byte) []error {
	errs := make([]error, len(leases))
	if len(results) != len(leases) {
		err := fmt.Errorf("lock: complete batch: %d results for %d leases", len(results), len(leases))
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	calls := make([]*call, 0, len(leases))
	index := make([]int, 0, len(leases))
	for i, l := range leases {
		if errs[i] = CheckLease(l); errs[i] != nil {
			continue
		}
		if len(results[i]) > s.cfg.MaxResultSize {
			errs[i] = fmt.Errorf("%w: key %q: %d bytes, at most %d allowed", ErrResultTooLarge, l.Key, len(results[i]), s.cfg.MaxResultSize)
			continue
		}
		calls = append(calls, s.finishCall(l, stateCompleted, results[i], ""))
		index = append(index, i)
	}
	if len(calls) > 0 {
		s.batch.exec(ctx, calls)
	}
	for j, c := range calls {
		n, _ := c.val.(int64)
		errs[index[j]] = leaseReply(leases[index[j]], "complete", int(n), c.err)
		putCall(c)
	}
	return errs
}
