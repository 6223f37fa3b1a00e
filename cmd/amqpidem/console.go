package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/spf13/cobra"

	"github.com/amqpidem/amqpidem/console"
	"github.com/amqpidem/amqpidem/internal/secret"
	"github.com/amqpidem/amqpidem/lock"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// consoleTokenEnv holds the token the console asks of every request.
const consoleTokenEnv = "AMQPIDEM_CONSOLE_TOKEN"

// minConsoleToken is the shortest token the console takes.
const minConsoleToken = 16

func newConsole(o *options) *cobra.Command {
	var f dlqFlags
	var listen, tokenFile, outboxTable, metricsURL string
	metricsInterval := 10 * time.Second
	var readOnly bool
	var queues []string
	leaseTTL := lock.DefaultLeaseTTL
	limit, listScan := 100, 2000
	c := &cobra.Command{
		Use:   "console [--listen 127.0.0.1:8080] [--queue Q]... [--read-only]",
		Short: "Serve a web console of records, dead letters and the relay (forget, replay, redrive after confirmation)",
		Long: `console serves a web console on --listen: an overview of the --queue
queues with the depth of their dead-letter queues and their records
counted by state (exactly with --postgres when the count fits in 100 ms,
else among a first page, marked "at least"), with --metrics-url charts of
a consumer's delivery rates read from its Prometheus metrics, an
endpoint's records by state page by page (failed, expired leases, leases
whose heartbeat stalled under --lease-ttl, ...), the record of a key (as inspect shows it), with
--postgres the producer outbox's pending and dead rows (as relay status
and relay list read them), and the dead letters of a queue (as dlq list reads them:
without consuming them; on a quorum dead-letter queue with a delivery
limit each page load counts as a delivery of each message read). It uses
the same store and broker flags and environment as the other commands.

It forgets a failed record and replays the dead letters of a key, each
only after a page that says what it means and what a dry run of it
reports, and a confirmation (a POST carrying the page's CSRF token): by
the rules of forget (only a failed record, and only the one shown), of
dlq replay (--key, with --forget when asked) and of relay redrive (a
dead row by its ID), run by this process as
the commands run them; each action is logged on stderr. --read-only
leaves out the actions: the console changes nothing and names the
commands to run. Every value from a message or a record is shown escaped;
no URL or DSN is shown with its password.

It listens on the loopback interface unless --listen names another
address, which it refuses unless a token is set: in AMQPIDEM_CONSOLE_TOKEN
or a --token-file (at least 16 bytes, e.g. openssl rand -hex 32). With a
token, every request needs it, as "Authorization: Bearer TOKEN" or as the
password of basic auth (any user name: what a browser asks for); serve it
behind TLS (a reverse proxy) off the loopback interface. Without a token
it answers only requests naming a loopback host (localhost, 127.0.0.1,
[::1]), so that a web page in the operator's browser cannot reach it by
rebinding a name of its own to 127.0.0.1.

It runs until interrupted (exit code 0).`,
		Example: `  amqpidem console --queue payments --queue orders
  AMQPIDEM_CONSOLE_TOKEN=$(openssl rand -hex 32) amqpidem console --listen 0.0.0.0:8080`,
		Args: exactArgs(0, "no arguments"),
		RunE: func(c *cobra.Command, _ []string) error {
			token, err := consoleToken(tokenFile)
			if err != nil {
				return err
			}
			loopback, err := loopbackAddr(listen)
			if err != nil {
				return err
			}
			if !loopback && token == nil {
				return withCode(exitUsage, "--listen %s is not a loopback address: the console refuses to serve it without a token "+
					"(set %s or --token-file), or listen on 127.0.0.1", listen, consoleTokenEnv)
			}
			signingKey, err := f.signingKey()
			if err != nil {
				return err
			}
			ctx, cancel := callContext(c, o)
			admin, closeStore, err := o.openStore(ctx)
			cancel()
			if err != nil {
				return err
			}
			defer closeStore()
			if _, err := amqp.ParseURI(o.amqpURL); err != nil {
				return withCode(exitUsage, "%w", secret.ParseError("--amqp", o.amqpURL, err))
			}
			logger := slog.New(slog.NewTextHandler(o.stderr, nil))
			cfg := console.Config{Admin: admin, StoreName: o.storeName(),
				Dial: o.dial, BrokerName: "RabbitMQ at " + secret.URL(o.amqpURL), SigningKey: signingKey,
				Queues: queues, DeadLetterLimit: limit, ListScan: listScan, LeaseTTL: leaseTTL, Timeout: o.timeout, Logger: logger}
			if o.pgDSN != "" {
				ro := &relayOptions{table: outboxTable}
				ob, pool, err := o.openOutbox(c.Context(), ro)
				if err != nil {
					return err
				}
				defer pool.Close()
				cfg.Relay, cfg.RelayName = outboxRelay{ob}, "outbox "+o.outboxTable(ro)
			}
			if metricsURL != "" {
				u, err := url.Parse(metricsURL)
				if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
					return withCode(exitUsage, "--metrics-url %s: want an http or https URL of a consumer's /metrics", secret.URL(metricsURL))
				}
				cfg.Metrics = &promamqpidem.Scraper{URL: metricsURL, Client: &http.Client{Timeout: min(o.timeout, metricsInterval)}}
				cfg.MetricsName, cfg.MetricsInterval = secret.URL(metricsURL), metricsInterval
			}
			if !readOnly {
				cfg.Actions = &consoleActions{o: o, admin: admin, keyFile: f.keyFile, outboxTable: outboxTable}
			}
			h, err := console.New(cfg)
			if err != nil {
				return withCode(exitUsage, "%w", err)
			}
			defer h.Close()
			return serveConsole(c.Context(), o, listen, guard(h, token), token != nil, readOnly)
		},
	}
	c.Flags().StringVar(&listen, "listen", "127.0.0.1:8080", "the `address` to serve on (host:port)")
	c.Flags().StringSliceVar(&queues, "queue", nil, "a `queue` the overview lists, with its dead-letter queue's depth (repeat, or comma-separated)")
	c.Flags().StringVar(&tokenFile, "token-file", "", "a `file` holding the token every request must carry (default: "+consoleTokenEnv+")")
	c.Flags().StringVar(&f.keyFile, "signing-key-file", "", "a `file` holding the consumers' Config.SigningKey (default: AMQPIDEM_SIGNING_KEY)")
	c.Flags().BoolVar(&readOnly, "read-only", false, "offer no action: change nothing, only show")
	c.Flags().StringVar(&outboxTable, "outbox-table", "", "pgstore Config.OutboxTable of the relay page, with --postgres (default amqpidem_outbox)")
	c.Flags().IntVar(&limit, "limit", limit, "read at most this many dead letters per page (at most 1000)")
	c.Flags().StringVar(&metricsURL, "metrics-url", "", "a consumer's Prometheus `URL` (promamqpidem's metrics, e.g. http://127.0.0.1:9090/metrics): the overview charts its rates")
	c.Flags().DurationVar(&metricsInterval, "metrics-interval", metricsInterval, "how often to read --metrics-url (the charts keep the last 10 minutes)")
	c.Flags().DurationVar(&leaseTTL, "lease-ttl", leaseTTL, "the consumers' lease `TTL` (their Config.LeaseTTL): a lease not renewed for 2/3 of it is shown as a stalled heartbeat")
	c.Flags().IntVar(&listScan, "list-scan", listScan, "read at most about this many records of the store per records page (at most 100000)")
	return c
}

