package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/lock"
)

// allocsRuns is how many messages each allocation figure averages.
const allocsRuns = 2000

// allocsResult are issue 26's figures: the heap allocations of one message
// on lock.RedisStore's path, client side, against the bench's Redis: a new
// key acquired and completed (unique), and a duplicate's Acquire of a key
// completed before (duplicate). Keys are made before measuring, so that
// only the store's own allocations count; go-redis's are included.
type allocsResult struct {
	Unique, Duplicate float64
}

// measureAllocs measures allocsResult with testing.AllocsPerRun, one call
// at a time, on a client of its own (no hooks) and a store whose keys
// start with prefix.
func measureAllocs(ctx context.Context, addr, prefix string) (*allocsResult, error) {
	client := redis.NewClient(&redis.Options{Addr: addr})
	defer client.Close()
	store, err := lock.NewRedisStore(client, lock.Config{Prefix: prefix, Retention: time.Minute,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, err
	}
	if err := store.Check(ctx); err != nil {
		return nil, err
	}
	result := []byte("ok")
	keys := make([]string, allocsRuns+1) // AllocsPerRun runs once more to warm up
	for i := range keys {
		keys[i] = "u" + strconv.Itoa(i)
	}
	var (
		next int
		ferr error
	)
	unique := testing.AllocsPerRun(allocsRuns, func() {
		key := keys[next%len(keys)]
		next++
		res, err := store.Acquire(ctx, lock.Request{Key: key})
		if err == nil && res.Status != lock.Acquired {
			err = fmt.Errorf("%s: %v, want acquired", key, res.Status)
		}
		if err == nil {
			err = store.Complete(ctx, res.Lease, result)
		}
		ferr = cmp.Or(ferr, err)
	})
	duplicate := testing.AllocsPerRun(allocsRuns, func() {
		res, err := store.Acquire(ctx, lock.Request{Key: keys[0]})
		if err == nil && res.Status != lock.Completed {
			err = fmt.Errorf("%s: %v, want completed", keys[0], res.Status)
		}
		ferr = cmp.Or(ferr, err)
	})
	if ferr != nil {
		return nil, fmt.Errorf("measuring allocations: %w", ferr)
	}
	return &allocsResult{Unique: unique, Duplicate: duplicate}, nil
}

// printAllocs prints issue 26's lines, after issue 14's: the allocations
// per message of unique and of duplicate (see allocsResult).
func printAllocs(out io.Writer, rep *report) {
	if a := rep.Allocs; a != nil {
		fmt.Fprintf(out, "allocs unique %.0f\n", a.Unique)
		fmt.Fprintf(out, "allocs duplicate %.0f\n", a.Duplicate)
	}
}
