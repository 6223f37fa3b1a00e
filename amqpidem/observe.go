package amqpidem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

// Tracer follows each delivery from the start of its processing to its
// end, for distributed tracing (package otelamqpidem has one for
// OpenTelemetry). Set it in Config.Tracer. Its methods are called from
// the processing goroutines and must be safe for concurrent use; a panic
// in one is logged, not spread.
type Tracer interface {
	// Start is called once per delivery of queue (Config.Queue), before
	// its key's record is read. The context it returns is the delivery's
	// from then on: the store calls, the handler's context (derived from
	// it), the copies published and End all get it.
	Start(ctx context.Context, queue string, d *amqp.Delivery) context.Context
	// Inject adds the trace context of ctx to the headers of a message
	// amqpidem publishes on the delivery's behalf: a delayed or immediate
	// requeue, a dead letter, a reply. The copies carry the delivery's
	// headers already; Inject may overwrite them. It is called as well,
	// with the context given to Stage, on the headers of each message a
	// handler stages, when it is staged: its record keeps them, and every
	// publish of it (`amqpidem outbox redrive` included) carries them.
	Inject(ctx context.Context, headers amqp.Table)
	// End is called once per Start, after the delivery was settled, with
	// the Event the Observer gets (before the Observer gets it).
	End(ctx context.Context, e Event)
}

// PublishTracer is a Tracer that also follows each message amqpidem
// publishes on a delivery's behalf (package otelamqpidem's gives each a
// producer span). When Config.Tracer is one, StartPublish is called for
// those messages in place of Inject; Inject is still called on the
// messages a handler stages, when they are staged.
type PublishTracer interface {
	Tracer
	// StartPublish is called with the delivery's context before amqpidem
	// publishes p, and may write trace context into p.Headers (never
	// nil). The end it returns, if not nil, is called once, after the
	// publish and the tries it took, with the error that left it
	// unpublished (nil when it was published).
	StartPublish(ctx context.Context, p Publish) (end func(err error))
}

// PublishKind says why amqpidem publishes a message on a delivery's
// behalf.
type PublishKind uint8

// The kinds of Publish.
const (
	// PublishRequeue: a copy of the delivery, sent back to its queue at
	// once or after a delay (through a delay queue).
	PublishRequeue PublishKind = iota + 1
	// PublishDeadLetter: the delivery's dead letter.
	PublishDeadLetter
	// PublishReply: the reply to the delivery's ReplyTo.
	PublishReply
	// PublishOutbox: a message a handler staged (Stage). Its headers hold
	// the trace context written when it was staged.
	PublishOutbox
	// PublishRelay: a row of a producer outbox, published by pgstore's
	// Relay outside any delivery (the context is the relay's, Queue is
	// ""). Its headers hold the trace context written with the row
	// (pgstore.Config.Inject).
	PublishRelay
)

// String returns "requeue", "dead_letter", "reply", "outbox" or "relay".
func (k PublishKind) String() string {
	switch k {
	case PublishRequeue:
		return "requeue"
	case PublishDeadLetter:
		return "dead_letter"
	case PublishReply:
		return "reply"
	case PublishOutbox:
		return "outbox"
	case PublishRelay:
		return "relay"
	}
	return fmt.Sprintf("publish_kind(%d)", int(k))
}

// Publish describes a message amqpidem publishes on a delivery's behalf,
// for a PublishTracer.
type Publish struct {
	Kind  PublishKind
	Queue string // Config.Queue, the delivery's queue
	// Exchange and RoutingKey are where the message is published. A
	// requeued copy has "" and Queue, the queue it comes back to, even
	// when it waits in a delay queue on the way.
	Exchange, RoutingKey string
	// Delay is how long a requeued copy waits before it comes back.
	Delay time.Duration
	// Headers are the message's headers, or for a requeued copy those
	// amqpidem sets over the delivery's (HeaderAttempt, HeaderReason):
	// trace context written there replaces the delivery's.
	Headers amqp.Table
	// MessageID and CorrelationID are the message's properties, and
	// BodySize the size of its body in bytes.
	MessageID, CorrelationID string
	BodySize                 int
}

// Server is the RabbitMQ node a Consumer's session is connected to, for a
// Tracer to report (server.address, server.port): the host and port of
// ConsumerConfig.URL, or with ConsumerConfig.Dial the connection's remote
// IP address and port. Never the URL's credentials.
type Server struct {
	Address string // a host name or an IP address
	Port    int
}

// serverKey is the context key of a delivery's Server.
type serverKey struct{}