// consoleToken is the console's token: the contents of file (without a
// final newline), else AMQPIDEM_CONSOLE_TOKEN; nil when neither is given.
// It is never a flag's value, which ps shows.
func consoleToken(file string) ([]byte, error) {
	token := []byte(os.Getenv(consoleTokenEnv))
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, withCode(exitUsage, "--token-file: %w", err)
		}
		token = bytes.TrimRight(b, "\r\n")
	}
	if len(token) == 0 {
		return nil, nil
	}
	if len(token) < minConsoleToken {
		return nil, withCode(exitUsage, "the console's token is %d bytes; it needs at least %d (e.g. openssl rand -hex 32)", len(token), minConsoleToken)
	}
	return token, nil
}

// loopbackAddr reports whether addr, a host:port to listen on, is on the
// loopback interface only: "localhost" or a loopback IP. An empty host
// (":8080") is every interface.
func loopbackAddr(addr string) (bool, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false, withCode(exitUsage, "--listen %q: %v (want host:port, e.g. 127.0.0.1:8080)", addr, err)
	}
	return loopbackHost(host), nil
}

// loopbackHost reports whether host names the loopback interface.
func loopbackHost(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// guard asks every request for token when it is set; without a token it
// answers only requests whose Host names the loopback interface (a name
// rebound to 127.0.0.1 by a web page is refused).
func guard(h http.Handler, token []byte) http.Handler {
	want := sha256.Sum256(token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if token == nil {
			host, _, err := net.SplitHostPort(r.Host)
			if err != nil {
				host = r.Host
			}
			if !loopbackHost(strings.Trim(host, "[]")) {
				http.Error(w, "This console answers only requests to localhost, 127.0.0.1 or [::1] when it has no token.", http.StatusForbidden)
				return
			}
			h.ServeHTTP(w, r)
			return
		}
		var got string
		if b, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			got = b
		} else if _, p, ok := r.BasicAuth(); ok {
			got = p
		}
		sum := sha256.Sum256([]byte(got))
		if got == "" || subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Basic realm="amqpidem console", charset="UTF-8"`)
			http.Error(w, "This console needs its token: as a bearer token, or as the password of basic auth (any user name).", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// serveConsole serves h on listen until ctx ends.
func serveConsole(ctx context.Context, o *options, listen string, h http.Handler, auth, readOnly bool) error {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return withCode(exitFailed, "--listen %s: %w", listen, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second,
		WriteTimeout: o.timeout + 30*time.Second, IdleTimeout: 2 * time.Minute,
		ErrorLog: slog.NewLogLogger(slog.NewTextHandler(o.stderr, nil).WithAttrs([]slog.Attr{slog.String("from", "http")}), slog.LevelWarn)}
	how := "no token: loopback requests only"
	if auth {
		how = "token required"
	}
	mode := "forget and replay after confirmation"
	if readOnly {
		mode = "read-only"
	}
	fmt.Fprintf(o.stderr, "amqpidem console: serving http://%s/ (%s; %s); interrupt to stop\n", ln.Addr(), mode, how)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return withCode(exitFailed, "console: %w", err)
	case <-ctx.Done():
	}
	shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shut); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return withCode(exitFailed, "console: %w", err)
	}
	return nil
}
