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

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
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
	cfg.Observer = tally

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
			return err
		}
		serving.Go(func() {
			if err := serve(stop, consumer, 10*time.Second, log.With("consumer", c.ConsumerName)); err != nil {
				serveErrs <- fmt.Errorf("%s: %w", c.ConsumerName, err)
			}
		})
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
	return report(tally, ledger, published, dead)
}

// demoBank is main.go's bank as the self-check needs it: an in-memory
// ledger of charges that records every execution and who ran it, refuses a
// fencing token not above the last one it saw for the payment, and plays
// the stories of the slow, failing and declined payments.
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

// report prints the summary and returns an error naming every payment that
// ran other than its story says.
func report(tally *demo.Tally, b *demoBank, published int, dead []amqp.Delivery) error {
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
	})
	fmt.Print(out.String())

	if len(problems) > 0 {
		return fmt.Errorf("%d problem(s):\n  %s", len(problems), strings.Join(problems, "\n  "))
	}
	fmt.Printf("  %-17s every payment ran exactly as often as it should\n", "ok")
	return nil
}