// ServerFromContext returns the Server a delivery came from, given the
// context Tracer.Start, Tracer.Inject or PublishTracer.StartPublish is
// called with (and the contexts made from it): false for a Wrapper's
// delivery, whose connection amqpidem does not know. The copies a
// Consumer publishes go to the same URL (with Dial, possibly another node
// of a cluster).
func ServerFromContext(ctx context.Context) (Server, bool) {
	s, ok := ctx.Value(serverKey{}).(Server)
	return s, ok
}

// withServer returns ctx carrying s, unless s has no address.
func withServer(ctx context.Context, s Server) context.Context {
	if s.Address == "" {
		return ctx
	}
	return context.WithValue(ctx, serverKey{}, s)
}

// serverOf is the Server of a session on conn: url's host and port, or
// without url (ConsumerConfig.Dial) conn's remote address.
func serverOf(url string, conn *amqp.Connection) Server {
	if url != "" {
		if u, err := amqp.ParseURI(url); err == nil {
			return Server{Address: u.Host, Port: u.Port}
		}
	}
	if conn == nil {
		return Server{}
	}
	a, ok := conn.RemoteAddr().(*net.TCPAddr)
	if !ok || a == nil {
		return Server{}
	}
	return Server{Address: a.IP.String(), Port: a.Port}
}

// HandlerObserver is an Observer that is also told when a handler starts
// and returns (for an in-flight gauge). Both are called on the handler's
// goroutine, with the handler's context and Info: the same context value
// in both calls, so that an observer may use it as the handler's identity
// (to keep the age of the oldest running handler, say).
type HandlerObserver interface {
	Observer
	HandlerStarted(ctx context.Context, info Info)
	HandlerEnded(ctx context.Context, info Info)
}

// StoreCall describes one call amqpidem made to its lock.Store.
type StoreCall struct {
	Queue string // Config.Queue
	// Op is "acquire", "extend", "complete", "fail", "release",
	// "cancel" or "amend" (recording what became of staged messages). A
	// Completer's own completion, in its transaction, is not a call
	// amqpidem makes and is not reported.
	Op string
	// Leases is how many leases the call was about: the batch size of an
	// extend (the heartbeat renews every held lease in one call), else 1.
	Leases int
	// Lost is how many of them the store reported no longer held
	// (lock.ErrLeaseLost).
	Lost int
	// Failed is how many of them got another error (the store did not
	// answer, say): Leases - Lost - Failed were answered.
	Failed int
	// Duration is how long the call took.
	Duration time.Duration
	// Err is the call's first error other than lock.ErrLeaseLost (a store
	// that could not answer, say); nil when it answered.
	Err error
}

// StoreObserver is an Observer that is also told of every call amqpidem
// makes to its store, the heartbeat's renewals included. ObserveStore is
// called synchronously after the call and must be fast.
type StoreObserver interface {
	Observer
	ObserveStore(ctx context.Context, c StoreCall)
}

// Observers returns an Observer that tells each of obs, in order, what it
// is told: Observe, and HandlerStarted, HandlerEnded and ObserveStore to
// those of obs that implement them. Nil entries are skipped.
func Observers(obs ...Observer) Observer {
	var m multiObserver
	for _, o := range obs {
		if o != nil {
			m = append(m, o)
		}
	}
	return m
}

type multiObserver []Observer

// wantsStore reports whether o wants store calls: an Observers of which
// none is a StoreObserver does not.
func wantsStore(o StoreObserver) bool {
	m, ok := o.(multiObserver)
	if !ok {
		return true
	}
	for _, o := range m {
		if _, ok := o.(StoreObserver); ok {
			return true
		}
	}
	return false
}

func (m multiObserver) Observe(ctx context.Context, e Event) {
	m.each(func(o Observer) { o.Observe(ctx, e) })
}

func (m multiObserver) HandlerStarted(ctx context.Context, info Info) {
	m.each(func(o Observer) {
		if h, ok := o.(HandlerObserver); ok {
			h.HandlerStarted(ctx, info)
		}
	})
}

func (m multiObserver) HandlerEnded(ctx context.Context, info Info) {
	m.each(func(o Observer) {
		if h, ok := o.(HandlerObserver); ok {
			h.HandlerEnded(ctx, info)
		}
	})
}

func (m multiObserver) ObserveStore(ctx context.Context, c StoreCall) {
	m.each(func(o Observer) {
		if s, ok := o.(StoreObserver); ok {
			s.ObserveStore(ctx, c)
		}
	})
}

