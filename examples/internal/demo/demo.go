// Package demo is the scaffolding of the examples' self-checks (each
// example's selfcheck.go, which `go run ./examples/<name>` runs): finding
// Redis and RabbitMQ (REDIS_ADDR, AMQP_URL), naming a run's queue and Redis
// prefix, a coloured logger, an Observer that counts outcomes, a hard time
// limit, PASS or FAIL, and cleaning up afterwards.
//
// An example's main.go never imports it: main.go is the template a user
// copies, and imports only public packages.
package demo

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/internal/secret"
	"github.com/amqpidem/amqpidem/lock"
)

// Defaults used when REDIS_ADDR and AMQP_URL are not set.
const (
	DefaultRedisAddr = "127.0.0.1:6379"
	DefaultAMQPURL   = "amqp://guest:guest@127.0.0.1:5672/"
)

// Main runs fn with a context that ends when limit has passed (its cause
// says so) or on Ctrl-C, then exits the process: status 0 when fn returned
// nil, 1 otherwise, after printing "<name>: PASS" or "<name>: FAIL: <err>".
// It never returns. A watchdog exits with status 2 if fn has not returned
// 15 s after the limit, so an example can never hang.
func Main(name string, limit time.Duration, fn func(ctx context.Context) error) {
	os.Exit(run(name, limit, fn))
}

func run(name string, limit time.Duration, fn func(ctx context.Context) error) int {
	start := time.Now()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeoutCause(ctx, limit,
		fmt.Errorf("hard time limit of %v reached", limit))
	defer cancel()
	watchdog := time.AfterFunc(limit+15*time.Second, func() {
		fmt.Fprintf(os.Stderr, "%s: FAIL: still running %v after the time limit; exiting\n", name, 15*time.Second)
		os.Exit(2)
	})
	defer watchdog.Stop()

	err := fn(ctx)
	took := time.Since(start).Round(time.Millisecond)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: FAIL after %v: %v\n", name, took, err)
		return 1
	}
	fmt.Printf("%s: PASS in %v\n", name, took)
	return 0
}

// Env is what an example connects to. Close deletes what the run left.
type Env struct {
	// Name is unique to the run: the work queue's name and the store's
	// Redis key prefix.
	Name string
	// RedisAddr and AMQPURL are where the services were found.
	RedisAddr, AMQPURL string
	// Redis is a client for RedisAddr; nil after ConnectBroker.
	Redis *redis.Client
	// Conn is a connection to AMQPURL for the self-check's own use
	// (publishing, reading the dead-letter queue, an RPC server).
	Conn *amqp.Connection
}

// Connect reads REDIS_ADDR and AMQP_URL (defaults DefaultRedisAddr and
// DefaultAMQPURL), checks that both services answer and names the run
// "amqpidem-example-<example>-<time>". Its error says what to start when a
// service cannot be reached.
func Connect(ctx context.Context, example string) (*Env, error) {
	e := newEnv(example)

	redis.SetLogger(quiet{}) // the error below says it all
	e.Redis = redis.NewClient(&redis.Options{Addr: e.RedisAddr, MaxRetries: 1})
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if err := e.Redis.Ping(pctx).Err(); err != nil {
		e.Redis.Close()
		return nil, fmt.Errorf("cannot connect to Redis at %s: %v\n"+
			"  Start Redis and RabbitMQ with `make services` (from the repository root),\n"+
			"  or point REDIS_ADDR=host:port at a running Redis", e.RedisAddr, err)
	}

	if err := e.dialBroker(); err != nil {
		e.Redis.Close()
		return nil, err
	}
	return e, nil
}

// ConnectBroker is Connect without Redis, for an example whose store is
// elsewhere: Env.Redis stays nil.
func ConnectBroker(example string) (*Env, error) {
	e := newEnv(example)
	if err := e.dialBroker(); err != nil {
		return nil, err
	}
	return e, nil
}

func newEnv(example string) *Env {
	return &Env{
		Name:      "amqpidem-example-" + example + "-" + time.Now().UTC().Format("20060102T150405.000000"),
		RedisAddr: envOr("REDIS_ADDR", DefaultRedisAddr),
		AMQPURL:   envOr("AMQP_URL", DefaultAMQPURL),
	}
}

// dialBroker sets e.Conn, or says what to start.
func (e *Env) dialBroker() error {
	conn, err := Dial(e.AMQPURL, e.Name)
	if err != nil {
		return fmt.Errorf("cannot connect to RabbitMQ at %s: %v\n"+
			"  Start the services with `make services` (from the repository root),\n"+
			"  or point AMQP_URL=amqp://user:pass@host:port/ at a running RabbitMQ", redactURL(e.AMQPURL), err)
	}
	e.Conn = conn
	return nil
}

