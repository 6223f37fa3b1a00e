package amqpidemtest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
	"github.com/amqpidem/amqpidem/amqpidem/internal/kit"
	"github.com/amqpidem/amqpidem/lock"
)

// DefaultQueue is the queue a Kit processes when Config.Queue is empty.
const DefaultQueue = "test"

// Kit runs one handler through amqpidem's processing (see the package
// documentation). Make one with New or NewWithStore; it is stopped when
// the test ends. A Kit is safe for concurrent use: Deliver from several
// goroutines to test concurrent copies.
type Kit struct {
	t       testing.TB
	store   lock.Store
	cfg     amqpidem.Config
	process func(context.Context, kit.Broker, *amqp.Delivery) any

	mu     sync.Mutex
	tag    uint64
	refuse map[string]error // routing key -> error its publishes get
}

// New returns a Kit running h with cfg on a fresh lock.MemoryStore (of
// lock.Config{}: the lease TTL and retention are cfg's or the store's
// defaults). cfg.Queue defaults to DefaultQueue. A handler that completes
// records in its own store (an amqpidem.Completer, pgstore's TxHandler)
// needs NewWithStore. New fails the test if cfg is invalid.
func New(t testing.TB, cfg amqpidem.Config, h amqpidem.Handler) *Kit {
	t.Helper()
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatalf("amqpidemtest: %v", err)
	}
	return NewWithStore(t, store, cfg, h)
}

// NewWithStore is New on store.
func NewWithStore(t testing.TB, store lock.Store, cfg amqpidem.Config, h amqpidem.Handler) *Kit {
	t.Helper()
	if cfg.Queue == "" {
		cfg.Queue = DefaultQueue
	}
	process, stop, err := kit.Wrap(store, cfg, h)
	if err != nil {
		t.Fatalf("amqpidemtest: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = stop(ctx)
	})
	return &Kit{t: t, store: store, cfg: cfg, process: process}
}

// Store is the store the Kit keeps records in: look records up with
// amqpidem.StoreKey(Config.Queue, key).
func (k *Kit) Store() lock.Store { return k.store }

// Refuse makes every later publish to routing key fail with err (nil
// stops that): a staged message the broker returns
// (amqpidem.ErrUnroutable), a dead-letter queue that cannot be published
// to, a reply queue gone. Requeued copies go to the routing key
// "requeue".
func (k *Kit) Refuse(routingKey string, err error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.refuse == nil {
		k.refuse = map[string]error{}
	}
	k.refuse[routingKey] = err
}

// Message is a synthetic delivery. Its key is ID unless Config.Key says
// otherwise.
type Message struct {
	ID            string     // the message-id property
	Body          []byte     // the body
	Headers       amqp.Table // headers, amqpidem's included (HeaderAttempt, ...)
	Redelivered   bool       // the broker's redelivered flag: delivered before, not acked
	ReplyTo       string     // the reply-to property
	CorrelationID string     // the correlation-id property
	ContentType   string     // the content-type property
}

// Publish is one message the processing published.
type Publish struct {
	Exchange   string          // the exchange published to
	RoutingKey string          // its routing key (the queue, through the default exchange)
	Msg        amqp.Publishing // the message, headers included
	// Delay is, for a requeued copy, how long it would wait before it is
	// delivered again; zero for the others.
	Delay time.Duration
}

// Result is what became of one delivery: its Event (Outcome, Reason,
// Attempt, Err, ...) and what was done with it.
type Result struct {
	amqpidem.Event
	// Acked and Nacked say how the delivery was settled (exactly one is
	// set, unless the processing left it to the broker); NackRequeue is
	// the nack's requeue flag.
	Acked, Nacked, NackRequeue bool
	// Requeued is the copy sent back to the queue (busy, retried,
	// abandoned deliveries), or nil.
	Requeued *Publish
	// DeadLetter is the copy published to the dead-letter target (its
	// headers say why: amqpidem.HeaderReason, HeaderError), or nil.
	DeadLetter *Publish
	// Reply is the reply sent to the delivery's ReplyTo, or nil.
	Reply *Publish
	// Published are the other messages published: those the handler
	// staged (amqpidem.Stage), in order.
	Published []Publish
}

