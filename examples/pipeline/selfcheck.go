// This file is not part of the template: copy main.go alone.
//
// It turns `go run ./examples/pipeline` into a self-checking run of
// main.go's two stages (handlers, consumer configs and serve) on queues of
// its own: 24 orders, many published two or three times, some copies late,
// are charged by stage 1, which stages an OrderPaid for each, and shipped
// by stage 2. Three orders and one more have a story:
//
//   - order-003, order-010, order-017: stage 1's first execution fails
//     after it charged the order and staged its OrderPaid (the self-check
//     wraps the handler and returns an error): that OrderPaid is not
//     published. The retry charges again (the bank charges an order id
//     once, as a provider with an idempotency key does), stages the
//     OrderPaid again, and that one is published;
//   - order-013: the card is declined: dead-lettered at once, nothing
//     staged, never shipped.
//
// At the end it checks that every order was charged once and shipped once
// (order-013 neither, and in the dead-letter queue once), and that the
// shipping queue received exactly the OrderPaid messages stage 1 reports
// it published after storing their outcome: re-publishes included, none
// from an execution that failed. The program exits non-zero otherwise. It
// uses queues and a Redis prefix of its own and deletes them at the end.

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/examples/internal/demo"
)

// init runs the self-check in place of main, and exits.
func init() {
	if !testing.Testing() {
		demo.Main("pipeline", timeLimit, selfCheck)
	}
}

const (
	orders    = 24
	leaseTTL  = time.Second
	timeLimit = 60 * time.Second
)

// The orders with a story; every other one is charged and shipped at the
// first try.
var (
	failsAfterStaging = []int{3, 10, 17} // stage 1's first execution fails after Stage
	declined          = 13               // the card is declined: dead-lettered at once
)

var declinedID = orderID(declined)

func orderID(i int) string { return fmt.Sprintf("order-%03d", i) }

