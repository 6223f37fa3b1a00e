// This file is not part of the template: copy main.go alone.
//
// It turns `go run ./examples/orders` (`make demo`) into amqpidem's
// showcase, a self-checking run of main.go's handler, config and serve:
// three consumers share one queue of payments and charge each payment
// exactly as often as it should be, although the queue delivers duplicates.
//
// It publishes 40 payments, many of them two to four times, some copies
// while the first is still being charged. One payment takes four times the
// 1 s lease TTL (the heartbeat keeps its lease), one always fails (retried
// with backoff, then dead-lettered after MaxAttempts) and one is declined
// for good (dead-lettered at once). Every outcome is logged in colour; a
// summary follows, and the program exits non-zero unless every payment ran
// exactly as often as its story says. It uses a queue and Redis prefix of
// its own and deletes them at the end.
//
// main.go's /metrics and /readyz are served too, on a free port of
// 127.0.0.1 (METRICS_ADDR is not read): /readyz must answer 200 while the
// consumers consume, and the amqpidem_messages_total counters scraped from
// /metrics at the end must say what the stories say, and agree with the
// outcomes the consumers reported.

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
	"github.com/amqpidem/amqpidem/promamqpidem"
)

// init runs the self-check in place of main, and exits.
func init() {
	if !testing.Testing() {
		demo.Main("orders", timeLimit, selfCheck)
	}
}

const (
	payments    = 40
	consumers   = 3
	leaseTTL    = time.Second
	slowFor     = 4 * leaseTTL
	maxAttempts = 3
	timeLimit   = 60 * time.Second
)

// The payments with a story; every other one is charged at the first try.
const (
	slow     = 7  // the bank is slow: 4 s, four lease TTLs
	gateway  = 13 // the gateway always times out: retried, then dead-lettered
	declined = 21 // the card is declined: dead-lettered at once
)

var (
	slowID     = paymentID(slow)
	gatewayID  = paymentID(gateway)
	declinedID = paymentID(declined)
)

func paymentID(i int) string { return fmt.Sprintf("pay-%03d", i) }

