// Command containers starts throwaway service containers with
// testcontainers-go for the integration tests of github.com/amqpidem/amqpidem,
// which run it (package internal/testenv) when neither the environment nor
// the local default ports offer a Redis or a RabbitMQ and a Docker engine
// answers. It is a module of its own so that testcontainers-go and the Docker
// client stay out of the main module's go.mod and go.sum, and so out of the
// go.sum of every module that imports amqpidem.
//
// Usage, from this directory:
//
//	go run . [-timeout 5m] redis|rabbitmq|postgres|dynamodb|dynamodb-local ...
//
// It starts one container per argument (redis:7.0-alpine with
// --maxmemory-policy noeviction; rabbitmq:3.13-alpine; postgres:15-alpine
// with trust authentication and a database named test;
// amazon/dynamodb-local:2.5.2 in memory, with -sharedDb for dynamodb and
// without for dynamodb-local), waits until each
// is ready, and prints one line per service on standard output, in the
// order of the arguments:
//
//	REDIS_ADDR=127.0.0.1:32768
//	AMQP_URL=amqp://guest:guest@127.0.0.1:32769/
//	PG_DSN=postgres://postgres@127.0.0.1:32770/test?sslmode=disable
//	DYNAMODB_ENDPOINT=http://127.0.0.1:32771
//	DYNAMODB_LOCAL_ENDPOINT=http://127.0.0.1:32772
//
// Then it keeps the containers until its standard input reaches end of file
// (Ctrl-D in a terminal) or it receives SIGINT or SIGTERM, removes them and
// exits. If it is killed instead, testcontainers' reaper (Ryuk) removes them
// (unless TESTCONTAINERS_RYUK_DISABLED=true). Progress and errors go to
// standard error.
//
// Exit status: 0 after a clean stop, 1 on any other failure, 2 for bad
// arguments, and 3 when no Docker engine answers (standard error then says
// "containers: no Docker engine: ...").
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/wait"
)

// Exit statuses.
const (
	exitFailure  = 1
	exitUsage    = 2
	exitNoDocker = 3
)

// dockerProbeTimeout bounds the check that a Docker engine answers.
const dockerProbeTimeout = 10 * time.Second

// A service is one kind of container this program can start.
type service struct {
	image string
	port  string // container port, such as "6379/tcp"
	opts  []testcontainers.ContainerCustomizer
	// line formats the line printed for the service from the host:port the
	// container port is published on.
	line func(hostPort string) string
}

var services = map[string]service{
	"redis": {
		image: "redis:7.0-alpine",
		port:  "6379/tcp",
		opts: []testcontainers.ContainerCustomizer{
			testcontainers.WithCmd("redis-server", "--maxmemory-policy", "noeviction"),
			testcontainers.WithWaitStrategy(
				wait.ForLog("Ready to accept connections"),
				wait.ForListeningPort("6379/tcp"),
			),
		},
		line: func(hp string) string { return "REDIS_ADDR=" + hp },
	},
	"rabbitmq": {
		image: "rabbitmq:3.13-alpine",
		port:  "5672/tcp",
		opts: []testcontainers.ContainerCustomizer{
			testcontainers.WithWaitStrategyAndDeadline(2*time.Minute,
				wait.ForLog("Server startup complete"),
				wait.ForListeningPort("5672/tcp"),
			),
		},
		line: func(hp string) string { return "AMQP_URL=amqp://guest:guest@" + hp + "/" },
	},
	"postgres": {
		image: "postgres:15-alpine",
		port:  "5432/tcp",
		opts: []testcontainers.ContainerCustomizer{
			testcontainers.WithEnv(map[string]string{
				"POSTGRES_HOST_AUTH_METHOD": "trust",
				"POSTGRES_DB":               "test",
			}),
			testcontainers.WithWaitStrategyAndDeadline(2*time.Minute,
				// The entrypoint starts the server twice: once to
				// initialise the database, then for good.
				wait.ForLog("database system is ready to accept connections").WithOccurrence(2),
				wait.ForListeningPort("5432/tcp"),
			),
		},
		line: func(hp string) string { return "PG_DSN=postgres://postgres@" + hp + "/test?sslmode=disable" },
	},
	"dynamodb": {
		image: "amazon/dynamodb-local:2.5.2",
		port:  "8000/tcp",
		opts: []testcontainers.ContainerCustomizer{
			testcontainers.WithCmd("-jar", "DynamoDBLocal.jar", "-inMemory", "-sharedDb"),
			testcontainers.WithWaitStrategyAndDeadline(2*time.Minute, wait.ForListeningPort("8000/tcp")),
		},
		line: func(hp string) string { return "DYNAMODB_ENDPOINT=http://" + hp },
	},
	// The tests' second DynamoDB server, as scripts/dynamodb-local.sh runs
	// it: a database per access key and region (no -sharedDb).
	"dynamodb-local": {
		image: "amazon/dynamodb-local:2.5.2",
		port:  "8000/tcp",
		opts: []testcontainers.ContainerCustomizer{
			testcontainers.WithCmd("-jar", "DynamoDBLocal.jar", "-inMemory", "-disableTelemetry"),
			testcontainers.WithWaitStrategyAndDeadline(2*time.Minute, wait.ForListeningPort("8000/tcp")),
		},
		line: func(hp string) string { return "DYNAMODB_LOCAL_ENDPOINT=http://" + hp },
	},
}

