package testenv

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

// Local defaults, images and time limits.
const (
	defaultRedisAddr = "127.0.0.1:6379"
	defaultAMQPURL   = "amqp://guest:guest@127.0.0.1:5672/"

	redisImage  = "redis:7-alpine"
	rabbitImage = "rabbitmq:3.13-alpine"

	// probeTimeout bounds one check that a service answers.
	probeTimeout = 5 * time.Second
	// dockerProbeTimeout bounds the check that a Docker engine answers.
	dockerProbeTimeout = 5 * time.Second
	// containerTimeout bounds pulling and starting a container.
	containerTimeout = 3 * time.Minute
)

// How to start each service, shown when it cannot be found.
const (
	redisHelp = `Start one of:
  make services
  mkdir -p /var/lib/redis /var/log/redis && redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
or set REDIS_ADDR=host:port to a running Redis,
or start a Docker engine (testcontainers-go then runs ` + redisImage + `).`
	amqpHelp = `Start one of:
  make services
  rabbitmq-server -detached && rabbitmqctl await_startup
or set AMQP_URL=amqp://user:pass@host:port/vhost to a running RabbitMQ,
or start a Docker engine (testcontainers-go then runs ` + rabbitImage + `).`
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
// if set, else 127.0.0.1:6379 if it answers PING, else a redis:7-alpine
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
	if skipMissing(testing.Short(), os.Getenv("CI")) {
		t.Skipf(format+"\n(skipped because of -short; with CI=true this is a failure)", args...)
	}
	t.Fatalf(format, args...)
}

// skipMissing reports whether a missing service skips the test rather than
// failing it.
func skipMissing(short bool, ci string) bool {
	return short && ci != "true"
}

func resolveRedis() (addr, missing string) {
	if env := os.Getenv("REDIS_ADDR"); env != "" {
		if err := pingRedis(env, probeTimeout); err != nil {
			return "", fmt.Sprintf("testenv: REDIS_ADDR=%s does not answer PING: %v\n"+
				"Start Redis at that address, or unset REDIS_ADDR to use %s or Docker.", env, err, defaultRedisAddr)
		}
		return env, ""
	}
	localErr := pingRedis(defaultRedisAddr, probeTimeout)
	if localErr == nil {
		return defaultRedisAddr, ""
	}
	tried := fmt.Sprintf("REDIS_ADDR is not set; %s does not answer PING (%v)", defaultRedisAddr, localErr)
	if err := dockerAvailable(); err != nil {
		return "", fmt.Sprintf("testenv: no Redis for the integration tests.\n%s; no Docker engine for testcontainers (%v).\n%s",
			tried, err, redisHelp)
	}
	addr, err := startRedisContainer()
	if err != nil {
		return "", fmt.Sprintf("testenv: no Redis for the integration tests.\n%s; starting %s with testcontainers failed: %v\n%s",
			tried, redisImage, err, redisHelp)
	}
	return addr, ""
}

func resolveAMQP() (url, missing string) {
	if env := os.Getenv("AMQP_URL"); env != "" {
		if err := dialAMQP(env, probeTimeout); err != nil {
			return "", fmt.Sprintf("testenv: AMQP_URL=%s: cannot connect: %v\n"+
				"Start RabbitMQ at that address, or unset AMQP_URL to use %s or Docker.", env, err, defaultAMQPURL)
		}
		return env, ""
	}
	localErr := dialAMQP(defaultAMQPURL, probeTimeout)
	if localErr == nil {
		return defaultAMQPURL, ""
	}
	tried := fmt.Sprintf("AMQP_URL is not set; %s: cannot connect (%v)", defaultAMQPURL, localErr)
	if err := dockerAvailable(); err != nil {
		return "", fmt.Sprintf("testenv: no RabbitMQ for the integration tests.\n%s; no Docker engine for testcontainers (%v).\n%s",
			tried, err, amqpHelp)
	}
	url, err := startRabbitContainer()
	if err != nil {
		return "", fmt.Sprintf("testenv: no RabbitMQ for the integration tests.\n%s; starting %s with testcontainers failed: %v\n%s",
			tried, rabbitImage, err, amqpHelp)
	}
	return url, ""
}

// dialAMQP opens and closes an AMQP connection to url.
func dialAMQP(url string, timeout time.Duration) error {
	conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(timeout)})
	if err != nil {
		return err
	}
	return conn.Close()
}

var docker struct {
	once sync.Once
	err  error
}

// dockerAvailable reports, once per test binary, whether a Docker engine
// answers; nil means testcontainers can be used.
func dockerAvailable() error {
	docker.once.Do(func() { docker.err = probeDocker(dockerProbeTimeout) })
	return docker.err
}

// probeDocker asks testcontainers' default provider for the engine's health.
// Finding the engine does not take a context and can block on a socket that
// accepts but never answers, so the probe runs in its own goroutine and is
// abandoned after timeout.
func probeDocker(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- fmt.Errorf("testcontainers panicked: %v", r)
			}
		}()
		p, err := testcontainers.ProviderDefault.GetProvider()
		if err != nil {
			done <- err
			return
		}
		done <- p.Health(ctx) // Health closes the provider.
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("no answer from the Docker engine within %v", timeout)
	}
}

// startContainer runs img with port exposed and returns the host:port it is
// mapped to. The container outlives the call: testcontainers' reaper removes
// it when the test binary exits.
func startContainer(img, port string, opts ...testcontainers.ContainerCustomizer) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), containerTimeout)
	defer cancel()
	opts = append([]testcontainers.ContainerCustomizer{testcontainers.WithExposedPorts(port)}, opts...)
	c, err := testcontainers.Run(ctx, img, opts...)
	if err != nil {
		return "", errors.Join(err, testcontainers.TerminateContainer(c))
	}
	endpoint, err := c.PortEndpoint(ctx, port, "")
	if err != nil {
		return "", errors.Join(err, testcontainers.TerminateContainer(c))
	}
	return endpoint, nil
}

func startRedisContainer() (string, error) {
	addr, err := startContainer(redisImage, "6379/tcp",
		testcontainers.WithCmd("redis-server", "--maxmemory-policy", "noeviction"),
		testcontainers.WithWaitStrategy(
			wait.ForLog("Ready to accept connections"),
			wait.ForListeningPort("6379/tcp"),
		),
	)
	if err != nil {
		return "", err
	}
	return addr, retry(30*time.Second, func() error { return pingRedis(addr, probeTimeout) })
}

func startRabbitContainer() (string, error) {
	addr, err := startContainer(rabbitImage, "5672/tcp",
		testcontainers.WithWaitStrategyAndDeadline(2*time.Minute,
			wait.ForLog("Server startup complete"),
			wait.ForListeningPort("5672/tcp"),
		),
	)
	if err != nil {
		return "", err
	}
	url := "amqp://guest:guest@" + addr + "/"
	return url, retry(30*time.Second, func() error { return dialAMQP(url, probeTimeout) })
}

// retry calls f until it succeeds or d has passed, and returns its last error.
func retry(d time.Duration, f func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
}
