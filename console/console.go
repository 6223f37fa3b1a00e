package console

import (
	"bytes"
	"context"
	"crypto/rand"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// Config says where the console reads from. Every field is optional: a
// page whose service is not configured says so.
type Config struct {
	// Admin reads the records of keys: the consumers' store (every Store
	// of this module is a lock.Admin), with the consumers' Prefix.
	Admin lock.Admin
	// StoreName names the store on pages and in messages, e.g. "Redis at
	// 127.0.0.1:6379". Shown as given: never put a password in it.
	StoreName string
	// Dial opens a connection to RabbitMQ; a page that reads dead letters
	// opens one and closes it before it answers, which gives back every
	// message it read.
	Dial func() (*amqp.Connection, error)
	// BrokerName names the broker on pages and in messages, e.g.
	// "RabbitMQ at amqp://guest:xxxxx@127.0.0.1:5672/". Shown as given.
	BrokerName string
	// SigningKey is the consumers' amqpidem.Config.SigningKey: dead
	// letters whose signature checks out under it are shown "signed".
	// Without it, signed ones are shown "unchecked".
	SigningKey []byte
	// Queues are the queues the overview lists, with the depth of each
	// one's dead-letter queue (QUEUE.dlq).
	Queues []string
	// DeadLetterLimit is how many dead letters a page reads at most
	// (default 100; a page's limit parameter may ask for fewer, or up to
	// 1000).
	DeadLetterLimit int
	// ListScan bounds the records a records page reads from the store
	// (lock.ListRequest.Scan, summed over its List calls): default 2000,
	// at most 100,000. A page shows about 50 records; when the
	// records read hold fewer that pass its filter, it links to the
	// next page, which goes on where this one stopped.
	ListScan int
	// Relay reads the producer outbox for the relay page and the
	// overview's backlog; nil: no relay page. With Actions that are a
	// Redriver, dead rows can be redriven after confirmation.
	Relay Relay
	// RelayName names the outbox on pages, e.g. "outbox
	// public.amqpidem_outbox". Shown as given.
	RelayName string
	// Metrics reads the consumers' delivery counters: with it, the
	// overview charts each queue's rates (processed, completed,
	// duplicates, requeued, dead-lettered per second) over the last
	// MetricsWindow. A *promamqpidem.Metrics (the consumer's own, when
	// the console runs in its process) or a *promamqpidem.Scraper (a
	// consumer's /metrics URL) is one. New starts a goroutine that reads
	// it every MetricsInterval; Close stops it. Nil: no charts.
	Metrics Metrics
	// MetricsName names the metrics' source on the overview, e.g.
	// "http://127.0.0.1:9090/metrics". Shown as given.
	MetricsName string
	// MetricsInterval is how often Metrics is read (default 10 s, at
	// least 100 ms); each read is bounded by Timeout and by the
	// interval.
	MetricsInterval time.Duration
	// MetricsWindow is how far back the charts go (default 10 minutes):
	// the console keeps MetricsWindow/MetricsInterval+1 samples, at most
	// 1000, each a few numbers per queue (of Queues; without Queues, of
	// the first 20 queues the metrics name).
	MetricsWindow time.Duration
	// LeaseTTL is the lease TTL the consumers use (amqpidem.Config.LeaseTTL,
	// else their store's lock.Config.LeaseTTL): default
	// lock.DefaultLeaseTTL, as theirs. A record stores its lease's
	// deadline, not its last renewal: the console shows TTL minus the
	// time left as how long ago a lease was renewed, and flags a live
	// lease not renewed for more than two heartbeat intervals (2/3 of the
	// TTL: the heartbeat renews every TTL/3) as stalled. Told a TTL longer
	// than the consumers', it flags healthy leases (each looks renewed at
	// least the difference ago); shorter, it flags stalls late (when less
	// than a third of the shorter TTL is left), and a lease with more left
	// than LeaseTTL is shown without an age.
	LeaseTTL time.Duration
	// CountBudget bounds the time the store may take to count the
	// endpoints' records for the overview when it is a lock.Counter
	// (default 100 ms, shared by the endpoints of a page load; pgstore's
	// statement timeout): over it, or with a
	// store that cannot count (Redis, DynamoDB: only by a full scan), the
	// overview counts among the first 1000 or so records the store lists
	// and marks the counts as lower bounds.
	CountBudget time.Duration
	// Timeout bounds each page's service calls (default 10 s).
	Timeout time.Duration
	// Logger gets a line per page that failed (a service down, a panic),
	// without keys or message contents; default slog.Default().
	Logger *slog.Logger
	// Actions carries out forget and replay, each after a confirmation
	// page; nil: the console is read-only.
	Actions Actions
	// Commands names the command the pages suggest for actions (default
	// "amqpidem"), e.g. with the flags that reach the same services.
	Commands string
}

// maxDeadLetterLimit bounds a page's limit parameter.
const maxDeadLetterLimit = 1000

// maxListScan bounds Config.ListScan.
const maxListScan = 100000

//go:embed assets
var assets embed.FS

// Console is the console's http.Handler. It is safe for concurrent use.
type Console struct {
	cfg   Config
	pages *template.Template
	mux   *http.ServeMux
	// dlqTurn is held while a page reads a dead-letter queue: two page
	// loads reading at once would each see only part of it.
	dlqTurn chan struct{}
	// csrfKey makes the CSRF tokens of confirmation pages; origins
	// refuses cross-origin POSTs.
	csrfKey [32]byte
	origins *http.CrossOriginProtection
	// sampler reads Config.Metrics; nil without.
	sampler *sampler
}

// New returns the console for cfg. Mount it behind authentication: it has
// none of its own. With Config.Metrics it starts reading the metrics;
// Close stops that.
func New(cfg Config) (*Console, error) {
	if cfg.DeadLetterLimit <= 0 {
		cfg.DeadLetterLimit = 100
	}
	if cfg.DeadLetterLimit > maxDeadLetterLimit {
		return nil, fmt.Errorf("console: DeadLetterLimit %d is more than %d", cfg.DeadLetterLimit, maxDeadLetterLimit)
	}
	if cfg.ListScan <= 0 {
		cfg.ListScan = defaultListScan
	}
	if cfg.ListScan > maxListScan {
		return nil, fmt.Errorf("console: ListScan %d is more than %d", cfg.ListScan, maxListScan)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.CountBudget <= 0 {
		cfg.CountBudget = 100 * time.Millisecond
	}
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = lock.DefaultLeaseTTL
	}
	if cfg.LeaseTTL < lock.MinTTL {
		return nil, fmt.Errorf("console: LeaseTTL %v is below lock.MinTTL %v", cfg.LeaseTTL, lock.MinTTL)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Commands == "" {
		cfg.Commands = "amqpidem"
	}
	if cfg.MetricsInterval == 0 {
		cfg.MetricsInterval = defaultMetricsInterval
	}
	if cfg.MetricsWindow == 0 {
		cfg.MetricsWindow = defaultMetricsWindow
	}
	if cfg.MetricsInterval < 100*time.Millisecond {
		return nil, fmt.Errorf("console: MetricsInterval %v is below 100ms", cfg.MetricsInterval)
	}
	if cfg.MetricsWindow < cfg.MetricsInterval {
		return nil, fmt.Errorf("console: MetricsWindow %v is shorter than MetricsInterval %v", cfg.MetricsWindow, cfg.MetricsInterval)
	}
	pages, err := template.New("").Funcs(funcs).ParseFS(assets, "assets/*.html")
	if err != nil {
		return nil, fmt.Errorf("console: %w", err)
	}
	c := &Console{cfg: cfg, pages: pages, mux: http.NewServeMux(), dlqTurn: make(chan struct{}, 1),
		origins: http.NewCrossOriginProtection()}
	rand.Read(c.csrfKey[:])
	c.mux.HandleFunc("GET /{$}", c.overview)
	c.mux.HandleFunc("GET /forget", c.forgetForm)
	c.mux.HandleFunc("POST /forget", c.forget)
	c.mux.HandleFunc("GET /replay", c.replayForm)
	c.mux.HandleFunc("POST /replay", c.replayPost)
	c.mux.HandleFunc("GET /key", c.key)
	c.mux.HandleFunc("GET /dlq", c.deadLetters)
	c.mux.HandleFunc("GET /records", c.records)
	c.mux.HandleFunc("GET /relay", c.relay)
	c.mux.HandleFunc("GET /redrive", c.redriveForm)
	c.mux.HandleFunc("POST /redrive", c.redrive)
	c.mux.HandleFunc("GET /style.css", c.style)
	if cfg.Metrics != nil {
		c.sampler = newSampler(cfg.Metrics, cfg.Queues, cfg.MetricsInterval, cfg.MetricsWindow, cfg.Timeout)
		go c.sampler.run()
	}
	return c, nil
}

// Close stops the goroutine that reads Config.Metrics, and waits for it
// (a read in flight is cancelled). The console still serves pages, without
// new samples. Close is idempotent, and does nothing without
// Config.Metrics; a Console with Metrics must be closed.
func (c *Console) Close() error {
	if c.sampler != nil {
		c.sampler.close()
	}
	return nil
}

// ServeHTTP serves the console's pages. Every response forbids scripts,
// framing and loading from elsewhere, is not cached and sends no Referer;
// a method other than GET or HEAD, or an unknown path, gets a page saying
// so.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			c.cfg.Logger.Error("amqpidem console: a page failed", "path", r.URL.Path, "panic", fmt.Sprint(v))
			c.problem(w, r, &problem{Status: http.StatusInternalServerError, Title: "This page failed",
				What: "The console failed while making this page; the failure is in its log.",
				Do:   "Reload the page. If it fails again, report it with the log line (it names no key)."})
		}
	}()
	post := r.Method == http.MethodPost && (r.URL.Path == "/forget" || r.URL.Path == "/replay" || r.URL.Path == "/redrive")
	if r.Method != http.MethodGet && r.Method != http.MethodHead && !post {
		h.Set("Allow", "GET, HEAD")
		c.problem(w, r, &problem{Status: http.StatusMethodNotAllowed, Title: "Not here",
			What: "This page only shows; it answers only GET and HEAD. Changes are posted from a confirmation page.",
			Do:   "Start from a record or a dead letter, or run the command each page names.", Overview: true})
		return
	}
	if _, pattern := c.mux.Handler(r); pattern == "" {
		c.problem(w, r, &problem{Status: http.StatusNotFound, Title: "No such page",
			What: "The console has an overview, a page per key, pages of an endpoint's records by state, a page per queue's dead letters and the relay's rows, nothing else here.",
			Do:   "Start from the overview.", Overview: true})
		return
	}
	c.mux.ServeHTTP(w, r)
}

