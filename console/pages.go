package console

import (
	"context"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/internal/operator"
	"github.com/amqpidem/amqpidem/lock"
)

// funcs are the templates' functions. esc is operator.Escape: every value
// from a message, a record or a store goes through it before
// html/template escapes it for HTML.
var funcs = template.FuncMap{
	"esc":  operator.Escape,
	"when": when,
	// secs is a duration to the second, for a table.
	"secs": func(d time.Duration) time.Duration { return d.Round(time.Second) },
	"dash": func(s string) string {
		if s == "" {
			return "-"
		}
		return s
	},
}

// when formats a time for people: UTC, to the millisecond; "-" when zero.
func when(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02T15:04:05.000Z")
}

// page is what every page shows around its content.
type page struct {
	Title      string
	StoreName  string
	BrokerName string
	// Actions: the console offers forget and replay (else it is
	// read-only).
	Actions bool
}

func (c *Console) page(title string) page {
	return page{Title: title, StoreName: c.cfg.StoreName, BrokerName: c.cfg.BrokerName, Actions: c.cfg.Actions != nil}
}

// queueDepth is a queue of the overview with its dead-letter queue.
type queueDepth struct {
	Queue, DLQ string
	Messages   int
	// Missing: the dead-letter queue does not exist (no dead letter yet).
	Missing bool
	// Err says why its depth is unknown.
	Err string
}

func (c *Console) overview(w http.ResponseWriter, r *http.Request) {
	data := struct {
		page
		Queues   []queueDepth
		QueueErr string
		// Counts are the queues' endpoints' records by state; CountErr
		// says why there are none.
		Counts      []stateCount
		CountErr    string
		Scan        int
		LeaseTTL    time.Duration
		CountBudget time.Duration
		// Relay is the outbox's backlog (when Config.Relay is set).
		Relay *relayStatus
		// Rates are the charts of Config.Metrics (when it is set).
		Rates *rates
	}{page: c.page("amqpidem console"), Scan: overviewScan, LeaseTTL: c.cfg.LeaseTTL, CountBudget: c.cfg.CountBudget}
	if c.sampler != nil {
		rt := c.sampler.rates()
		rt.Source = c.cfg.MetricsName
		data.Rates = &rt
	}
	if c.cfg.Relay != nil {
		ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
		st := c.relayStatus(ctx, r)
		cancel()
		data.Relay = &st
	}
	if len(c.cfg.Queues) > 0 {
		if l, p := c.lister(); p != nil {
			data.CountErr = p.What
		} else {
			ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
			data.Counts = c.counts(ctx, l)
			cancel()
		}
	}
	if len(c.cfg.Queues) > 0 && c.cfg.Dial != nil {
		ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
		defer cancel()
		qs, err := c.depths(ctx)
		if err != nil {
			data.QueueErr = fmt.Sprintf("%s: %v", c.brokerName(), err)
			c.cfg.Logger.Warn("amqpidem console: a service failed", "path", r.URL.Path, "service", "broker", "err", err)
		}
		data.Queues = qs
	} else {
		for _, q := range c.cfg.Queues {
			data.Queues = append(data.Queues, queueDepth{Queue: q, DLQ: q + ".dlq", Err: "no broker configured"})
		}
	}
	c.render(w, r, http.StatusOK, "overview.html", data)
}

// depths reads the depth of each configured queue's dead-letter queue.
func (c *Console) depths(ctx context.Context) ([]queueDepth, error) {
	out := make([]queueDepth, len(c.cfg.Queues))
	for i, q := range c.cfg.Queues {
		out[i] = queueDepth{Queue: q, DLQ: q + ".dlq", Err: "not read"}
	}
	conn, err := c.dial(ctx)
	if err != nil {
		return out, err
	}
	defer conn.Close()
	for i := range out {
		if ctx.Err() != nil {
			return out, ctx.Err()
		}
		// A channel per queue: a passive declare of a missing queue
		// closes the channel.
		ch, err := conn.Channel()
		if err != nil {
			return out, err
		}
		q, err := ch.QueueDeclarePassive(out[i].DLQ, true, false, false, false, nil)
		var ae *amqp.Error
		switch {
		case errors.As(err, &ae) && ae.Code == amqp.NotFound:
			out[i].Missing, out[i].Err = true, ""
		case err != nil:
			out[i].Err = err.Error()
		default:
			out[i].Messages, out[i].Err = q.Messages, ""
			ch.Close()
		}
	}
	return out, nil
}

