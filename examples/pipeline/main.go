// Command pipeline is a two-stage pipeline whose hand-off happens exactly
// once. Stage 1 consumes the queue "orders", whose messages are JSON orders
// that were paid for, with the order id as their message-id: it charges
// the order and, in the same handler, stages an OrderPaid event for the
// queue "shipping" with amqpidem.Stage. Stage 2 consumes "shipping" and
// ships each order once per OrderPaid.
//
// Stage merely stages: nothing is sent while the handler runs. When the
// handler succeeds, the OrderPaid is stored with its outcome, in the same
// write, then published (mandatory, confirmed by the broker) before the
// order's delivery is acked. A handler that fails (the charge declined,
// any error, a panic, its lease lost) publishes nothing it staged. If the
// process dies after the outcome was stored and before the OrderPaid was
// confirmed, the order's next copy publishes it, with the same message-id:
// stage 2, keyed on the message-id, acks such a re-publish as a duplicate.
// So every paid order is charged once by stage 1 and shipped once by stage
// 2, however often either queue delivers.
//
// Both stages run in this one program, as two Consumers on one Redis
// store, so that both ends of the hand-off read in one file. Nothing ties
// them together but the queue "shipping": each has its own queue, Config
// and records (Config.Endpoint defaults to the queue), and to run them as
// two services, give each its own copy of main with one NewConsumer call.
//
// This file is a template: a whole program that imports only public
// packages. Copy it into your own module and replace logBank and
// logWarehouse with your payment provider's and warehouse's clients.
// REDIS_ADDR (default 127.0.0.1:6379) and AMQP_URL (default
// amqp://guest:guest@127.0.0.1:5672/) say where Redis and RabbitMQ are.
// SIGINT or SIGTERM stops both stages gracefully: the orders being charged
// and shipped get up to 30 s to finish; any still running then are
// cancelled and go back to their queue.
//
// In this repository `go run ./examples/pipeline` also compiles
// selfcheck.go, which runs a self-checking demo of both stages instead;
// `go run ./examples/pipeline/main.go` runs this file alone.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/lmittmann/tint"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/lock"
)

const (
	ordersQueue   = "orders"
	shippingQueue = "shipping"
	// shutdownGrace is how long the orders being charged and shipped get
	// to finish on SIGINT or SIGTERM.
	shutdownGrace = 30 * time.Second
)

func main() {
	// A hostile message can put terminal escapes into the keys and errors
	// logged, and tint writes values as they are: amqpidem.EscapeControl
	// escapes them.
	log := slog.New(tint.NewTextHandler(os.Stderr, &tint.Options{Level: slog.LevelDebug, TimeFormat: time.TimeOnly,
		ReplaceAttr: amqpidem.EscapeControl}))
	if err := run(log); err != nil {
		log.Error("pipeline stopped", "error", err)
		os.Exit(1)
	}
}

func run(log *slog.Logger) error {
	// The store keeps one record per order id (stage 1) and one per
	// OrderPaid (stage 2) in Redis: the lease while the message is worked
	// on, then its outcome for Config.Retention. Stage 1's records also
	// keep the OrderPaid staged with the outcome until it is published.
	rdb := redis.NewClient(&redis.Options{Addr: envOr("REDIS_ADDR", "127.0.0.1:6379")})
	defer rdb.Close()
	store, err := lock.NewRedisStore(rdb, lock.Config{Prefix: "pipeline", Logger: log})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Check fails if Redis cannot be reached, and warns about an eviction
	// policy that could lose records.
	if err := store.Check(ctx); err != nil {
		return err
	}

	url := envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	charge, err := amqpidem.NewConsumer(store, chargeConsumer(url, ordersQueue, shippingQueue, log),
		chargeHandler(&logBank{log: log, receipts: map[string]string{}}, shippingQueue, log))
	if err != nil {
		return err
	}
	ship, err := amqpidem.NewConsumer(store, shipConsumer(url, shippingQueue, log),
		shipHandler(logWarehouse{log: log}, log))
	if err != nil {
		_ = charge.Shutdown(ctx) // never run: stops its heartbeat
		return err
	}

	stop, stopSignals := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	return serve(stop, shutdownGrace, log, charge, ship)
}

