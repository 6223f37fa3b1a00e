package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	defaultPGDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	pgImage      = "postgres:15-alpine"
	pgHelp       = `Start one of:
  make services                  (starts the local PostgreSQL cluster, if PostgreSQL is installed)
  docker compose up -d --wait    (Redis, RabbitMQ and PostgreSQL from docker-compose.yml)
  pg_ctlcluster 15 main start    (Debian, Ubuntu; then: createdb -U postgres test)
or set PG_DSN=postgres://user@host:port/db to a running PostgreSQL,
or start a Docker engine (the tests then run ` + pgImage + ` through testcontainers-go).`
)

var pgTarget = target{
	name:    "PostgreSQL",
	envVar:  "PG_DSN",
	local:   defaultPGDSN,
	probe:   func(dsn string) error { return pingPG(dsn, probeTimeout) },
	failure: ": cannot connect",
	service: "postgres",
	image:   pgImage,
	help:    pgHelp,
}

var pgService service

func resolvePG() (dsn, missing string) { return resolve(pgTarget, dockerAvailable) }

// PostgresDSN returns the connection string of a PostgreSQL for integration
// tests: PG_DSN if set, else postgres://postgres@127.0.0.1:5432/test if it
// accepts a connection, else a postgres:15-alpine container if a Docker
// engine answers. The rules of RedisAddr apply: cached for the test binary,
// a failure (a skip under -short without CI=true) saying what to start.
func PostgresDSN(t testing.TB) string {
	t.Helper()
	return pgService.get(t, resolvePG)
}

// PostgresPool returns a pool on [PostgresDSN] with at most maxConns
// connections, closed in t.Cleanup. Tests share that database: keep tables
// or schemas under a [Name].
func PostgresPool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(PostgresDSN(t))
	if err != nil {
		t.Fatalf("testenv: PG_DSN: %v", err)
	}
	cfg.MaxConns = maxConns
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("testenv: PostgreSQL pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// pingPG opens and closes a connection to dsn.
func pingPG(dsn string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}
