package main

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// roundTrips is a go-redis hook that counts round trips: one per Process
// call (a command, or one try of a script) and one per ProcessPipeline call
// (a whole pipeline or transaction). Safe for concurrent use.
type roundTrips struct {
	n atomic.Int64
}

func (h *roundTrips) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		return next(ctx, network, addr)
	}
}

func (h *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}

func (h *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmds)
	}
}

// deleteKeys unlinks every key matching pattern and returns how many there
// were. pattern is a SCAN MATCH glob; the harness only passes its own
// prefixes (letters, digits, '-') followed by '*'.
func deleteKeys(ctx context.Context, rdb *redis.Client, pattern string) (int, error) {
	var (
		total int
		batch = make([]string, 0, 1000)
	)
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := rdb.Unlink(ctx, batch...).Err()
		total += len(batch)
		batch = batch[:0]
		return err
	}
	iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == cap(batch) {
			if err := flush(); err != nil {
				return total, err
			}
		}
	}
	if err := iter.Err(); err != nil {
		return total, err
	}
	return total, flush()
}

// countKeys counts the keys matching pattern.
func countKeys(ctx context.Context, rdb *redis.Client, pattern string) (int, error) {
	n := 0
	iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
	for iter.Next(ctx) {
		n++
	}
	return n, iter.Err()
}

// redisCPU is the server's CPU time so far (INFO cpu: used_cpu_user +
// used_cpu_sys), or 0 when the server does not say.
func redisCPU(ctx context.Context, rdb *redis.Client) time.Duration {
	info, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0
	}
	var total float64
	for _, field := range []string{"used_cpu_user", "used_cpu_sys"} {
		v, _ := strconv.ParseFloat(infoField(info, field), 64)
		total += v
	}
	return time.Duration(total * float64(time.Second))
}

// redisVersion is the server's version, or "?".
func redisVersion(ctx context.Context, rdb *redis.Client) string {
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return "?"
	}
	if v := infoField(info, "redis_version"); v != "" {
		return v
	}
	return "?"
}

// infoField reads "name:value" from an INFO reply.
func infoField(info, name string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v
		}
	}
	return ""
}

// pingRedis fails when the server does not answer.
func pingRedis(ctx context.Context, rdb *redis.Client) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis %s: %w", rdb.Options().Addr, err)
	}
	return nil
}