// Start is Connect, then a Redis store under the run's prefix (checked,
// logging to log) and the run's queue declared, as main.go's wiring does
// them. On success the caller closes the Env; on an error Start has.
func Start(ctx context.Context, example string, log *slog.Logger) (*Env, *lock.RedisStore, error) {
	e, err := Connect(ctx, example)
	if err != nil {
		return nil, nil, err
	}
	store, err := lock.NewRedisStore(e.Redis, lock.Config{Prefix: e.Name, Logger: log})
	if err == nil {
		err = store.Check(ctx)
	}
	if err == nil {
		// Declared before the first (mandatory) publish, as the
		// Consumer's default declaration does.
		err = e.DeclareQueue(e.Name)
	}
	if err != nil {
		return nil, nil, errors.Join(err, e.Close())
	}
	return e, store, nil
}

// Dial opens an AMQP connection named name (as the management UI shows it),
// giving up after 5 s.
func Dial(url, name string) (*amqp.Connection, error) {
	// amqp091-go's parse error quotes the URL, password included.
	if _, err := amqp.ParseURI(url); err != nil {
		return nil, secret.ParseError("AMQP_URL", url, err)
	}
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(name)
	return amqp.DialConfig(url, amqp.Config{
		Dial:       amqp.DefaultDial(5 * time.Second),
		Heartbeat:  10 * time.Second,
		Locale:     "en_US",
		Properties: props,
	})
}

// DeclareQueue declares queue as the Consumer's default declaration does
// (durable, no arguments), so that messages published before a consumer
// starts are kept.
func (e *Env) DeclareQueue(queue string) error {
	ch, err := e.Conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	_, err = ch.QueueDeclare(queue, true, false, false, false, nil)
	return err
}

// DrainQueue takes every message from queue (acking it) and returns them.
// A queue that does not exist is empty.
func (e *Env) DrainQueue(queue string) ([]amqp.Delivery, error) {
	ch, err := e.Conn.Channel()
	if err != nil {
		return nil, err
	}
	defer ch.Close()
	if _, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err != nil {
		var aerr *amqp.Error
		if errors.As(err, &aerr) && aerr.Code == amqp.NotFound {
			return nil, nil
		}
		return nil, err
	}
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			return out, err
		}
		if !ok {
			return out, nil
		}
		out = append(out, d)
	}
}

// Close deletes the run's queues (Name and Name.dlq, plus extra) and its
// Redis records (keys "Name:*", if it has Redis), and closes the
// connections. The delay
// queues amqpidem declares ("Name.delay.<ms>") delete themselves about a
// minute after their last use. Close is best effort: it returns what
// failed, for the example to print.
func (e *Env) Close(extra ...string) error {
	var errs []error
	// A fresh connection: Conn may be closed if the example failed on it.
	if conn, err := Dial(e.AMQPURL, e.Name+"-cleanup"); err != nil {
		errs = append(errs, fmt.Errorf("cleanup: %w", err))
	} else {
		for _, q := range append([]string{e.Name, e.Name + ".dlq"}, extra...) {
			ch, err := conn.Channel()
			if err != nil {
				errs = append(errs, fmt.Errorf("cleanup: %w", err))
				break
			}
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				errs = append(errs, fmt.Errorf("cleanup: delete queue %s: %w", q, err))
			}
			ch.Close()
		}
		conn.Close()
	}
	if e.Conn != nil {
		e.Conn.Close()
	}

	if e.Redis == nil {
		return errors.Join(errs...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	iter := e.Redis.Scan(ctx, 0, e.Name+":*", 500).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	if err := iter.Err(); err != nil {
		errs = append(errs, fmt.Errorf("cleanup: scan redis: %w", err))
	}
	for len(keys) > 0 {
		n := min(len(keys), 500)
		if err := e.Redis.Unlink(ctx, keys[:n]...).Err(); err != nil {
			errs = append(errs, fmt.Errorf("cleanup: delete redis keys: %w", err))
			break
		}
		keys = keys[n:]
	}
	e.Redis.Close()
	return errors.Join(errs...)
}

// quiet is a go-redis logger that says nothing.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// redactURL hides the password of an AMQP URL, also of one that does not
// parse.
func redactURL(url string) string { return secret.URL(url) }