func selfCheck(ctx context.Context) (err error) {
	log := demo.Logger()
	// One store for both stages, as in main.go; the orders queue is the
	// run's, the shipping queue named after it.
	env, store, err := demo.Start(ctx, "pipeline", log)
	if err != nil {
		return err
	}
	shipping := env.Name + ".shipping"
	defer func() {
		if cerr := env.Close(shipping, shipping+".dlq"); cerr != nil {
			log.Warn("cleanup incomplete", "error", cerr)
		}
	}()

	// ---- stage 1: main.go's handler, failing after Stage where the story says ----
	bank := newDemoBank(log)
	charge := chargeHandler(bank, shipping, log)
	var failedStaged atomic.Int32 // OrderPaid messages staged by executions that then failed
	failing := amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		result, err := charge.Handle(ctx, d)
		info, _ := amqpidem.FromContext(ctx)
		if err == nil && info.Attempt == 1 && slices.Contains(failsAfterStaging, orderNumber(info.Key)) {
			failedStaged.Add(1)
			log.Warn("self-check: failing stage 1 after it charged and staged OrderPaid", "key", info.Key)
			return nil, errors.New("self-check: failed after Stage, on the first attempt")
		}
		return result, err
	})
	tally1 := demo.NewTally()
	cfg1 := chargeConsumer(env.AMQPURL, env.Name, shipping, log) // main.go's, made quicker for a demo
	cfg1.ConsumerName = "charge"                                 // logged with every outcome
	cfg1.LeaseTTL = leaseTTL
	cfg1.Retention = time.Hour
	cfg1.InProgressDelay = 500 * time.Millisecond
	cfg1.Backoff = amqpidem.Exponential(100*time.Millisecond, time.Second)
	cfg1.Observer = tally1
	stage1, err := amqpidem.NewConsumer(store, cfg1, failing)
	if err != nil {
		return err
	}

	// ---- stage 2: main.go's handler ----
	warehouse := newDemoWarehouse(log)
	tally2 := demo.NewTally()
	cfg2 := shipConsumer(env.AMQPURL, shipping, log)
	cfg2.ConsumerName = "ship"
	cfg2.LeaseTTL = leaseTTL
	cfg2.Retention = time.Hour
	cfg2.InProgressDelay = 500 * time.Millisecond
	cfg2.Observer = tally2
	stage2, err := amqpidem.NewConsumer(store, cfg2, shipHandler(warehouse, log))
	if err != nil {
		_ = stage1.Shutdown(ctx) // never run: stops its heartbeat
		return err
	}

	// Both stages stop when the check is done (or has failed), as main's
	// do on a signal.
	stop, stopStages := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serve(stop, 10*time.Second, log, stage1, stage2) }()
	defer func() {
		stopStages()
		if serr := <-served; serr != nil {
			err = errors.Join(err, fmt.Errorf("stages: %w", serr))
		}
	}()

	pub := amqpidem.NewPublisher(env.Conn)
	defer pub.Close()
	published := 0
	send := func(i int) error {
		published++
		id := orderID(i)
		body, _ := json.Marshal(order{ID: id, AmountCents: 1000 + i*373%9000, ShipTo: fmt.Sprintf("%d Main Street", i)})
		return pub.Publish(ctx, "", env.Name, amqp.Publishing{
			MessageId:   id, // the idempotency key (amqpidem.MessageID)
			ContentType: "application/json",
			Body:        body,
		})
	}

	// Wave 1: every order once; some followed at once by one or two
	// copies, which find the order being charged (busy), its OrderPaid
	// being published (busy) or all done (duplicate: acked, nothing
	// published again).
	log.Info("publishing orders", "orders", orders, "orders_queue", env.Name, "shipping_queue", shipping, "lease_ttl", leaseTTL)
	for i := 1; i <= orders; i++ {
		extra := 0
		switch {
		case i%6 == 0:
			extra = 2
		case i%4 == 0 || i == failsAfterStaging[0]:
			extra = 1
		}
		for range 1 + extra {
			if err := send(i); err != nil {
				return err
			}
		}
	}
	err = tally1.Wait(ctx, func(c demo.Counts) bool {
		for i := 1; i <= orders; i++ {
			if i != declined && c.Key(orderID(i), amqpidem.Completed) == 0 {
				return false
			}
		}
		return c.Key(declinedID, amqpidem.DeadLettered) == 1
	})
	if err != nil {
		return fmt.Errorf("waiting for stage 1's first wave: %w", err)
	}

	// Wave 2: late copies, once every order is charged: acked without
	// running or publishing (the declined one's dropped).
	log.Info("every order charged: publishing late copies, and one of the declined order")
	for i := 5; i <= orders; i += 5 {
		if err := send(i); err != nil {
			return err
		}
	}
	if err := send(declined); err != nil {
		return err
	}

	// Done when every order message has settled for good, and stage 2 has
	// settled as many OrderPaid messages as stage 1 published; busy,
	// retried and abandoned deliveries come back, so they do not count.
	err = tally1.Wait(ctx, func(c demo.Counts) bool { return c.Settled() >= published })
	if err != nil {
		return fmt.Errorf("waiting for %d order messages to settle: %w", published, err)
	}
	var out outboxTotals
	tally1.View(func(c demo.Counts) { out = sumOutbox(c.Events()) })
	err = tally2.Wait(ctx, func(c demo.Counts) bool { return c.Settled() >= out.Published })
	if err != nil {
		return fmt.Errorf("waiting for stage 2 to settle the %d OrderPaid messages stage 1 published: %w", out.Published, err)
	}

	deadOrders, err := env.DrainQueue(env.Name + ".dlq")
	if err != nil {
		return fmt.Errorf("reading the orders' dead-letter queue: %w", err)
	}
	deadPaid, err := env.DrainQueue(shipping + ".dlq")
	if err != nil {
		return fmt.Errorf("reading the shipping dead-letter queue: %w", err)
	}
	return report(tally1, tally2, bank, warehouse, published, int(failedStaged.Load()), deadOrders, deadPaid)
}

// orderNumber is i of orderID(i), or 0.
func orderNumber(id string) int {
	var i int
	if _, err := fmt.Sscanf(id, "order-%d", &i); err != nil {
		return 0
	}
	return i
}

// outboxTotals adds up what stage 1's deliveries did with staged messages.
type outboxTotals struct{ Staged, Published, Republished, Returned int }

func sumOutbox(events []amqpidem.Event) outboxTotals {
	var t outboxTotals
	for _, e := range events {
		t.Staged += e.Outbox.Staged
		t.Published += e.Outbox.Published
		t.Republished += e.Outbox.Republished
		t.Returned += e.Outbox.Returned
	}
	return t
}

