// Command amqpidem looks into and repairs what an amqpidem consumer keeps:
// the record of an idempotency key (inspect, forget), the messages its
// handler staged (outbox redrive) and the dead letters of a queue (dlq
// list, dlq replay); and it runs the relay of pgstore's producer outbox
// (relay; relay list, status, redrive); console serves a web page of
// records and dead letters. Run "amqpidem --help" for the commands,
// "amqpidem <command> --help" for one.
//
// Exit codes: 0 done; 1 failed (a service could not be reached, a publish
// was not confirmed); 2 bad usage; 3 nothing found (no record, no
// matching dead letter, no staged message to publish, no dead row to
// re-drive); 4 refused (a live
// lease without --force, a record that changed meanwhile, dead letters or
// staged messages left in place, a bulk action the operator did not
// confirm).
//
// Bulk actions (dlq replay --all --forget, relay redrive --all, outbox
// redrive without --index) ask before changing anything when stdin is a
// terminal, and need --yes when it is not (exit code 2 without it).
// --dry-run on every command that changes something says what it would
// do and changes nothing.
//
// SIGINT or SIGTERM asks a command to stop where it safely can; a second
// one ends it at once.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
)

// Exit codes.
const (
	exitOK       = 0
	exitFailed   = 1
	exitUsage    = 2
	exitNotFound = 3
	exitRefused  = 4
)

// codeError is an error with the exit code it ends the command with.
type codeError struct {
	code int
	err  error
}

func (e *codeError) Error() string { return e.err.Error() }
func (e *codeError) Unwrap() error { return e.err }

func withCode(code int, format string, args ...any) error {
	return &codeError{code: code, err: fmt.Errorf(format, args...)}
}

// options are the flags every command takes.
type options struct {
	redisURL    string
	redisAddrs  []string
	redisMaster string
	pgDSN       string
	pgSchema    string
	pgTable     string
	dynamo      dynamoOptions
	prefix      string
	amqpURL     string
	json        bool
	timeout     time.Duration

	stdout, stderr io.Writer
	progress       bool // stderr is a terminal: show progress
	// stdin is where the operator answers a question before a bulk
	// action (consent); only asked when stdinTerminal.
	stdin         io.Reader
	stdinTerminal bool
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// The first signal asks the command to stop, cleanly; once it has,
	// the signals' default action is back: a second one ends the
	// process at once, whatever it waits for.
	unhook := context.AfterFunc(ctx, stop)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	unhook()
	stop()
	os.Exit(code)
}

// run runs the command line args and returns the exit code; bulk actions
// ask on os.Stdin when it is a terminal.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runWithStdin(ctx, args, os.Stdin, isTerminalFile(os.Stdin), stdout, stderr)
}

// runWithStdin is run with the stdin bulk actions ask on, and whether it
// is a terminal (else they need --yes).
func runWithStdin(ctx context.Context, args []string, stdin io.Reader, stdinTerminal bool, stdout, stderr io.Writer) int {
	o := &options{stdout: stdout, stderr: stderr, progress: isTerminal(stderr), stdin: stdin, stdinTerminal: stdinTerminal}
	root := newRoot(o)
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	return codeOf(root.ExecuteContext(ctx), stderr)
}

// codeOf is the exit code of a command that returned err, which it
// writes to stderr.
func codeOf(err error, stderr io.Writer) int {
	if err == nil {
		return exitOK
	}
	msg := err.Error()
	if strings.HasPrefix(msg, "unknown command ") {
		// Cobra's, with its suggestions on lines of their own: each line
		// escaped, the line breaks and indenting tabs kept.
		lines := strings.Split(strings.TrimRight(msg, "\n"), "\n")
		for i, l := range lines {
			rest := strings.TrimLeft(l, "\t")
			lines[i] = l[:len(l)-len(rest)] + escapeText(rest)
		}
		fmt.Fprintln(stderr, "amqpidem:", strings.Join(lines, "\n"))
	} else {
		fmt.Fprintln(stderr, "amqpidem:", escapeText(msg)) // errors quote keys, headers, store replies
	}
	var ce *codeError
	if errors.As(err, &ce) {
		return ce.code
	}
	// Cobra's own errors are about the command line: unknown command or
	// flag, wrong number of arguments.
	return exitUsage
}