func selfCheck(ctx context.Context) (err error) {
	log := demo.Logger()
	// The store is shared by every consumer of the run: the lease on a key
	// is what keeps two of them from running it at once.
	env, store, err := demo.Start(ctx, "orders", log)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := env.Close(); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()

	tally := demo.NewTally()
	ledger := newDemoBank(log)
	cfg := config(env.Name, log) // main.go's, made quicker for a demo
	cfg.LeaseTTL = leaseTTL
	cfg.Retention = time.Hour
	cfg.MaxAttempts = maxAttempts
	// Retry after about 100 ms, then 200 ms; the third failure is final.
	cfg.Backoff = amqpidem.Exponential(100*time.Millisecond, time.Second)
	cfg.InProgressDelay = 500 * time.Millisecond
	// The metrics first: when the tally sees the last outcome, the
	// counters have it already.
	metrics := promamqpidem.New(promamqpidem.Options{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics)
	cfg.Observer = amqpidem.Observers(metrics, tally)

	// main.go's /metrics and /readyz, for all three consumers, on a free
	// port: runs in parallel never collide.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	base := "http://" + ln.Addr().String()
	log.Info("serving /metrics and /readyz", "url", base)
	var running []*amqpidem.Consumer
	ready := func(ctx context.Context) error {
		for _, c := range running {
			if err := c.Ready(ctx); err != nil {
				return err
			}
		}
		return nil
	}

	// The consumers stop when the check is done (or has failed): serve
	// shuts each down with a grace period, as main does on a signal.
	stop, stopConsumers := context.WithCancel(context.Background())
	var serving sync.WaitGroup
	serveErrs := make(chan error, consumers)
	defer func() {
		stopConsumers()
		serving.Wait()
		close(serveErrs)
		for serr := range serveErrs {
			err = errors.Join(err, serr)
		}
		// serve stopped serving /metrics and /readyz with its consumer.
		if conn, derr := net.Dial("tcp", ln.Addr().String()); derr == nil {
			conn.Close()
			err = errors.Join(err, errors.New("/metrics and /readyz still served after the consumers shut down"))
		}
	}()
	for i := range consumers {
		c := cfg
		c.ConsumerName = fmt.Sprintf("orders-%d", i+1) // logged with every outcome
		consumer, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
			Config:   c,
			URL:      env.AMQPURL,
			Prefetch: 4, // small, so that the work spreads over the consumers
		}, chargeHandler(ledger.as(c.ConsumerName)))
		if err != nil {
			ln.Close()
			for _, rc := range running { // never run: stops their heartbeats
				_ = rc.Shutdown(ctx)
			}
			return err
		}
		running = append(running, consumer)
	}
	for i, consumer := range running {
		clog := log.With("consumer", fmt.Sprintf("orders-%d", i+1))
		// The first consumer's serve serves /metrics and /readyz.
		var l net.Listener
		var ops http.Handler
		if i == 0 {
			l, ops = ln, opsHandler(reg, ready, clog)
		}
		serving.Go(func() {
			if err := serve(stop, consumer, l, ops, 10*time.Second, clog); err != nil {
				serveErrs <- fmt.Errorf("orders-%d: %w", i+1, err)
			}
		})
	}
	// Ready: every consumer consumes the queue, and Redis answers.
	if err := waitReady(ctx, base); err != nil {
		return err
	}

	pub := amqpidem.NewPublisher(env.Conn)
	defer pub.Close()
	published := 0
	send := func(i int) error {
		published++
		id := paymentID(i)
		body, _ := json.Marshal(payment{ID: id, Amount: 500 + i*137%9500})
		return pub.Publish(ctx, "", env.Name, amqp.Publishing{
			MessageId:   id, // the idempotency key (amqpidem.MessageID)
			ContentType: "application/json",
			Body:        body,
		})
	}
	ordinary := func(i int) bool { return i != slow && i != gateway && i != declined }

	// Wave 1: every payment once. Some are followed at once by one or two
	// copies, which reach a consumer while the first is being charged
	// (busy: requeued until it is done) or just after (duplicate: acked).
	log.Info("publishing payments", "payments", payments, "consumers", consumers, "lease_ttl", leaseTTL)
	for i := 1; i <= payments; i++ {
		extra := 0
		switch {
		case !ordinary(i):
		case i%8 == 0:
			extra = 2
		case i%5 == 0:
			extra = 1
		}
		for range 1 + extra {
			if err := send(i); err != nil {
				return err
			}
		}
	}

	// Two copies of the slow payment while it runs, long past its lease TTL.
	select {
	case <-ledger.slowStarted:
	case <-ctx.Done():
		return fmt.Errorf("waiting for %s to start: %w", slowID, context.Cause(ctx))
	}
	log.Info("the slow payment is running: publishing two copies of it", "key", slowID)
	for range 2 {
		if err := send(slow); err != nil {
			return err
		}
	}

	// Wave 2: once the ordinary payments are charged and the declined one
	// is dead-lettered, late copies: acked without running (the declined
	// one's copy is dropped).
	err = tally.Wait(ctx, func(c demo.Counts) bool {
		for i := 1; i <= payments; i++ {
			if ordinary(i) && c.Key(paymentID(i), amqpidem.Completed) == 0 {
				return false
			}
		}
		return c.Key(declinedID, amqpidem.DeadLettered) == 1
	})
	if err != nil {
		return fmt.Errorf("waiting for the first wave: %w", err)
	}
	log.Info("first wave charged: publishing late copies, and one of the declined payment")
	for i := 1; i <= payments; i++ {
		if ordinary(i) && i%3 == 0 {
			if err := send(i); err != nil {
				return err
			}
		}
	}
	if err := send(declined); err != nil {
		return err
	}

	// Done when every message published has settled for good; busy,
	// retried and abandoned deliveries come back, so they do not count.
	err = tally.Wait(ctx, func(c demo.Counts) bool { return c.Settled() >= published })
	if err != nil {
		return fmt.Errorf("waiting for %d messages to settle: %w", published, err)
	}

	dead, err := env.DrainQueue(env.Name + ".dlq")
	if err != nil {
		return fmt.Errorf("reading the dead-letter queue: %w", err)
	}
	scraped, err := scrape(ctx, base, env.Name)
	if err != nil {
		return err
	}
	return report(tally, ledger, published, dead, scraped)
}

type demoBank struct {
	log         *slog.Logger
	mu          sync.Mutex
	runs        map[string]int   // executions per payment
	fence       map[string]int64 // highest fence seen per payment
	by          map[string]int   // executions per consumer
	stale       []string         // fences refused
	longest     time.Duration    // the longest successful charge
	slowStarted chan struct{}    // closed when the slow payment starts
	slowOnce    sync.Once
}

func newDemoBank(log *slog.Logger) *demoBank {
	return &demoBank{
		log: log, runs: map[string]int{}, fence: map[string]int64{}, by: map[string]int{},
		slowStarted: make(chan struct{}),
	}
}

// as is the bank as consumer uses it.
func (b *demoBank) as(consumer string) bank { return consumerBank{b, consumer} }

type consumerBank struct {
	*demoBank
	consumer string
}