// each calls f with every observer of m, even when one of them panics
// (a gauge kept by a later one must not miss its half of a pair), then
// panics with the first panic's value, which amqpidem logs.
func (m multiObserver) each(f func(Observer)) {
	var first any
	for _, o := range m {
		func() {
			defer func() {
				if v := recover(); v != nil && first == nil {
					first = v
				}
			}()
			f(o)
		}()
	}
	if first != nil {
		panic(first)
	}
}

// observedStore reports every call to its store to obs.
type observedStore struct {
	lock.Store
	queue string
	obs   StoreObserver
	log   *slog.Logger
}

func (s *observedStore) report(ctx context.Context, op string, start time.Time, leases int, errs ...error) {
	c := StoreCall{Queue: s.queue, Op: op, Leases: leases, Duration: time.Since(start)}
	for _, err := range errs {
		switch {
		case err == nil:
		case errors.Is(err, lock.ErrLeaseLost):
			c.Lost++
		default:
			c.Failed++
			if c.Err == nil {
				c.Err = err
			}
		}
	}
	defer func() {
		if v := recover(); v != nil {
			s.log.ErrorContext(ctx, "amqpidem: Observer panicked", "queue", s.queue, "op", op,
				"panic", v, "stack", string(debug.Stack()))
		}
	}()
	s.obs.ObserveStore(ctx, c)
}

func (s *observedStore) Acquire(ctx context.Context, req lock.Request) (lock.Result, error) {
	t := time.Now()
	res, err := s.Store.Acquire(ctx, req)
	s.report(ctx, "acquire", t, 1, err)
	return res, err
}

// taken reports a lease a LeaseTaker took (start: when it began) as the
// store's "acquire".
func (s *observedStore) taken(ctx context.Context, start time.Time, err error) {
	s.report(ctx, "acquire", start, 1, err)
}

func (s *observedStore) Extend(ctx context.Context, leases ...lock.Lease) []error {
	t := time.Now()
	errs := s.Store.Extend(ctx, leases...)
	s.report(ctx, "extend", t, len(leases), errs...)
	return errs
}

func (s *observedStore) Complete(ctx context.Context, lease lock.Lease, result []byte) error {
	t := time.Now()
	err := s.Store.Complete(ctx, lease, result)
	s.report(ctx, "complete", t, 1, err)
	return err
}

func (s *observedStore) Fail(ctx context.Context, lease lock.Lease, reason string) error {
	t := time.Now()
	err := s.Store.Fail(ctx, lease, reason)
	s.report(ctx, "fail", t, 1, err)
	return err
}

func (s *observedStore) Release(ctx context.Context, lease lock.Lease) error {
	t := time.Now()
	err := s.Store.Release(ctx, lease)
	s.report(ctx, "release", t, 1, err)
	return err
}

func (s *observedStore) Cancel(ctx context.Context, lease lock.Lease) error {
	t := time.Now()
	err := s.Store.Cancel(ctx, lease)
	s.report(ctx, "cancel", t, 1, err)
	return err
}

// Amend forwards to the store's Amend; the processor calls it only when
// the store has one.
func (s *observedStore) Amend(ctx context.Context, key string, fence int64, old, value []byte) error {
	a, ok := s.Store.(lock.Amender)
	if !ok {
		return errors.New("amqpidem: the store cannot amend records (lock.Amender)")
	}
	t := time.Now()
	err := a.Amend(ctx, key, fence, old, value)
	s.report(ctx, "amend", t, 1, err)
	return err
}

// startTrace starts the Tracer's follow-up of d, if there is a Tracer.
func (p *processor) startTrace(ctx context.Context, d *amqp.Delivery) (out context.Context) {
	if p.cfg.Tracer == nil {
		return ctx
	}
	out = ctx
	defer p.recoverHook(ctx, "Tracer.Start")
	if c := p.cfg.Tracer.Start(ctx, p.cfg.Queue, d); c != nil {
		out = c
	}
	return out
}

// inject lets the Tracer add the trace context to h, a copy's headers.
func (p *processor) inject(ctx context.Context, h amqp.Table) {
	if p.cfg.Tracer == nil || h == nil {
		return
	}
	defer p.recoverHook(ctx, "Tracer.Inject")
	p.cfg.Tracer.Inject(ctx, h)
}