func newRoot(o *options) *cobra.Command {
	root := &cobra.Command{
		Use:   "amqpidem",
		Short: "Inspect and repair amqpidem's records, staged messages and dead letters; relay the producer outbox",
		Long: `amqpidem looks into what amqpidem consumers keep and repairs it:
the record of an idempotency key in the store (Redis, or PostgreSQL with
--postgres, or DynamoDB with --dynamodb-table) with the messages its
handler staged, and the dead letters of a queue in RabbitMQ; and it runs
the relay of pgstore's producer outbox (relay), and lists and re-drives
its rows; console serves a web page of records and dead letters.

Services come from flags, else from the environment:
  AMQPIDEM_REDIS_URL     (default redis://127.0.0.1:6379/0)
  AMQPIDEM_REDIS_ADDRS   (a Redis Cluster's nodes, or with
                         AMQPIDEM_REDIS_MASTER a Sentinel set's)
  AMQPIDEM_POSTGRES_DSN  (uses the PostgreSQL store instead of Redis)
  AMQPIDEM_DYNAMODB_TABLE     (uses the DynamoDB store instead of Redis;
                              AWS credentials and region as the AWS SDK finds them)
  AMQPIDEM_DYNAMODB_ENDPOINT  (a local DynamoDB-compatible server)
  AMQPIDEM_PREFIX        (the store's lock.Config.Prefix, default amqpidem)
  AMQPIDEM_AMQP_URL      (default amqp://guest:guest@127.0.0.1:5672/)

Exit codes: 0 done, 1 failed, 2 bad usage, 3 nothing found,
4 refused or left undone (see the message).`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return withCode(exitUsage, "%w (see %s --help)", err, c.CommandPath())
	})
	f := root.PersistentFlags()
	f.StringVar(&o.redisURL, "redis", env("AMQPIDEM_REDIS_URL", "redis://127.0.0.1:6379/0"), "Redis `URL` of the store")
	f.StringSliceVar(&o.redisAddrs, "redis-addrs", envList("AMQPIDEM_REDIS_ADDRS"), "Redis Cluster nodes, or Sentinels with --redis-master (`host:port,...`); credentials from AMQPIDEM_REDIS_USERNAME and AMQPIDEM_REDIS_PASSWORD")
	f.StringVar(&o.redisMaster, "redis-master", env("AMQPIDEM_REDIS_MASTER", ""), "the Sentinel master `name`: --redis-addrs are Sentinels")
	f.StringVar(&o.pgDSN, "postgres", env("AMQPIDEM_POSTGRES_DSN", ""), "PostgreSQL `DSN` of a pgstore store (instead of Redis)")
	f.StringVar(&o.pgSchema, "pg-schema", "", "pgstore Config.Schema (default: the search_path)")
	f.StringVar(&o.pgTable, "pg-table", "", "pgstore Config.Table (default amqpidem_records)")
	addDynamoFlags(root, &o.dynamo)
	f.StringVar(&o.prefix, "prefix", env("AMQPIDEM_PREFIX", ""), "the store's lock.Config.Prefix (default amqpidem)")
	f.StringVar(&o.amqpURL, "amqp", env("AMQPIDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ `URL`")
	f.BoolVar(&o.json, "json", false, "print JSON for scripts instead of text for people")
	f.DurationVar(&o.timeout, "timeout", 30*time.Second, "give up on a connection (dial and handshake) or a service call after this long")
	hideEnvDefault(root, "redis", "AMQPIDEM_REDIS_URL")
	hideEnvDefault(root, "postgres", "AMQPIDEM_POSTGRES_DSN")
	hideEnvDefault(root, "dynamodb-endpoint", "AMQPIDEM_DYNAMODB_ENDPOINT")
	hideEnvDefault(root, "amqp", "AMQPIDEM_AMQP_URL")

	root.AddCommand(newInspect(o), newForget(o), newOutbox(o), newDLQ(o), newRelay(o), newConsole(o))
	return root
}

// env returns the environment variable name, or def when it is empty.
func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// envList splits the environment variable name at commas; nil when empty.
func envList(name string) []string {
	if v := os.Getenv(name); v != "" {
		return strings.Split(v, ",")
	}
	return nil
}

// exactArgs is cobra.ExactArgs with a usage exit code.
func exactArgs(n int, what string) cobra.PositionalArgs {
	return func(c *cobra.Command, args []string) error {
		if len(args) != n {
			return withCode(exitUsage, "%s takes %s (see %s --help)", c.CommandPath(), what, c.CommandPath())
		}
		return nil
	}
}

// isTerminal reports whether w is a character device (a terminal).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