// Deliver processes m as one delivery and returns once it is settled.
func (k *Kit) Deliver(m Message) Result {
	k.t.Helper()
	return k.deliver(amqp.Delivery{
		MessageId: m.ID, Body: m.Body, Headers: m.Headers, Redelivered: m.Redelivered,
		ReplyTo: m.ReplyTo, CorrelationId: m.CorrelationID, ContentType: m.ContentType,
	})
}

// Redeliver delivers the copy r.Requeued as the broker would after its
// delay (without waiting it): the next attempt of a retried message, the
// next look of a busy one. It fails the test if r has no copy.
func (k *Kit) Redeliver(r Result) Result {
	k.t.Helper()
	if r.Requeued == nil {
		k.t.Fatalf("amqpidemtest: Redeliver: the delivery was not requeued (%v %q)", r.Outcome, r.Reason)
	}
	p := r.Requeued.Msg
	return k.deliver(amqp.Delivery{
		MessageId: p.MessageId, Body: p.Body, Headers: p.Headers, ReplyTo: p.ReplyTo, CorrelationId: p.CorrelationId,
		ContentType: p.ContentType, ContentEncoding: p.ContentEncoding, DeliveryMode: p.DeliveryMode, Priority: p.Priority,
		Expiration: p.Expiration, Timestamp: p.Timestamp, Type: p.Type, UserId: p.UserId, AppId: p.AppId,
	})
}

func (k *Kit) deliver(d amqp.Delivery) Result {
	k.mu.Lock()
	k.tag++
	d.DeliveryTag = k.tag
	k.mu.Unlock()
	rec := &recorder{k: k}
	d.Acknowledger = rec
	d.RoutingKey = k.cfg.Queue
	if d.Timestamp.IsZero() {
		d.Timestamp = time.Now()
	}
	ev := k.process(context.Background(), rec, &d).(amqpidem.Event)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	r := rec.r
	r.Event = ev
	dlx, dlk := k.cfg.DeadLetterExchange, k.cfg.DeadLetterRoutingKey
	if dlk == "" && dlx == "" {
		dlk = k.cfg.Queue + ".dlq"
	}
	for _, p := range rec.pubs {
		switch {
		case r.DeadLetter == nil && p.Exchange == dlx && p.RoutingKey == dlk && ev.Outcome == amqpidem.DeadLettered:
			r.DeadLetter = &p
		case r.Reply == nil && d.ReplyTo != "" && p.Exchange == "" && p.RoutingKey == d.ReplyTo:
			r.Reply = &p
		default:
			r.Published = append(r.Published, p)
		}
	}
	return r
}

// recorder is one delivery's acknowledger and broker.
type recorder struct {
	k    *Kit
	mu   sync.Mutex
	r    Result
	pubs []Publish
}

func (r *recorder) Ack(uint64, bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.r.Acked = true
	return nil
}

func (r *recorder) Nack(_ uint64, _ bool, requeue bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.r.Nacked, r.r.NackRequeue = true, requeue
	return nil
}

func (r *recorder) Reject(tag uint64, requeue bool) error { return r.Nack(tag, false, requeue) }

func (r *recorder) refused(key string) error {
	r.k.mu.Lock()
	defer r.k.mu.Unlock()
	if err := r.k.refuse[key]; err != nil {
		return fmt.Errorf("amqpidemtest: publish to %q refused: %w", key, err)
	}
	return nil
}

func (r *recorder) Publish(_ context.Context, exchange, key string, msg amqp.Publishing) error {
	if err := r.refused(key); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pubs = append(r.pubs, Publish{Exchange: exchange, RoutingKey: key, Msg: msg})
	return nil
}

func (r *recorder) Requeue(_ context.Context, queue string, msg amqp.Publishing, delay time.Duration) error {
	if err := r.refused("requeue"); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.r.Requeued = &Publish{RoutingKey: queue, Msg: msg, Delay: delay}
	return nil
}
