// Package testenv is the shared infrastructure of the integration tests: it
// finds the Redis, RabbitMQ, PostgreSQL and DynamoDB the tests talk to, starts throwaway
// redis-server processes, local Redis Clusters and Sentinel setups, and
// three-node RabbitMQ clusters ([RabbitCluster]: private nodes, cookie and
// epmd on loopback ports, never the system's node), and names keys and
// queues so that tests never collide.
//
// A typical integration test:
//
//	func TestStoreAcquire(t *testing.T) {
//		rdb := testenv.RedisClient(t)       // closed in t.Cleanup
//		prefix := testenv.Name(t) + ":"     // unique to this test and this run
//		t.Cleanup(func() { ... delete prefix* ... })
//		...
//	}
//
// # Where the services come from
//
// [RedisAddr], [AMQPURL] and pgenv.DSN look, in this order, at:
//
//  1. the environment: REDIS_ADDR (host:port), AMQP_URL (amqp://…) and
//     PG_DSN (postgres://…). When set, that service is used or the test
//     fails: testenv never falls back to another one behind the caller's
//     back;
//  2. the local default, 127.0.0.1:6379, amqp://guest:guest@127.0.0.1:5672/
//     and postgres://postgres@127.0.0.1:5432/test, if it answers (a Redis
//     PING, a full AMQP handshake, a PostgreSQL connection);
//  3. a container (redis:7.0-alpine with --maxmemory-policy noeviction,
//     rabbitmq:3.13-alpine, postgres:15-alpine with trust authentication
//     and a database "test"), only if a Docker engine answers GET /_ping
//     within a few seconds where testcontainers-go looks for one
//     (DOCKER_HOST, /var/run/docker.sock, the rootless and Docker Desktop
//     sockets, ~/.testcontainers.properties). testenv then runs the program
//     in containers/ with `go run`: a module of its own, so that
//     testcontainers-go and the Docker client stay out of this module's
//     go.mod and go.sum and so out of those of every module importing
//     amqpidem. That needs the go command and a checkout of this repository.
//     The container is started once per test binary and removed when the
//     binary exits (the program's standard input closes then), or by
//     testcontainers' reaper (Ryuk) if the program is killed.
//
// [DynamoEndpoint] does the same for DynamoDB: DYNAMODB_ENDPOINT, then
// http://127.0.0.1:8000 (minidyn from scripts/dynamo.sh, or DynamoDB
// Local), then amazon/dynamodb-local in a container; and
// [DynamoLocalEndpoint] for the second DynamoDB server, Amazon's DynamoDB
// Local: DYNAMODB_LOCAL_ENDPOINT, then http://127.0.0.1:8001 (from
// scripts/dynamodb-local.sh), then a container. The DynamoDB tests run on
// both ([EachDynamo]: one subtest per server, named minidyn and
// dynamodb-local), since minidyn differs from DynamoDB where it matters
// (size limits, cancellation reasons, TTL). Their clients sign with
// [DynamoAccessKeyID] and [DynamoRegion]: DynamoDB Local keeps a database
// per access key and region.
//
// The answer, found or not, is cached for the life of the test binary.
// `make services` (scripts/services.sh) starts the local defaults, and
// `docker compose up -d --wait` (docker-compose.yml) runs them in containers
// published on the same ports.
//
// # Missing services
//
// When a service cannot be found the test fails with a message saying what
// to start. Under `go test -short` it is skipped instead, unless the
// environment has CI=true: in CI a missing service is always a failure, never
// a silent skip. The same rule applies to [RedisServer], [RedisCluster] and
// [RedisSentinel] when the redis-server or redis-cli binaries are not on PATH:
// those tests start their own redis-server processes, so they run only on a
// host with Redis installed (Linux or macOS); the shared Redis of
// REDIS_ADDR, docker compose or Docker cannot stand in for them.
//
// # Processes
//
// [RedisServer], [RedisCluster] and [RedisSentinel] run redis-server from
// PATH on free loopback ports (127.0.0.1 only), each process in its own
// t.TempDir() with its output captured to a log file there. The processes are killed and
// waited for in t.Cleanup, whether the test passed or not, and their logs are
// printed when it failed. On Linux they also die with the test binary if it
// is killed (for example by -timeout) before t.Cleanup runs. [RabbitCluster]
// does the same with its nodes and their epmd. Each of these child
// processes is a [Process] ([StartProcess]): one child with its output
// appended to a log, that can be killed, stopped with a signal, paused and
// resumed, and whose output since its start can be read. Other test
// packages run their own children the same way, such as the chaos suite's
// consumers and private PostgreSQL server.
//
// Except for [Server.Stop], [RabbitNode.Kill], [Process]'s methods and
// [LogTail], every function and method here must be called from the
// goroutine running the test, because it may call t.Fatalf or t.Skipf.
package testenv