// problem is a page saying what went wrong and what to do about it.
type problem struct {
	Status int
	Title  string
	// What happened; Do, what to do. Both may quote input: they are
	// escaped like every other value.
	What, Do string
	// Overview: link back to the overview.
	Overview bool
}

func (p *problem) Error() string { return p.Title + ": " + p.What }

// problem writes p as a page.
func (c *Console) problem(w http.ResponseWriter, r *http.Request, p *problem) {
	c.render(w, r, p.Status, "problem.html", p)
}

// render writes the page name with data and status.
func (c *Console) render(w http.ResponseWriter, r *http.Request, status int, name string, data any) {
	var b bytes.Buffer
	if err := c.pages.ExecuteTemplate(&b, name, data); err != nil {
		c.cfg.Logger.Error("amqpidem console: rendering a page failed", "page", name, "err", err)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusInternalServerError)
		fmt.Fprintln(w, "The console failed while making this page; the failure is in its log. Reload the page.")
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	if r.Method != http.MethodHead {
		w.Write(b.Bytes())
	}
}

// style serves the console's style sheet.
func (c *Console) style(w http.ResponseWriter, r *http.Request) {
	b, _ := assets.ReadFile("assets/style.css")
	w.Header().Set("Content-Type", "text/css; charset=utf-8")
	w.Header().Set("Cache-Control", "max-age=300")
	if r.Method != http.MethodHead {
		w.Write(b)
	}
}

// failed is the problem page for err, an error of a service: a problem as
// it is, else "the service did not answer" (503) naming it.
func (c *Console) failed(r *http.Request, err error, service, do string) *problem {
	var p *problem
	if errors.As(err, &p) {
		return p
	}
	if errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("no answer within %v", c.cfg.Timeout)
	}
	c.cfg.Logger.Warn("amqpidem console: a service failed", "path", r.URL.Path, "service", service, "err", err)
	return &problem{Status: http.StatusServiceUnavailable, Title: service + " did not answer",
		What: fmt.Sprintf("%s: %v", service, err), Do: do, Overview: true}
}