// demoBank is main.go's bank as the self-check needs it: it charges an
// idempotency key once, as a payment provider does, counts the calls
// (stage 1's executions) and the charges per order, and declines
// order-013.
type demoBank struct {
	log     *slog.Logger
	mu      sync.Mutex
	calls   map[string]int    // Charge calls per order
	charges map[string]int    // charges made per order
	byKey   map[string]string // receipts, by idempotency key
}

func newDemoBank(log *slog.Logger) *demoBank {
	return &demoBank{log: log, calls: map[string]int{}, charges: map[string]int{}, byKey: map[string]string{}}
}

func (b *demoBank) Charge(ctx context.Context, o order, key string) (string, error) {
	b.mu.Lock()
	b.calls[o.ID]++
	b.mu.Unlock()
	t := time.NewTimer(time.Duration(20+rand.IntN(60)) * time.Millisecond) // the provider's round trip
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done(): // lease lost or shutting down: stop charging
		return "", context.Cause(ctx)
	}
	if o.ID == declinedID {
		return "", errDeclined
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if r, ok := b.byKey[key]; ok {
		b.log.Info("charged already: the first charge's receipt", "order_id", o.ID, "receipt", r)
		return r, nil
	}
	b.charges[o.ID]++
	r := fmt.Sprintf("rcpt-%s-%04d", o.ID, rand.IntN(10000))
	b.byKey[key] = r
	b.log.Info("charged", "order_id", o.ID, "amount_cents", o.AmountCents, "receipt", r)
	return r, nil
}

// demoWarehouse is main.go's warehouse as the self-check needs it: it
// counts the shipments per order.
type demoWarehouse struct {
	log     *slog.Logger
	mu      sync.Mutex
	shipped map[string]int      // shipments per order
	paid    map[string][]string // receipts of the OrderPaid messages shipped, per order
}

func newDemoWarehouse(log *slog.Logger) *demoWarehouse {
	return &demoWarehouse{log: log, shipped: map[string]int{}, paid: map[string][]string{}}
}

func (w *demoWarehouse) Ship(ctx context.Context, p orderPaid) (string, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.shipped[p.OrderID]++
	w.paid[p.OrderID] = append(w.paid[p.OrderID], p.Receipt)
	w.log.Info("shipping", "order_id", p.OrderID, "ship_to", p.ShipTo)
	return fmt.Sprintf("trk-%s-%d", p.OrderID, w.shipped[p.OrderID]), nil
}

