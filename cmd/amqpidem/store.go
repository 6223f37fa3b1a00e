package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/secret"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/pgstore"
)

// openStore connects to the store the flags name; close releases it.
func (o *options) openStore(ctx context.Context) (admin lock.Admin, close func(), err error) {
	quiet := slog.New(slog.DiscardHandler)
	if o.dynamo.table != "" {
		return o.openDynamo(ctx)
	}
	if o.pgDSN != "" {
		pool, err := pgxpool.New(ctx, o.pgDSN)
		if err != nil {
			// pgx's error names the DSN redacted; its cause, not
			// wrapped here, is net/url's, which quotes it whole.
			return nil, nil, withCode(exitUsage, "--postgres: %v", err)
		}
		cfg := pgstore.Config{Schema: o.pgSchema, Table: o.pgTable, CleanupInterval: -1}
		cfg.Prefix, cfg.Logger = o.prefix, quiet
		s, err := pgstore.New(pool, cfg)
		if err != nil {
			pool.Close()
			return nil, nil, withCode(exitUsage, "%w", err)
		}
		if err := s.Check(ctx); errors.Is(err, pgstore.ErrNotMigrated) {
			// An operator's fix is a flag, not a migration: the
			// consumers' records are most likely in another table.
			s.Close()
			pool.Close()
			return nil, nil, withCode(exitFailed, "PostgreSQL: no amqpidem records table %q in %s: pass --pg-table and --pg-schema as "+
				"the consumers' pgstore.Config sets Table and Schema, or run pgstore.Migrate if none was made",
				cmp.Or(o.pgTable, "amqpidem_records"), cmp.Or(o.pgSchema, "the search_path"))
		}
		return s, func() { s.Close(); pool.Close() }, nil
	}
	// go-redis logs each failed dial of its pool to the process's
	// stderr, lines before the one error that says it all.
	redis.SetLogger(quietRedis{})
	var client redis.UniversalClient
	switch {
	case len(o.redisAddrs) > 0:
		// A Cluster, or a Sentinel set with a master name: as the
		// consumers' redis.UniversalClient would be made.
		client = redis.NewUniversalClient(&redis.UniversalOptions{Addrs: o.redisAddrs, MasterName: o.redisMaster,
			Username: os.Getenv("AMQPIDEM_REDIS_USERNAME"), Password: os.Getenv("AMQPIDEM_REDIS_PASSWORD"),
			DialTimeout: o.timeout, ContextTimeoutEnabled: true})
	case o.redisMaster != "":
		return nil, nil, withCode(exitUsage, "--redis-master needs the Sentinels' --redis-addrs")
	default:
		opt, err := redis.ParseURL(o.redisURL)
		if err != nil {
			// Not go-redis's error: it quotes the URL, or the piece
			// of the password it stumbled on.
			return nil, nil, withCode(exitUsage, "%w", secret.ParseError("--redis", o.redisURL, err))
		}
		// --timeout bounds the dial too (go-redis's default is 5 s),
		// and each call's context its reads and writes (go-redis
		// ignores a context's deadline unless told).
		opt.DialTimeout, opt.ContextTimeoutEnabled = o.timeout, true
		client = redis.NewClient(opt)
	}
	s, err := lock.NewRedisStore(client, lock.Config{Prefix: o.prefix, Logger: quiet})
	if err != nil {
		client.Close()
		return nil, nil, withCode(exitUsage, "%w", err)
	}
	return s, func() { client.Close() }, nil
}

// storeName says which store the flags name, for messages.
func (o *options) storeName() string {
	switch {
	case o.dynamo.table != "":
		return o.dynamoName()
	case o.pgDSN != "":
		return "the PostgreSQL store"
	case o.redisMaster != "":
		return fmt.Sprintf("Redis master %q of the Sentinels at %s", o.redisMaster, strings.Join(o.redisAddrs, ","))
	case len(o.redisAddrs) > 0:
		return fmt.Sprintf("Redis Cluster at %s", strings.Join(o.redisAddrs, ","))
	}
	return fmt.Sprintf("Redis at %s", secret.URL(o.redisURL))
}

// quietRedis is go-redis's internal logger, silenced: what it would say
// comes back as the error of the call.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}
