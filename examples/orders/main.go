// Command orders is amqpidem's showcase: three consumers share one queue of
// payments and charge each payment exactly as often as it should be,
// although the queue delivers duplicates.
//
// It publishes 40 payments, many of them two to four times, some copies
// while the first is still being charged. One payment takes four times the
// 1 s lease TTL (the heartbeat keeps its lease), one always fails (retried
// with backoff, then dead-lettered after MaxAttempts) and one is declined
// for good (amqpidem.Permanent: dead-lettered at once). Every outcome is
// logged in colour; a summary follows, and the program exits non-zero
// unless every payment ran exactly as often as its story says.
//
// Run it with `make demo`, or `go run ./examples/orders` once Redis and
// RabbitMQ are up (`make services`). REDIS_ADDR and AMQP_URL override the
// defaults 127.0.0.1:6379 and amqp://guest:guest@127.0.0.1:5672/.
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
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
	"github.com/amqpidem/amqpidem/lock"
)

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

func main() { demo.Main("orders", timeLimit, run) }

// payment is the message body.
type payment struct {
	ID     string `json:"payment_id"`
	Amount int    `json:"amount_cents"`
}

func run(ctx context.Context) (err error) {
	log := demo.Logger()
	env, err := demo.Connect(ctx, "orders")
	if err != nil {
		return err
	}
	defer func() {
		if cerr := env.Close(); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()

	// One store, shared by every consumer: the lease on a payment id is
	// what keeps two consumers from charging it at the same time.
	store, err := lock.NewRedisStore(env.Redis, lock.Config{Prefix: env.Name, Logger: log})
	if err != nil {
		return err
	}
	if err := store.Check(ctx); err != nil {
		return err
	}
	if err := env.DeclareQueue(env.Name); err != nil {
		return err
	}

	tally := demo.NewTally()
	bank := newBank(log)
	cfg := amqpidem.Config{
		Queue:       env.Name,
		LeaseTTL:    leaseTTL,
		Retention:   time.Hour, // the idempotency window; a demo needs little
		MaxAttempts: maxAttempts,
		// Retry after about 100 ms, then 200 ms; the third failure is final.
		Backoff:         amqpidem.Exponential(100*time.Millisecond, time.Second),
		InProgressDelay: 500 * time.Millisecond,
		// A copy of a declined payment is acked and dropped: the first
		// copy is already in the dead-letter queue.
		FailedDuplicate: amqpidem.AckFailedDuplicate,
		Observer:        tally,
		Logger:          log,
	}

	var wg sync.WaitGroup
	var running []*amqpidem.Consumer
	runErrs := make(chan error, consumers)
	for i := range consumers {
		c := cfg
		c.ConsumerName = fmt.Sprintf("orders-%d", i+1) // logged with every outcome
		consumer, err := amqpidem.NewConsumer(store, amqpidem.ConsumerConfig{
			Config:   c,
			URL:      env.AMQPURL,
			Prefetch: 4, // small, so that the work spreads over the consumers
		}, bank.handler(c.ConsumerName))
		if err != nil {
			return err
		}
		running = append(running, consumer)
		wg.Go(func() {
			if err := consumer.Run(ctx); !errors.Is(err, amqpidem.ErrConsumerClosed) {
				runErrs <- fmt.Errorf("%s: %w", c.ConsumerName, err)
			}
		})
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		errs := make([]error, len(running))
		var stopping sync.WaitGroup
		for i, c := range running {
			stopping.Go(func() { errs[i] = c.Shutdown(sctx) })
		}
		stopping.Wait()
		wg.Wait()
		if serr := errors.Join(errs...); serr != nil {
			err = errors.Join(err, fmt.Errorf("shutdown: %w", serr))
		}
	}()

	pub, err := demo.NewPublisher(env.Conn)
	if err != nil {
		return err
	}
	defer pub.Close()
	published := 0
	send := func(i int) error {
		published++
		id := paymentID(i)
		body, _ := json.Marshal(payment{ID: id, Amount: 500 + i*137%9500})
		return pub.Publish(ctx, env.Name, amqp.Publishing{
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
	case <-bank.slowStarted:
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
	select {
	case rerr := <-runErrs:
		err = errors.Join(err, rerr)
	default:
	}
	if err != nil {
		return fmt.Errorf("waiting for %d messages to settle: %w", published, err)
	}

	dead, err := env.DrainQueue(env.Name + ".dlq")
	if err != nil {
		return fmt.Errorf("reading the dead-letter queue: %w", err)
	}
	return report(tally, bank, published, dead)
}

// bank is the side effect: an in-memory ledger of charges. It records
// every execution, who ran it, and refuses a fencing token that is not
// higher than the last one it saw for the payment, as a real downstream
// system should.
type bank struct {
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

func newBank(log *slog.Logger) *bank {
	return &bank{
		log: log, runs: map[string]int{}, fence: map[string]int64{}, by: map[string]int{},
		slowStarted: make(chan struct{}),
	}
}

// execute records one execution of id with fence, by consumer.
func (b *bank) execute(id string, fence int64, consumer string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.runs[id]++
	b.by[consumer]++
	if fence <= b.fence[id] {
		b.stale = append(b.stale, fmt.Sprintf("%s fence %d after %d", id, fence, b.fence[id]))
		return fmt.Errorf("ledger: %s: stale fence %d, already saw %d", id, fence, b.fence[id])
	}
	b.fence[id] = fence
	return nil
}

// handler is the payment handler as run by consumer.
func (b *bank) handler(consumer string) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		var p payment
		if err := json.Unmarshal(d.Body, &p); err != nil {
			return nil, amqpidem.Permanent(fmt.Errorf("bad payment: %w", err))
		}
		info, _ := amqpidem.FromContext(ctx)
		if err := b.execute(p.ID, info.Fence, consumer); err != nil {
			return nil, err
		}

		work := time.Duration(20+rand.IntN(80)) * time.Millisecond
		if p.ID == slowID {
			work = slowFor
			b.slowOnce.Do(func() { close(b.slowStarted) })
			b.log.Info("charging slowly, four times the lease TTL", "consumer", consumer,
				"key", p.ID, "fence", info.Fence, "work", work, "lease_ttl", leaseTTL)
		}
		start := time.Now()
		t := time.NewTimer(work)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done(): // lease lost or shutting down: stop charging
			return nil, context.Cause(ctx)
		}

		switch p.ID {
		case gatewayID:
			return nil, fmt.Errorf("payment gateway timed out (attempt %d)", info.Attempt)
		case declinedID:
			return nil, amqpidem.Permanent(errors.New("card declined"))
		}
		receipt := fmt.Sprintf("rcpt-%s-f%d", p.ID, info.Fence)
		b.mu.Lock()
		b.longest = max(b.longest, time.Since(start))
		b.mu.Unlock()
		return json.Marshal(map[string]any{"payment_id": p.ID, "receipt": receipt, "amount_cents": p.Amount})
	})
}

// report prints the summary and returns an error naming every payment that
// ran other than its story says.
func report(tally *demo.Tally, b *bank, published int, dead []amqp.Delivery) error {
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