func (b consumerBank) Charge(ctx context.Context, p payment, fence int64) (string, error) {
	run, err := b.record(p.ID, fence, b.consumer)
	if err != nil {
		return "", err
	}
	work := time.Duration(20+rand.IntN(80)) * time.Millisecond
	if p.ID == slowID {
		work = slowFor
		b.slowOnce.Do(func() { close(b.slowStarted) })
		b.log.Info("charging slowly, four times the lease TTL", "consumer", b.consumer,
			"key", p.ID, "fence", fence, "work", work, "lease_ttl", leaseTTL)
	}
	start := time.Now()
	t := time.NewTimer(work)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done(): // lease lost or shutting down: stop charging
		return "", context.Cause(ctx)
	}

	switch p.ID {
	case gatewayID:
		return "", fmt.Errorf("payment gateway timed out (run %d)", run)
	case declinedID:
		return "", errDeclined
	}
	b.mu.Lock()
	b.longest = max(b.longest, time.Since(start))
	b.mu.Unlock()
	return fmt.Sprintf("rcpt-%s-f%d", p.ID, fence), nil
}

// record counts one execution of id with fence by consumer, and returns
// how many id has had.
func (b *demoBank) record(id string, fence int64, consumer string) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.runs[id]++
	b.by[consumer]++
	if fence <= b.fence[id] {
		b.stale = append(b.stale, fmt.Sprintf("%s fence %d after %d", id, fence, b.fence[id]))
		return 0, fmt.Errorf("%w: %s: %d, seen %d", errStaleFence, id, fence, b.fence[id])
	}
	b.fence[id] = fence
	return b.runs[id], nil
}

// checkMetrics compares what /metrics and /readyz said with the stories of
// the payments, as README's outcome table has them, and with the outcomes
// the consumers reported (c).
func checkMetrics(m scraped, c demo.Counts, published int) []string {
	var problems []string
	want := func(got, want int, what string) {
		if got != want {
			problems = append(problems, fmt.Sprintf("/metrics: %s: %d, want %d", what, got, want))
		}
	}
	completed := payments - 2 // all but the gateway's and the declined
	// New keys whose handler succeeded: completed, acked.
	want(m.messages[[2]string{"completed", ""}], completed, `messages_total{outcome="completed",reason=""}`)
	// Duplicates of completed work: acked without running. Every other
	// message published (the settled ones are all of them) is one.
	want(m.outcomes["duplicate"], published-completed-2-1, `messages_total{outcome="duplicate"}`)
	// The declined card: a permanent failure, dead-lettered at once. The
	// gateway: retried with backoff, dead-lettered when its attempts are
	// exhausted.
	want(m.messages[[2]string{"dead_lettered", "permanent failure"}], 1, `messages_total{outcome="dead_lettered",reason="permanent failure"}`)
	want(m.messages[[2]string{"dead_lettered", "attempts exhausted"}], 1, `messages_total{outcome="dead_lettered",reason="attempts exhausted"}`)
	want(m.outcomes["dead_lettered"], 2, `messages_total{outcome="dead_lettered"}`)
	want(m.messages[[2]string{"retried", "handler error"}], maxAttempts-1, `messages_total{outcome="retried",reason="handler error"}`)
	want(int(m.series["amqpidem_requeues_total{retried}"]), maxAttempts-1, `requeues_total{outcome="retried"}`)
	// The late copy of the declined payment: a duplicate of failed work,
	// acked (AckFailedDuplicate).
	want(m.messages[[2]string{"dropped", "failed duplicate"}], 1, `messages_total{outcome="dropped",reason="failed duplicate"}`)
	// Copies that came while their key was being charged: requeued, and
	// counted as the consumers reported them.
	for _, o := range []amqpidem.Outcome{amqpidem.Completed, amqpidem.Duplicate, amqpidem.Busy, amqpidem.Retried,
		amqpidem.DeadLettered, amqpidem.Dropped, amqpidem.Abandoned} {
		want(m.outcomes[o.String()], c.Total(o), fmt.Sprintf(`messages_total{outcome=%q}, as the consumers reported`, o))
	}
	want(int(m.series["amqpidem_store_call_duration_seconds{acquire}"]), len(c.Events()), "acquire calls, one per delivery")
	if m.series["amqpidem_lease_extensions_total{renewed}"] == 0 {
		problems = append(problems, "/metrics: no lease renewed, although the slow payment ran four lease TTLs")
	}
	want(int(m.series["amqpidem_handlers_in_flight"]), 0, "handlers_in_flight at the end")
	want(m.readyz, http.StatusOK, "/readyz while consuming")
	return problems
}