// dial opens a connection with Config.Dial, giving up when ctx ends (the
// connection, if it comes later, is closed).
func (c *Console) dial(ctx context.Context) (*amqp.Connection, error) {
	type dialed struct {
		conn *amqp.Connection
		err  error
	}
	done := make(chan dialed, 1)
	go func() {
		conn, err := c.cfg.Dial()
		done <- dialed{conn, err}
	}()
	select {
	case d := <-done:
		return d.conn, d.err
	case <-ctx.Done():
		go func() {
			if d := <-done; d.conn != nil {
				d.conn.Close()
			}
		}()
		return nil, ctx.Err()
	}
}

func (c *Console) brokerName() string {
	if c.cfg.BrokerName != "" {
		return c.cfg.BrokerName
	}
	return "RabbitMQ"
}

func (c *Console) storeName() string {
	if c.cfg.StoreName != "" {
		return c.cfg.StoreName
	}
	return "the store"
}

// recordView is a record as the key page shows it.
type recordView struct {
	Key, Endpoint string
	lock.Record
	Lease       string
	Live        bool
	Health      leaseHealth
	ResultBytes int
	Outbox      []stagedView
	OutboxErr   string
	// Forget is the command that forgets the record, --dry-run first (""
	// when the key cannot be typed back safely).
	Forget string
}

// stagedView is a staged message as the key page shows it.
type stagedView struct {
	Index                           int
	State                           string
	Tries                           int
	Exchange, RoutingKey, MessageID string
	Bytes                           int
}

func (c *Console) key(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	endpoint, key := q.Get("endpoint"), q.Get("key")
	if endpoint == "" || key == "" || len(key) > lock.MaxKeyLen || len(endpoint) > lock.MaxKeyLen {
		c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "Which key?",
			What: "A key page needs the consumer's endpoint (its Config.Endpoint, by default its queue) and the message's key, " +
				fmt.Sprintf("each at most %d bytes.", lock.MaxKeyLen),
			Do: "Fill in both in the overview's form.", Overview: true})
		return
	}
	if c.cfg.Admin == nil {
		c.problem(w, r, &problem{Status: http.StatusServiceUnavailable, Title: "No store",
			What: "This console was given no store to read records from.",
			Do:   "Give it the consumers' store (Config.Admin; the command's --redis, --postgres or --dynamodb-table).", Overview: true})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	skey := amqpidem.StoreKey(endpoint, key)
	rec, err := c.cfg.Admin.Inspect(ctx, skey)
	if err != nil {
		c.problem(w, r, c.recordProblem(r, endpoint, key, skey, err))
		return
	}
	v := recordView{Key: key, Endpoint: endpoint, Record: rec, Lease: operator.LeaseText(rec), Live: rec.Live(),
		Health: health(rec, c.cfg.LeaseTTL)}
	if rec.State == lock.StateCompleted {
		v.ResultBytes = len(amqpidem.StoredResult(rec.Value))
		msgs, err := amqpidem.StoredOutbox(rec.Value)
		if err != nil {
			v.OutboxErr = err.Error()
		}
		for i, m := range msgs {
			v.Outbox = append(v.Outbox, stagedView{Index: i, State: m.State.String(), Tries: m.Tries, Exchange: m.Exchange,
				RoutingKey: m.RoutingKey, MessageID: m.Msg.MessageId, Bytes: len(m.Msg.Body)})
		}
	}
	if typable(key) && typable(endpoint) {
		v.Forget = fmt.Sprintf("%s forget %s --endpoint %s --dry-run", c.cfg.Commands, shellQuote(key), shellQuote(endpoint))
	}
	c.render(w, r, http.StatusOK, "key.html", struct {
		page
		R recordView
	}{c.page("key " + operator.Escape(key)), v})
}

// recordProblem is the page for err, the error of reading the record of
// key of endpoint (store key skey).
func (c *Console) recordProblem(r *http.Request, endpoint, key, skey string, err error) *problem {
	switch {
	case errors.Is(err, lock.ErrNotFound):
		return &problem{Status: http.StatusNotFound, Title: "No record",
			What: fmt.Sprintf("Key %q of endpoint %q has no record in %s: never seen, expired, or forgotten.", key, endpoint, c.storeName()),
			Do: "Check the endpoint (a consumer's Config.Endpoint, when it is not its queue) and the key; " +
				"a store with another prefix or database holds other records.", Overview: true}
	case errors.Is(err, lock.ErrInvalidKey):
		return &problem{Status: http.StatusBadRequest, Title: "Not a key",
			What: fmt.Sprintf("Key %q: %v", key, operator.KeyFree(err, skey)), Do: "Check the key.", Overview: true}
	}
	return c.failed(r, operator.KeyFree(err, skey), c.storeName(),
		"Check that the store is up and reachable from this console, then reload.")
}