// chargeConsumer is how stage 1 consumes the orders queue. Every field
// left out has a documented default.
func chargeConsumer(url, orders, shipping string, log *slog.Logger) amqpidem.ConsumerConfig {
	return amqpidem.ConsumerConfig{
		URL: url,
		// Declared on every (re)connection, before the first order is
		// taken: the orders queue, as the default declaration would, and
		// the shipping queue, so that the OrderPaid messages stage 1
		// publishes have a queue even before stage 2 ever ran. Staged
		// messages are published mandatory: one no queue takes is returned
		// by the broker, and its order requeued and tried again, with each
		// copy, after UnavailableDelay; after MaxAttempts tries it is given
		// up (logged at warn level, the order acked) and kept in the
		// order's record, for an operator to publish again (`amqpidem
		// outbox redrive`). Never dropped silently, but not shipped either
		// until someone acts: declare it first.
		Declare: func(ch *amqp.Channel) error {
			for _, q := range []string{orders, shipping} {
				if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
					return err
				}
			}
			return nil
		},
		Config: amqpidem.Config{
			Queue: orders,
			// The lease held while an order is charged, renewed every
			// LeaseTTL/3. A copy of an order that finds its OrderPaid stored
			// but not yet confirmed waits (busy) until a lease TTL after the
			// order completed, since the consumer that stored it may still
			// be publishing it; then it publishes it itself: after a crash,
			// the OrderPaid goes out about a lease TTL late.
			LeaseTTL: 30 * time.Second,
			// The idempotency window: a copy of an order arriving within it
			// is recognised, and publishes its OrderPaid if that is still
			// pending.
			Retention: 24 * time.Hour,
			// A charge that takes longer is cancelled and retried.
			HandlerTimeout: time.Minute,
			// A copy of a declined order is acked and dropped: the first
			// copy is in orders.dlq already.
			FailedDuplicate: amqpidem.AckFailedDuplicate,
			Logger:          log,
		},
	}
}

// shipConsumer is how stage 2 consumes the shipping queue; it declares the
// queue too, as stage 1 does. Every field left out has a documented
// default.
func shipConsumer(url, shipping string, log *slog.Logger) amqpidem.ConsumerConfig {
	return amqpidem.ConsumerConfig{
		URL: url,
		Config: amqpidem.Config{
			Queue:    shipping,
			LeaseTTL: 30 * time.Second,
			// At least stage 1's: an OrderPaid is published again only by a
			// copy of its order, which stage 1 recognises for its own
			// Retention, so stage 2 must remember the OrderPaid as long.
			Retention:      24 * time.Hour,
			HandlerTimeout: time.Minute,
			Logger:         log,
		},
	}
}

// serve runs every consumer until stop is done (or one of them ends), then
// shuts them all down at once, giving the handlers in flight up to grace
// to finish. The stages need no order: stage 1 hands its messages to the
// broker, not to stage 2.
func serve(stop context.Context, grace time.Duration, log *slog.Logger, consumers ...*amqpidem.Consumer) error {
	// Run does not get stop: when Run's context ends, the handlers in flight
	// are cancelled at once. Shutdown lets them finish first.
	done := make(chan error, len(consumers))
	for _, c := range consumers {
		go func() { done <- c.Run(context.Background()) }()
	}
	var err error
	running := len(consumers)
	select {
	case err = <-done: // ConsumerConfig.Reconnect gave up; the default never does
		running--
	case <-stop.Done():
	}
	log.Info("shutting down", "grace", grace)
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	// Shutdown stops consuming, sends back the deliveries not started yet,
	// waits for the handlers in flight until ctx ends, then cancels the
	// rest: their messages go back to the queue, and it returns ctx.Err().
	errs := make([]error, len(consumers))
	var stopping sync.WaitGroup
	for i, c := range consumers {
		stopping.Go(func() {
			if serr := c.Shutdown(ctx); serr != nil {
				errs[i] = fmt.Errorf("shutdown: %w", serr)
			}
		})
	}
	stopping.Wait()
	for ; running > 0; running-- {
		if rerr := <-done; !errors.Is(rerr, amqpidem.ErrConsumerClosed) {
			errs = append(errs, rerr)
		}
	}
	return errors.Join(append(errs, err)...)
}

// order is the body of a message of the orders queue.
type order struct {
	ID          string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
	ShipTo      string `json:"ship_to"`
}

// orderPaid is the body of an OrderPaid event, stage 1's hand-off to
// stage 2.
type orderPaid struct {
	OrderID     string `json:"order_id"`
	AmountCents int    `json:"amount_cents"`
	Receipt     string `json:"receipt"`
	ShipTo      string `json:"ship_to"`
}

// errDeclined is a charge that can never succeed.
var errDeclined = errors.New("card declined")

// bank charges orders. A payment provider takes an idempotency key with
// each charge and charges a key once, returning the first charge's receipt
// to a retry: pass it the order id.
type bank interface {
	Charge(ctx context.Context, o order, idempotencyKey string) (receipt string, err error)
}

