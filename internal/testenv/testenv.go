package testenv

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
)

// Local defaults, images and time limits.
const (
	defaultRedisAddr = "127.0.0.1:6379"
	defaultAMQPURL   = "amqp://guest:guest@127.0.0.1:5672/"

	// The images the containers program starts (see containers/main.go).
	redisImage  = "redis:7.0-alpine"
	rabbitImage = "rabbitmq:3.13-alpine"

	// probeTimeout bounds one check that a service answers.
	probeTimeout = 5 * time.Second
	// dockerProbeTimeout bounds the check that a Docker engine answers.
	dockerProbeTimeout = 5 * time.Second
	// containerTimeout bounds building the containers program, pulling the
	// image and starting the container.
	containerTimeout = 5 * time.Minute
	// containerReadyTimeout bounds waiting, after the containers program
	// reported a container ready, until the service answers the tests.
	containerReadyTimeout = 30 * time.Second
)

// How to start each service, shown when it cannot be found.
const (
	redisHelp = `Start one of:
  make services                  (starts a local redis-server, if Redis is installed)
  docker compose up -d --wait    (Redis, RabbitMQ, PostgreSQL and DynamoDB from docker-compose.yml)
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
or set REDIS_ADDR=host:port to a running Redis,
or start a Docker engine (the tests then run ` + redisImage + ` through testcontainers-go).`
	amqpHelp = `Start one of:
  make services                  (starts a local rabbitmq-server, if RabbitMQ is installed)
  docker compose up -d --wait    (Redis, RabbitMQ, PostgreSQL and DynamoDB from docker-compose.yml)
  rabbitmq-server -detached && rabbitmqctl await_startup
or set AMQP_URL=amqp://user:pass@host:port/vhost to a running RabbitMQ,
or start a Docker engine (the tests then run ` + rabbitImage + ` through testcontainers-go).`
)

// service caches, for the life of the test binary, where a service is or why
// it is missing.
type service struct {
	once    sync.Once
	addr    string // address or URL; empty when missing
	missing string // why it is missing and what to start
}

func (s *service) get(t testing.TB, resolve func() (addr, missing string)) string {
	t.Helper()
	s.once.Do(func() { s.addr, s.missing = resolve() })
	if s.addr == "" {
		unavailable(t, "%s", s.missing)
	}
	return s.addr
}

var redisService, amqpService service

// RedisAddr returns the host:port of a Redis for integration tests: REDIS_ADDR
// if set, else 127.0.0.1:6379 if it answers PING, else a redis:7.0-alpine
// container if a Docker engine answers. The answer is cached for the test
// binary. When no Redis can be found the test fails, or is skipped under
// -short without CI=true; the message says what to start.
func RedisAddr(t testing.TB) string {
	t.Helper()
	return redisService.get(t, resolveRedis)
}

// AMQPURL returns the URL of a RabbitMQ for integration tests: AMQP_URL if
// set, else amqp://guest:guest@127.0.0.1:5672/ if an AMQP connection to it
// succeeds, else a rabbitmq:3.13-alpine container if a Docker engine answers.
// The answer is cached for the test binary. When no RabbitMQ can be found the
// test fails, or is skipped under -short without CI=true; the message says
// what to start.
func AMQPURL(t testing.TB) string {
	t.Helper()
	return amqpService.get(t, resolveAMQP)
}

// RedisClient returns a client of the Redis at [RedisAddr], closed in
// t.Cleanup. Tests share that Redis: keep keys under a [Name] prefix.
func RedisClient(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: RedisAddr(t)})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// maxNameBase is how many bytes of the test name Name keeps.
const maxNameBase = 40

// Name returns a short name for this call: the test's name reduced to
// [A-Za-z0-9._-] (at most 40 bytes), a dash and 8 random hex digits, such as
// "TestConsumer_redelivery-3f9c0a1e", so that calls, tests and runs sharing a
// Redis or a RabbitMQ do not collide in practice. It is safe as a Redis key or key prefix
// (it holds no '{' or '}', so it never forms a cluster hash tag by itself), an
// AMQP queue or exchange name, and a consumer tag.
func Name(t testing.TB) string {
	t.Helper()
	var b strings.Builder
	sep := false
	for _, r := range t.Name() {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '-':
			b.WriteRune(r)
			sep = false
		case !sep:
			b.WriteByte('_')
			sep = true
		}
	}
	base := b.String()
	if len(base) > maxNameBase {
		base = base[:maxNameBase]
	}
	base = strings.Trim(base, "_.-")
	if base == "" {
		base = "test"
	}
	return fmt.Sprintf("%s-%08x", base, rand.Uint32())
}

// unavailable ends the test because a service or program is missing: a skip
// under -short unless CI=true, a failure otherwise.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	skip, note := missingOutcome(testing.Short(), os.Getenv("CI"))
	if skip {
		t.Skipf(format+"\n"+note, args...)
	}
	t.Fatalf(format+"\n"+note, args...)
}

// missingOutcome says whether a missing service or program skips the test
// rather than failing it, and the note that says why.
func missingOutcome(short bool, ci string) (skip bool, note string) {
	switch {
	case skipMissing(short, ci):
		return true, "(skipped because of -short; with CI=true this is a failure)"
	case ci == "true":
		return false, "(CI=true: a missing service or program is a failure, never a skip)"
	default:
		return false, "(go test -short skips such tests instead, unless CI=true)"
	}
}

// skipMissing reports whether a missing service skips the test rather than
// failing it.
func skipMissing(short bool, ci string) bool {
	return short && ci != "true"
}