// startPublish lets the Tracer follow pub, a message the delivery of ctx
// publishes: a PublishTracer's StartPublish, else Inject (but for a
// staged message, whose trace context Stage wrote). The function it
// returns is to be called once with the publish's outcome.
func (p *processor) startPublish(ctx context.Context, pub Publish) (end func(error)) {
	end = func(error) {}
	if p.cfg.Tracer == nil || pub.Headers == nil {
		return end
	}
	pt, ok := p.cfg.Tracer.(PublishTracer)
	if !ok {
		if pub.Kind != PublishOutbox {
			p.inject(ctx, pub.Headers)
		}
		return end
	}
	defer p.recoverHook(ctx, "Tracer.StartPublish")
	if e := pt.StartPublish(ctx, pub); e != nil {
		end = func(err error) {
			defer p.recoverHook(ctx, "Tracer.StartPublish's end")
			e(err)
		}
	}
	return end
}

// stageInject is the outbox's inject: the Tracer's Inject, or nil
// without a Tracer.
func (p *processor) stageInject() func(ctx context.Context, h amqp.Table) {
	if p.cfg.Tracer == nil {
		return nil
	}
	return p.inject
}

// handlerStarted and handlerEnded tell a HandlerObserver about a handler.
func (p *processor) handlerStarted(ctx context.Context, info Info) {
	if h, ok := p.cfg.Observer.(HandlerObserver); ok {
		defer p.recoverHook(ctx, "Observer.HandlerStarted")
		h.HandlerStarted(ctx, info)
	}
}

func (p *processor) handlerEnded(ctx context.Context, info Info) {
	if h, ok := p.cfg.Observer.(HandlerObserver); ok {
		defer p.recoverHook(ctx, "Observer.HandlerEnded")
		h.HandlerEnded(ctx, info)
	}
}

// recoverHook logs a panic of a user's hook (what) rather than spreading it.
func (p *processor) recoverHook(ctx context.Context, what string) {
	if v := recover(); v != nil {
		p.cfg.Logger.ErrorContext(ctx, "amqpidem: "+what+" panicked", "queue", p.cfg.Queue,
			"panic", v, "stack", string(debug.Stack()))
	}
}

// report logs ev and tells the observer.
func (p *processor) report(ctx context.Context, ev *Event) {
	level := slog.LevelDebug // completed, duplicate, busy: nothing to look at
	switch {
	case ev.Outcome == DeadLettered || ev.Err != nil && ev.Outcome != Retried && ev.Outcome != Abandoned:
		level = slog.LevelWarn
	case ev.Outcome == Retried || ev.Outcome == Abandoned || ev.Outcome == Dropped || ev.Err != nil:
		level = slog.LevelInfo
	}
	if p.cfg.Logger.Enabled(ctx, level) {
		attrs := []slog.Attr{
			slog.String("queue", ev.Queue), slog.String("consumer", ev.Consumer), slog.String("key", ev.Key),
			slog.String("outcome", ev.Outcome.String()), slog.Int("attempt", ev.Attempt),
			slog.Int64("fence", ev.Fence), slog.Duration("handler", ev.Handler), slog.Duration("total", ev.Total),
		}
		if ev.Reason != "" {
			attrs = append(attrs, slog.String("reason", ev.Reason))
		}
		if ev.Delay > 0 {
			attrs = append(attrs, slog.Duration("delay", ev.Delay))
		}
		if ev.Err != nil {
			attrs = append(attrs, slog.Any("error", ev.Err))
			// A panic's value alone ("nil pointer dereference") does not
			// say where: the stack recovered with it does.
			if pe := (*PanicError)(nil); errors.As(ev.Err, &pe) && len(pe.Stack) > 0 {
				attrs = append(attrs, slog.String("stack", string(pe.Stack)))
			}
		}
		p.cfg.Logger.LogAttrs(ctx, level, "amqpidem: message "+ev.Outcome.String(), attrs...)
	}
	if p.cfg.Tracer != nil {
		p.endTrace(ctx, *ev)
	}
	if p.cfg.Observer != nil {
		p.observe(ctx, *ev)
	}
}

// endTrace tells the Tracer that the delivery was settled.
func (p *processor) endTrace(ctx context.Context, ev Event) {
	defer p.recoverHook(ctx, "Tracer.End")
	p.cfg.Tracer.End(ctx, ev)
}

// observe tells the Observer of ev; a panic in it is logged, not spread.
func (p *processor) observe(ctx context.Context, ev Event) {
	defer func() {
		if v := recover(); v != nil {
			p.cfg.Logger.ErrorContext(ctx, "amqpidem: Observer panicked", "queue", ev.Queue, "key", ev.Key,
				"panic", v, "stack", string(debug.Stack()))
		}
	}()
	p.cfg.Observer.Observe(ctx, ev)
}