// letterView is a dead letter as the queue's page shows it.
type letterView struct {
	operator.DeadLetter
	// Replay is the command that replays it ("" when its key cannot be
	// typed safely).
	Replay string
}

func (c *Console) deadLetters(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	queue, dlq := q.Get("queue"), q.Get("dlq")
	dlqParam := dlq
	if queue == "" || len(queue) > 255 || len(dlq) > 255 {
		c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "Which queue?",
			What: "A dead-letter page needs the queue whose dead letters to show (a name of at most 255 bytes); " +
				"its dead-letter queue is QUEUE.dlq unless dlq names another.",
			Do: "Fill in the queue in the overview's form.", Overview: true})
		return
	}
	if dlq == "" {
		dlq = queue + ".dlq"
	}
	limit := c.cfg.DeadLetterLimit
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > maxDeadLetterLimit {
			c.problem(w, r, &problem{Status: http.StatusBadRequest, Title: "Bad limit",
				What: fmt.Sprintf("limit %q is not a number from 1 to %d.", s, maxDeadLetterLimit),
				Do:   "Ask for fewer, or leave limit out.", Overview: true})
			return
		}
		limit = n
	}
	if c.cfg.Dial == nil {
		c.problem(w, r, &problem{Status: http.StatusServiceUnavailable, Title: "No broker",
			What: "This console was given no RabbitMQ to read dead letters from.",
			Do:   "Give it the broker (Config.Dial; the command's --amqp).", Overview: true})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), c.cfg.Timeout)
	defer cancel()
	count, list, err := c.peek(ctx, dlq, limit)
	if err != nil {
		c.problem(w, r, c.failed(r, err, c.brokerName(), "Check that RabbitMQ is up and reachable from this console, then reload."))
		return
	}
	views := make([]letterView, len(list))
	unproven, unchecked := 0, 0
	for i, dl := range list {
		views[i] = letterView{DeadLetter: dl}
		if typable(dl.Key) && typable(queue) {
			views[i].Replay = fmt.Sprintf("%s dlq replay %s --key %s --dry-run", c.cfg.Commands, shellQuote(queue), shellQuote(dl.Key))
			if dlq != queue+".dlq" && typable(dlq) {
				views[i].Replay += " --dlq " + shellQuote(dlq)
			}
		}
		switch dl.Origin {
		case operator.OriginUnsigned, operator.OriginBad:
			unproven++
		case operator.OriginUnchecked:
			unchecked++
		}
	}
	c.render(w, r, http.StatusOK, "dlq.html", struct {
		page
		Queue, DLQ, DLQParam string
		Count                int
		Letters              []letterView
		Unproven, Unchecked  int
	}{c.page("dead letters of " + operator.Escape(queue)), queue, dlq, dlqParam, count, views, unproven, unchecked})
}

// peek reads up to limit messages of the queue dlq without acknowledging
// them, as "amqpidem dlq list" does, and gives them back by closing the
// connection; count is how many the queue held.
func (c *Console) peek(ctx context.Context, dlq string, limit int) (count int, list []operator.DeadLetter, err error) {
	select {
	case c.dlqTurn <- struct{}{}:
		defer func() { <-c.dlqTurn }()
	case <-ctx.Done():
		return 0, nil, fmt.Errorf("another page was reading a dead-letter queue: %w", ctx.Err())
	}
	conn, err := c.dial(ctx)
	if err != nil {
		return 0, nil, err
	}
	defer conn.Close() // gives back every message read
	ch, err := conn.Channel()
	if err != nil {
		return 0, nil, err
	}
	q, err := ch.QueueDeclarePassive(dlq, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return 0, nil, &problem{Status: http.StatusNotFound, Title: "No such dead-letter queue",
			What: fmt.Sprintf("Queue %q does not exist in %s: no dead letter yet, or the dead-letter queue has another name.", dlq, c.brokerName()),
			Do:   "Check the queue's name; give dlq when the consumer's Config.DeadLetterRoutingKey names another.", Overview: true}
	}
	if err != nil {
		return 0, nil, err
	}
	for len(list) < min(limit, q.Messages) {
		if err := ctx.Err(); err != nil {
			return 0, nil, err
		}
		d, ok, err := ch.Get(dlq, false)
		if err != nil {
			return 0, nil, err
		}
		if !ok {
			break
		}
		list = append(list, operator.Describe(len(list)+1, &d, c.cfg.SigningKey))
	}
	return q.Messages, list, nil
}

// typable reports whether s can be put in a command line shown on a page
// and typed back as it is: printable, without escapes.
func typable(s string) bool { return s != "" && operator.Escape(s) == s }

// shellQuote quotes s for a POSIX shell: in single quotes, each single
// quote as '\”.
func shellQuote(s string) string {
	if strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