// outcomeCounts is "completed 38, duplicate 31, ..." in Outcome order.
func outcomeCounts(n map[string]int) string {
	var out []string
	for o := amqpidem.Completed; o <= amqpidem.Abandoned; o++ {
		out = append(out, fmt.Sprintf("%s %d", o, n[o.String()]))
	}
	return strings.Join(out, ", ")
}

// report prints the summary and returns an error naming every payment that
// ran other than its story says.
func report(tally *demo.Tally, b *demoBank, published int, dead []amqp.Delivery, m scraped) error {
	var problems []string
	b.mu.Lock()
	defer b.mu.Unlock()

	executed, once := 0, 0
	for i := 1; i <= payments; i++ {
		id := paymentID(i)
		want := 1
		if id == gatewayID {
			want = maxAttempts
		}
		got := b.runs[id]
		executed += got
		if got != want {
			problems = append(problems, fmt.Sprintf("%s executed %d times, want %d", id, got, want))
		} else if id != gatewayID && id != declinedID {
			once++
		}
	}
	problems = append(problems, b.stale...)

	inDLQ := map[string]int{}
	var dlq []string
	for _, d := range dead {
		inDLQ[d.MessageId]++
		dlq = append(dlq, fmt.Sprintf("%s (%v, attempt %v)", d.MessageId, d.Headers[amqpidem.HeaderReason], d.Headers[amqpidem.HeaderAttempt]))
	}
	sort.Strings(dlq)
	for _, id := range []string{gatewayID, declinedID} {
		if inDLQ[id] != 1 {
			problems = append(problems, fmt.Sprintf("%s is in the dead-letter queue %d times, want once", id, inDLQ[id]))
		}
		delete(inDLQ, id)
	}
	for id, n := range inDLQ {
		problems = append(problems, fmt.Sprintf("%s is in the dead-letter queue %d times, want never", id, n))
	}

	var out strings.Builder
	tally.View(func(c demo.Counts) {
		n := c.Total
		if got, want := n(amqpidem.Completed), payments-2; got != want {
			problems = append(problems, fmt.Sprintf("%d payments completed, want %d", got, want))
		}
		if got, want := n(amqpidem.DeadLettered), 2; got != want {
			problems = append(problems, fmt.Sprintf("%d messages dead-lettered, want %d", got, want))
		}
		problems = append(problems, checkMetrics(m, c, published)...)
		var spread []string
		for name, k := range b.by {
			spread = append(spread, fmt.Sprintf("%s %d", name, k))
		}
		slices.Sort(spread)

		line := func(label, format string, args ...any) {
			fmt.Fprintf(&out, "  %-17s %s\n", label, fmt.Sprintf(format, args...))
		}
		fmt.Fprintf(&out, "\nsummary (%d consumers on one queue, lease TTL %v, MaxAttempts %d)\n", consumers, leaseTTL, maxAttempts)
		line("published", "%d messages for %d unique payments", published, payments)
		line("executed", "%d handler runs: %d payments charged once, %s declined once, %s failed %d times",
			executed, once, declinedID, gatewayID, b.runs[gatewayID])
		line("", "by consumer: %s", strings.Join(spread, ", "))
		line("completed", "%d", n(amqpidem.Completed))
		line("duplicates acked", "%d (acked without running)", n(amqpidem.Duplicate))
		line("busy requeues", "%d (a copy came while another execution held the lease)", n(amqpidem.Busy))
		line("retried", "%d", n(amqpidem.Retried))
		line("dead-lettered", "%d; the dead-letter queue holds %d: %s", n(amqpidem.DeadLettered), len(dead), strings.Join(dlq, ", "))
		line("dropped", "%d (late copy of a declined payment)", n(amqpidem.Dropped))
		line("abandoned", "%d", n(amqpidem.Abandoned))
		line("slowest charge", "%v (%s; its %v lease was renewed throughout)", b.longest.Round(10*time.Millisecond), slowID, leaseTTL)
		line("/metrics", "amqpidem_messages_total: %s", outcomeCounts(m.outcomes))
		line("", "%v lease renewals, %v delayed requeues, %v handlers in flight at the end",
			m.series["amqpidem_lease_extensions_total{renewed}"],
			m.series["amqpidem_requeues_total{busy}"]+m.series["amqpidem_requeues_total{retried}"]+m.series["amqpidem_requeues_total{abandoned}"],
			m.series["amqpidem_handlers_in_flight"])
		line("/readyz", "%d while consuming", m.readyz)
	})
	fmt.Print(out.String())

	if len(problems) > 0 {
		return fmt.Errorf("%d problem(s):\n  %s", len(problems), strings.Join(problems, "\n  "))
	}
	fmt.Printf("  %-17s every payment ran exactly as often as it should\n", "ok")
	return nil
}