// chargeHandler is stage 1: it charges the order in a message and stages
// its OrderPaid for the queue shipping. amqpidem runs it once per order id,
// and publishes the OrderPaid once it has stored its outcome.
func chargeHandler(b bank, shipping string, log *slog.Logger) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		var o order
		if err := json.Unmarshal(d.Body, &o); err != nil {
			return nil, amqpidem.Permanent(fmt.Errorf("bad order: %w", err)) // dead-lettered, never retried
		}
		if o.ID == "" {
			return nil, amqpidem.Permanent(errors.New("bad order: no order_id"))
		}
		// The key, the attempt (1 first) and the lease's fencing token;
		// ok is false only when the handler is called outside amqpidem,
		// where Stage fails too (amqpidem.ErrNoOutbox).
		info, ok := amqpidem.FromContext(ctx)
		if !ok {
			return nil, errors.New("no idempotency key: run the handler through amqpidem")
		}
		// The order id is the provider's idempotency key: exactly-once
		// ends at the handler's own effects, and a handler that fails after
		// the charge (Stage refusing, the lease lost, the process dying
		// before the outcome is stored) runs again.
		receipt, err := b.Charge(ctx, o, o.ID)
		switch {
		case errors.Is(err, errDeclined):
			return nil, amqpidem.Permanent(err) // dead-lettered, never retried; nothing staged
		case err != nil:
			return nil, err // retried with backoff, then dead-lettered
		}

		body, err := json.Marshal(orderPaid{OrderID: o.ID, AmountCents: o.AmountCents, Receipt: receipt, ShipTo: o.ShipTo})
		if err != nil {
			return nil, err
		}
		// Staged, not sent: published after this handler returns, and only
		// if it succeeds. The message-id, stage 2's idempotency key, names
		// the event: the order id and "/paid". Left empty, amqpidem would
		// derive one from this message's key and the index of the staged
		// message, stored with it, so just as stable across re-publishes;
		// but an id the event has of its own is better where there is one.
		// It reads in logs and dead letters, it does not depend on the
		// order in which the handler stages, and an order that reaches
		// stage 1 twice under two message-ids (a producer that retried with
		// a fresh id) is charged once by the provider's idempotency key and
		// makes the same OrderPaid twice, which stage 2 ships once; derived
		// ids would differ, and the order would ship twice.
		err = amqpidem.Stage(ctx, "", shipping, amqp.Publishing{
			MessageId:   o.ID + "/paid",
			ContentType: "application/json",
			Body:        body,
		})
		if err != nil {
			// amqpidem.ErrOutboxFull, or a message AMQP cannot carry:
			// nothing staged is published, the order is retried.
			return nil, err
		}
		log.Info("order charged, OrderPaid staged", "key", info.Key, "attempt", info.Attempt, "receipt", receipt)
		return json.Marshal(map[string]string{"order_id": o.ID, "receipt": receipt})
	})
}

// warehouse ships paid orders.
type warehouse interface {
	Ship(ctx context.Context, p orderPaid) (tracking string, err error)
}

// shipHandler is stage 2: it ships the order an OrderPaid is about.
// amqpidem runs it once per OrderPaid message-id, so a re-published
// OrderPaid is acked as a duplicate without shipping again.
func shipHandler(w warehouse, log *slog.Logger) amqpidem.Handler {
	return amqpidem.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
		var p orderPaid
		if err := json.Unmarshal(d.Body, &p); err != nil {
			return nil, amqpidem.Permanent(fmt.Errorf("bad OrderPaid: %w", err))
		}
		if p.OrderID == "" {
			return nil, amqpidem.Permanent(errors.New("bad OrderPaid: no order_id"))
		}
		// ctx ends when the lease is lost, at HandlerTimeout or at
		// shutdown: Ship must stop then.
		tracking, err := w.Ship(ctx, p)
		if err != nil {
			return nil, err // retried with backoff, then dead-lettered
		}
		info, _ := amqpidem.FromContext(ctx)
		log.Info("order shipped", "key", info.Key, "attempt", info.Attempt, "tracking", tracking)
		return json.Marshal(map[string]string{"order_id": p.OrderID, "tracking": tracking})
	})
}

// logBank stands in for a payment provider: it logs each charge, and
// charges an idempotency key once.
type logBank struct {
	log      *slog.Logger
	mu       sync.Mutex
	receipts map[string]string // by idempotency key
}

func (b *logBank) Charge(ctx context.Context, o order, key string) (string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if r, ok := b.receipts[key]; ok {
		return r, nil // charged already: the first charge's receipt
	}
	r := "rcpt-" + o.ID
	b.receipts[key] = r
	b.log.Info("charged", "order_id", o.ID, "amount_cents", o.AmountCents)
	return r, nil
}

// logWarehouse stands in for a warehouse: it logs each shipment.
type logWarehouse struct{ log *slog.Logger }

func (w logWarehouse) Ship(ctx context.Context, p orderPaid) (string, error) {
	w.log.Info("shipping", "order_id", p.OrderID, "ship_to", p.ShipTo)
	return "trk-" + p.OrderID, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