// report prints the summary and returns an error naming every order that
// was charged or shipped other than its story says.
func report(tally1, tally2 *demo.Tally, b *demoBank, w *demoWarehouse, published, failedStaged int,
	deadOrders, deadPaid []amqp.Delivery) error {
	var problems []string
	problem := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }
	b.mu.Lock()
	defer b.mu.Unlock()
	w.mu.Lock()
	defer w.mu.Unlock()

	calls, charged, shipped := 0, 0, 0
	for i := 1; i <= orders; i++ {
		id := orderID(i)
		wantCalls, wantCharges, wantShipped := 1, 1, 1
		switch {
		case i == declined:
			wantCharges, wantShipped = 0, 0
		case slices.Contains(failsAfterStaging, i):
			wantCalls = 2
		}
		calls += b.calls[id]
		charged += b.charges[id]
		shipped += w.shipped[id]
		if got := b.calls[id]; got != wantCalls {
			problem("%s: stage 1 ran %d times, want %d", id, got, wantCalls)
		}
		if got := b.charges[id]; got != wantCharges {
			problem("%s charged %d times, want %d", id, got, wantCharges)
		}
		if got := w.shipped[id]; got != wantShipped {
			problem("%s shipped %d times, want %d", id, got, wantShipped)
		}
		if wantShipped == 1 && w.shipped[id] == 1 && w.paid[id][0] != b.byKey[id] {
			problem("%s shipped with receipt %s, but charged with %s", id, w.paid[id][0], b.byKey[id])
		}
	}

	if len(deadOrders) != 1 || deadOrders[0].MessageId != declinedID {
		var ids []string
		for _, d := range deadOrders {
			ids = append(ids, d.MessageId)
		}
		problem("the orders' dead-letter queue holds %v, want %s once", ids, declinedID)
	}
	if len(deadPaid) != 0 {
		problem("the shipping dead-letter queue holds %d messages, want none", len(deadPaid))
	}

	var out strings.Builder
	line := func(label, format string, args ...any) {
		fmt.Fprintf(&out, "  %-18s %s\n", label, fmt.Sprintf(format, args...))
	}
	var totals outboxTotals
	raw := map[string]int{} // OrderPaid messages the shipping queue received, by message-id
	tally1.View(func(c demo.Counts) {
		totals = sumOutbox(c.Events())
		n := c.Total
		if got, want := n(amqpidem.Completed), orders-1; got != want {
			problem("stage 1 completed %d orders, want %d", got, want)
		}
		if got, want := n(amqpidem.Retried), len(failsAfterStaging); got != want {
			problem("stage 1 retried %d times, want %d", got, want)
		}
		if got, want := totals.Staged, orders-1; got != want {
			problem("%d OrderPaid stored with stage 1's outcomes, want %d", got, want)
		}
		if totals.Returned != 0 {
			problem("%d OrderPaid returned by the broker and given up", totals.Returned)
		}
		fmt.Fprintf(&out, "\nsummary (%d orders, lease TTL %v)\n", orders, leaseTTL)
		line("published", "%d order messages for %d orders", published, orders)
		line("stage 1 ran", "%d times (%d orders, %d of them again after failing after Stage)", calls, orders, len(failsAfterStaging))
		line("charged", "%d orders, once each (%s declined)", charged, declinedID)
		line("stage 1 outcomes", "%s", outcomes(c))
		line("OrderPaid staged", "%d by executions that then failed (never published), %d stored with an outcome",
			failedStaged, totals.Staged)
		line("OrderPaid sent", "%d published by stage 1, confirmed (%d of them re-published by a copy), %d given up",
			totals.Published, totals.Republished, totals.Returned)
	})
	tally2.View(func(c demo.Counts) {
		for _, e := range c.Events() {
			switch e.Outcome {
			case amqpidem.Completed, amqpidem.Duplicate, amqpidem.DeadLettered, amqpidem.Dropped:
				raw[e.Key]++
			}
		}
		received := 0
		for key, k := range raw {
			received += k
			if id, ok := strings.CutSuffix(key, "/paid"); !ok || orderNumber(id) == 0 || id == declinedID {
				problem("shipping received an OrderPaid with message-id %q", key)
			}
		}
		// Every copy in the shipping queue is one stage 1 published after
		// storing its outcome: one from an execution that failed would be
		// one more.
		if received != totals.Published {
			problem("shipping received %d OrderPaid messages, stage 1 published %d", received, totals.Published)
		}
		if got, want := c.Total(amqpidem.Completed), orders-1; got != want {
			problem("stage 2 completed %d OrderPaid, want %d", got, want)
		}
		keys := slices.Sorted(maps.Keys(raw))
		line("shipping received", "%d OrderPaid messages (raw copies) for %d message-ids (%s ... %s)", received, len(raw), keys[0], keys[len(keys)-1])
		line("shipped", "%d orders, once each (%s never)", shipped, declinedID)
		line("stage 2 outcomes", "%s", outcomes(c))
	})
	line("dead letters", "orders: %d (%s, declined), shipping: %d", len(deadOrders), declinedID, len(deadPaid))
	fmt.Print(out.String())

	if len(problems) > 0 {
		return fmt.Errorf("%d problem(s):\n  %s", len(problems), strings.Join(problems, "\n  "))
	}
	fmt.Printf("  %-18s every order charged once and shipped once; nothing staged by a failed execution was sent\n", "ok")
	return nil
}

// outcomes is "completed 23, duplicate 9, ..." in Outcome order, leaving
// out those that did not happen.
func outcomes(c demo.Counts) string {
	var out []string
	for o := amqpidem.Completed; o <= amqpidem.OutboxGivenUp; o++ {
		if n := c.Total(o); n > 0 {
			out = append(out, fmt.Sprintf("%s %d", o, n))
		}
	}
	return strings.Join(out, ", ")
}