func main() {
	os.Exit(run())
}

func run() int {
	timeout := flag.Duration("timeout", 5*time.Minute, "bound on pulling and starting all the containers")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: go run . [-timeout 5m] redis|rabbitmq|postgres|dynamodb|dynamodb-local ...\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		return exitUsage
	}
	for _, name := range flag.Args() {
		if _, ok := services[name]; !ok {
			fmt.Fprintf(os.Stderr, "containers: unknown service %q; want redis, rabbitmq, postgres, dynamodb or dynamodb-local\n", name)
			return exitUsage
		}
	}

	// stop ends with standard input, SIGINT or SIGTERM, whichever comes
	// first, during the start as well as after it.
	stop, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()

	if err := probeDocker(dockerProbeTimeout); err != nil {
		fmt.Fprintf(os.Stderr, "containers: no Docker engine: %v\n", err)
		return exitNoDocker
	}

	var started []testcontainers.Container
	defer func() {
		for _, c := range started {
			if err := testcontainers.TerminateContainer(c); err != nil {
				fmt.Fprintf(os.Stderr, "containers: removing %s: %v\n", c.GetContainerID(), err)
			}
		}
	}()

	ctx, cancelStart := context.WithTimeout(stop, *timeout)
	defer cancelStart()
	var lines []string
	for _, name := range flag.Args() {
		s := services[name]
		fmt.Fprintf(os.Stderr, "containers: starting %s\n", s.image)
		c, hostPort, err := start(ctx, s)
		if c != nil {
			started = append(started, c)
		}
		if err != nil {
			if stop.Err() != nil {
				err = fmt.Errorf("%w (standard input closed, or SIGINT or SIGTERM received, before it was ready)", err)
			}
			fmt.Fprintf(os.Stderr, "containers: starting %s: %v\n", s.image, err)
			return exitFailure
		}
		fmt.Fprintf(os.Stderr, "containers: %s ready at %s\n", s.image, hostPort)
		lines = append(lines, s.line(hostPort))
	}
	for _, l := range lines {
		if _, err := fmt.Println(l); err != nil {
			fmt.Fprintf(os.Stderr, "containers: %v\n", err)
			return exitFailure
		}
	}

	<-stop.Done()
	fmt.Fprintf(os.Stderr, "containers: removing %d container(s)\n", len(started))
	return 0
}

// start runs s's container and returns it with the host:port its port is
// published on. The container may be non-nil with an error: it must still be
// removed.
func start(ctx context.Context, s service) (testcontainers.Container, string, error) {
	opts := append([]testcontainers.ContainerCustomizer{testcontainers.WithExposedPorts(s.port)}, s.opts...)
	c, err := testcontainers.Run(ctx, s.image, opts...)
	if c == nil { // not a nil *DockerContainer in a non-nil interface
		return nil, "", err
	}
	if err != nil {
		return c, "", err
	}
	hostPort, err := c.PortEndpoint(ctx, s.port, "")
	return c, hostPort, err
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