// A target is a service the tests look for, and how.
type target struct {
	name    string                  // "Redis"
	envVar  string                  // "REDIS_ADDR"
	local   string                  // the local default address or URL
	probe   func(addr string) error // nil if the service at addr answers
	failure string                  // what a failed probe means, after the address: " does not answer PING"
	service string                  // the containers program's argument: "redis"; it prints envVar=address
	image   string                  // the image it runs
	help    string                  // what to start
}

var (
	redisTarget = target{
		name:    "Redis",
		envVar:  "REDIS_ADDR",
		local:   defaultRedisAddr,
		probe:   func(addr string) error { return pingRedis(addr, probeTimeout) },
		failure: " does not answer PING",
		service: "redis",
		image:   redisImage,
		help:    redisHelp,
	}
	amqpTarget = target{
		name:    "RabbitMQ",
		envVar:  "AMQP_URL",
		local:   defaultAMQPURL,
		probe:   func(url string) error { return dialAMQP(url, probeTimeout) },
		failure: ": cannot connect",
		service: "rabbitmq",
		image:   rabbitImage,
		help:    amqpHelp,
	}
)

func resolveRedis() (addr, missing string) { return resolve(redisTarget, dockerAvailable) }

func resolveAMQP() (url, missing string) { return resolve(amqpTarget, dockerAvailable) }

// resolve finds tg: its environment variable if set (and then only there),
// else its local default if it answers, else a container when docker
// reports an engine. It returns the address, or why there is none and what
// to start.
func resolve(tg target, docker func() error) (addr, missing string) {
	if env := os.Getenv(tg.envVar); env != "" {
		if err := tg.probe(env); err != nil {
			return "", fmt.Sprintf("testenv: %s=%s%s: %v\n"+
				"Start %s at that address, or unset %s to use %s or Docker.",
				tg.envVar, env, tg.failure, err, tg.name, tg.envVar, tg.local)
		}
		return env, ""
	}
	localErr := tg.probe(tg.local)
	if localErr == nil {
		return tg.local, ""
	}
	tried := fmt.Sprintf("%s is not set; %s%s (%v)", tg.envVar, tg.local, tg.failure, localErr)
	if err := docker(); err != nil {
		return "", fmt.Sprintf("testenv: no %s for the integration tests.\n%s; no Docker engine for testcontainers (%v).\n%s",
			tg.name, tried, err, tg.help)
	}
	addr, err := startContainer(tg)
	if err != nil {
		return "", fmt.Sprintf("testenv: no %s for the integration tests.\n%s; starting %s with testcontainers failed: %v\n%s",
			tg.name, tried, tg.image, err, tg.help)
	}
	return addr, ""
}

// dialAMQP opens and closes an AMQP connection to url.
func dialAMQP(url string, timeout time.Duration) error {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(timeout)})
	if err != nil {
		return err
	}
	return conn.Close()
}

// Service is a service the tests look for besides Redis and RabbitMQ,
// found by the same rules as [RedisAddr]: EnvVar if set, else Local if
// Probe accepts it, else a container of Image (Container names it to the
// containers program, which prints EnvVar=address), else a failure (a skip
// under -short without CI=true) that says what to start (Help). Packages
// that need a driver testenv must not import (so that the tests of every
// package importing testenv do not bring it into a user's go.sum) declare
// their Service in a package of their own, such as pgenv.
type Service struct {
	Name      string                  // "PostgreSQL"
	EnvVar    string                  // "PG_DSN"
	Local     string                  // the local default address or URL
	Probe     func(addr string) error // nil if the service at addr answers
	Failure   string                  // what a failed probe means, after the address: ": cannot connect"
	Container string                  // the containers program's argument: "postgres"
	Image     string                  // the image it runs
	Help      string                  // what to start

	found service
}

// Addr returns where s is. The answer, found or not, is cached for the
// life of the test binary.
func (s *Service) Addr(t testing.TB) string {
	t.Helper()
	return s.found.get(t, func() (string, string) {
		return resolve(target{
			name: s.Name, envVar: s.EnvVar, local: s.Local, probe: s.Probe, failure: s.Failure,
			service: s.Container, image: s.Image, help: s.Help,
		}, dockerAvailable)
	})
}

// QueueChannel returns a channel on a connection of the test's own to the
// broker of AMQPURL, closed when the test ends, after declaring queue as a
// Consumer declares it: durable, classic, no arguments. The queue and its
// dead-letter queue ("<queue>.dlq") are deleted when the test ends
// (DeleteQueues).
func QueueChannel(t testing.TB, queue string) *amqp.Channel {
	t.Helper()
	url := AMQPURL(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	DeleteQueues(t, url, queue, queue+".dlq")
	return ch
}

// DeleteQueues deletes the queues named on the broker at url when the test
// ends, through a connection of its own (the test's may be closed by
// then). Queues that do not exist are ignored, and so is a broker that
// cannot be reached then.
func DeleteQueues(t testing.TB, url string, queues ...string) {
	t.Cleanup(func() {
		c, err := amqp.Dial(url)
		if err != nil {
			return
		}
		defer c.Close()
		for _, q := range queues {
			ch, err := c.Channel()
			if err != nil {
				return
			}
			_, _ = ch.QueueDelete(q, false, false, false)
			_ = ch.Close()
		}
	})
}

// DeleteKeys deletes the keys of rdb matching pattern (SCAN's glob) when
// the test ends.
func DeleteKeys(t testing.TB, rdb *redis.Client, pattern string) {
	t.Cleanup(func() {
		ctx := context.Background()
		iter := rdb.Scan(ctx, 0, pattern, 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
	})
}
