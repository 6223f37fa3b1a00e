// Package pgenv finds the PostgreSQL of the integration tests, by the rules
// of package testenv: PG_DSN if set, else
// postgres://postgres@127.0.0.1:5432/test if it accepts a connection, else a
// postgres:15-alpine container (trust authentication, database "test") if a
// Docker engine answers, else a failure saying what to start. It is a
// package of its own so that pgx stays out of the dependencies of the tests
// that need only Redis and RabbitMQ.
package pgenv

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/amqpidem/amqpidem/internal/testenv"
)

// timeout bounds one check that PostgreSQL answers, and opening a pool.
const timeout = 5 * time.Second

var postgres = &testenv.Service{
	Name:      "PostgreSQL",
	EnvVar:    "PG_DSN",
	Local:     "postgres://postgres@127.0.0.1:5432/test?sslmode=disable",
	Probe:     ping,
	Failure:   ": cannot connect",
	Container: "postgres",
	Image:     "postgres:15-alpine",
	Help: `Start one of:
  make services                  (starts the local PostgreSQL cluster, if PostgreSQL is installed)
  docker compose up -d --wait    (Redis, RabbitMQ, PostgreSQL and DynamoDB from docker-compose.yml)
  pg_ctlcluster 15 main start    (Debian, Ubuntu; then: createdb -U postgres test)
or set PG_DSN=postgres://user@host:port/db to a running PostgreSQL,
or start a Docker engine (the tests then run postgres:15-alpine through testcontainers-go).`,
}

// DSN returns the connection string of the tests' PostgreSQL.
func DSN(t testing.TB) string {
	t.Helper()
	return postgres.Addr(t)
}

// Pool returns a pool on [DSN] with at most maxConns connections, closed in
// t.Cleanup. Tests share that database: keep tables or schemas under a
// testenv.Name.
func Pool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(DSN(t))
	if err != nil {
		t.Fatalf("pgenv: PG_DSN: %v", err)
	}
	cfg.MaxConns = maxConns
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pgenv: PostgreSQL pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// ping opens and closes a connection to dsn.
func ping(dsn string) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}
