package amqpidem

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/lock"
)

type traceKey struct{}

// recTracer records what a Tracer is told; it puts "span-<id>" in the
// delivery's context and injects it as header "trace".
type recTracer struct {
	mu     sync.Mutex
	starts []string
	ends   []Event
	inject int
}

func (r *recTracer) Start(ctx context.Context, queue string, d *amqp.Delivery) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.starts = append(r.starts, d.MessageId)
	return context.WithValue(ctx, traceKey{}, "span-"+d.MessageId)
}

func (r *recTracer) Inject(ctx context.Context, h amqp.Table) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.inject++
	h["trace"], _ = ctx.Value(traceKey{}).(string)
}

func (r *recTracer) End(ctx context.Context, e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ctx.Value(traceKey{}) == nil {
		panic("End without the context Start returned")
	}
	r.ends = append(r.ends, e)
}

func TestTracerFollowsEachDelivery(t *testing.T) {
	tr := &recTracer{}
	var inHandler []any
	p, _ := newTestProcessor(t, Config{Tracer: tr, Backoff: Exponential(time.Second, time.Second)},
		func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			inHandler = append(inHandler, ctx.Value(traceKey{}))
			switch string(d.Body) {
			case "retry":
				return nil, errors.New("later")
			case "fatal":
				return nil, Permanent(errors.New("no"))
			}
			return []byte("ok"), nil
		})
	b := &fakeBroker{}
	for _, m := range []struct{ id, body, replyTo string }{
		{"a", "fine", "replies"}, {"b", "retry", ""}, {"c", "fatal", ""}, {"a", "fine", ""},
	} {
		d, _ := delivery(m.id, m.body)
		d.ReplyTo = m.replyTo
		p.process(context.Background(), b, d, nil)
	}
	if len(tr.starts) != 4 || len(tr.ends) != 4 {
		t.Fatalf("starts %v, ends %d: want one of each per delivery", tr.starts, len(tr.ends))
	}
	want := []Outcome{Completed, Retried, DeadLettered, Duplicate}
	for i, e := range tr.ends {
		if e.Outcome != want[i] {
			t.Errorf("End %d: outcome %v, want %v", i, e.Outcome, want[i])
		}
	}
	if len(inHandler) != 3 || inHandler[0] != "span-a" || inHandler[1] != "span-b" || inHandler[2] != "span-c" {
		t.Fatalf("handler contexts carried %v, want each delivery's span", inHandler)
	}
	// Reply, requeue and dead letter each carry their delivery's trace.
	wantTrace := map[string]string{"replies": "span-a", "requeue": "span-b", "q.dlq": "span-c"}
	if len(b.pubs) != 3 {
		t.Fatalf("publishes: %+v, want a reply, a requeue and a dead letter", b.pubs)
	}
	for _, pub := range b.pubs {
		if got := pub.msg.Headers["trace"]; got != wantTrace[pub.key] {
			t.Errorf("publish to %q: trace header %v, want %q", pub.key, got, wantTrace[pub.key])
		}
	}
}

// pubTracer is a recTracer that is a PublishTracer: it records each
// Publish and the error its end was given, and writes "publish-<kind>" as
// header "trace" but for a staged message.
type pubTracer struct {
	recTracer
	pubs []Publish
	errs []error
}

func (r *pubTracer) StartPublish(ctx context.Context, p Publish) func(error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pubs = append(r.pubs, p)
	if p.Kind != PublishOutbox { // a staged message keeps Stage's
		p.Headers["trace"] = "publish-" + p.Kind.String()
	}
	i := len(r.errs)
	r.errs = append(r.errs, errors.New("not ended"))
	return func(err error) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.errs[i] = err
	}
}

// A PublishTracer is told of every copy, reply and staged message
// published, with its kind and destination, in place of Inject, and of
// each publish's end.
func TestPublishTracerFollowsEachPublish(t *testing.T) {
	tr := &pubTracer{}
	p, _ := newTestProcessor(t, Config{Tracer: tr, Backoff: Exponential(time.Second, time.Second)},
		func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			switch string(d.Body) {
			case "retry":
				return nil, errors.New("later")
			case "fatal":
				return nil, Permanent(errors.New("no"))
			}
			return []byte("ok"), Stage(ctx, "events", "shipped", amqp.Publishing{Body: []byte("x")})
		})
	b := &fakeBroker{}
	for _, m := range []struct{ id, body, replyTo string }{{"a", "fine", "replies"}, {"b", "retry", ""}, {"c", "fatal", ""}} {
		d, _ := delivery(m.id, m.body)
		d.ReplyTo = m.replyTo
		p.process(context.Background(), b, d, nil)
	}
	want := []struct {
		kind          PublishKind
		exchange, key string
	}{{PublishOutbox, "events", "shipped"}, {PublishReply, "", "replies"}, {PublishRequeue, "", "q"}, {PublishDeadLetter, "", "q.dlq"}}
	if len(tr.pubs) != len(want) {
		t.Fatalf("StartPublish: %+v, want %d", tr.pubs, len(want))
	}
	for i, w := range want {
		got := tr.pubs[i]
		if got.Kind != w.kind || got.Exchange != w.exchange || got.RoutingKey != w.key || got.Queue != "q" {
			t.Errorf("StartPublish %d: %v %q %q of %q, want %v %q %q of q", i, got.Kind, got.Exchange, got.RoutingKey, got.Queue, w.kind, w.exchange, w.key)
		}
		if tr.errs[i] != nil {
			t.Errorf("StartPublish %d (%v): ended with %v, want nil", i, got.Kind, tr.errs[i])
		}
	}
	if tr.pubs[2].Delay <= 0 {
		t.Errorf("requeue's Publish: Delay %v, want the retry's", tr.pubs[2].Delay)
	}
	// Each copy carries what StartPublish wrote; the staged message what
	// Inject wrote when it was staged (the delivery's span).
	wantTrace := map[string]string{"shipped": "span-a", "replies": "publish-reply", "q": "publish-requeue", "q.dlq": "publish-dead_letter"}
	for _, pub := range b.pubs {
		if w, ok := wantTrace[pub.key]; ok && pub.msg.Headers["trace"] != w {
			t.Errorf("publish to %q: trace header %v, want %q", pub.key, pub.msg.Headers["trace"], w)
		}
	}
}

// A Tracer that panics costs its own work, never the delivery's.
type panicTracer struct{}

func (panicTracer) Start(context.Context, string, *amqp.Delivery) context.Context { panic("start") }
func (panicTracer) Inject(context.Context, amqp.Table)                            { panic("inject") }
func (panicTracer) End(context.Context, Event)                                    { panic("end") }

func TestTracerPanicIsContained(t *testing.T) {
	p, store := newTestProcessor(t, Config{Tracer: panicTracer{}, Logger: discard()}, ok("r"))
	d, ack := delivery("k", "x")
	d.ReplyTo = "replies"
	ev := p.process(context.Background(), &fakeBroker{}, d, nil)
	if ev.Outcome != Completed || ack.acks != 1 {
		t.Fatalf("got %v (acks %d), want completed and acked", ev.Outcome, ack.acks)
	}
	acquireStatus(t, store, "q", "k", lock.Completed)
}

// recObserver records handler starts/ends and store calls.
type recObserver struct {
	mu       sync.Mutex
	running  int
	maxRun   int
	infos    []Info
	calls    []StoreCall
	observed int
}

func (r *recObserver) Observe(context.Context, Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.observed++
}
func (r *recObserver) HandlerStarted(ctx context.Context, info Info) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.running++
	r.maxRun = max(r.maxRun, r.running)
	r.infos = append(r.infos, info)
}
func (r *recObserver) HandlerEnded(ctx context.Context, info Info) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.running--
}
func (r *recObserver) ObserveStore(ctx context.Context, c StoreCall) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, c)
}

func (r *recObserver) ops() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := map[string]int{}
	for _, c := range r.calls {
		n[c.Op] += c.Leases
	}
	return n
}

func TestHandlerAndStoreObservers(t *testing.T) {
	a, b := &recObserver{}, &recObserver{}
	var during int
	p, _ := newTestProcessor(t, Config{Observer: Observers(a, nil, b), LeaseTTL: 60 * time.Millisecond},
		func(ctx context.Context, d *amqp.Delivery) ([]byte, error) {
			a.mu.Lock()
			during = a.running
			a.mu.Unlock()
			time.Sleep(100 * time.Millisecond) // over a lease TTL: the heartbeat extends
			return nil, nil
		})
	d, _ := delivery("k1", "x")
	p.process(context.Background(), &fakeBroker{}, d, nil)
	d, _ = delivery("k1", "x")
	p.process(context.Background(), &fakeBroker{}, d, nil) // a duplicate: no handler
	for _, r := range []*recObserver{a, b} {
		if r.observed != 2 || len(r.infos) != 1 || r.running != 0 || r.infos[0].Key != "k1" || r.infos[0].Attempt != 1 {
			t.Fatalf("observer: %d events, infos %+v, running %d: want 2 events, one handler k1 attempt 1, none running", r.observed, r.infos, r.running)
		}
		ops := r.ops()
		if ops["acquire"] != 2 || ops["complete"] != 1 || ops["extend"] < 1 {
			t.Fatalf("store calls %v, want 2 acquires, 1 complete, at least one extend", ops)
		}
	}
	if during != 1 {
		t.Fatalf("while the handler ran, %d were running, want 1", during)
	}
}

func TestStoreObserverCountsLostLeases(t *testing.T) {
	o := &recObserver{}
	store, err := lock.NewMemoryStore(lock.Config{})
	if err != nil {
		t.Fatal(err)
	}
	s := &observedStore{Store: store, queue: "q", obs: o, log: discard()}
	res, err := s.Acquire(context.Background(), lock.Request{Key: "k", TTL: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	stale := res.Lease
	stale.Fence++
	s.Extend(context.Background(), res.Lease, stale)
	last := o.calls[len(o.calls)-1]
	if last.Op != "extend" || last.Leases != 2 || last.Lost != 1 || last.Failed != 0 || last.Err != nil || last.Queue != "q" {
		t.Fatalf("extend call: %+v, want 2 leases, 1 lost, no error", last)
	}
}

func TestPublishedTime(t *testing.T) {
	d := &amqp.Delivery{Timestamp: time.Unix(1700000000, 0)}
	if got := publishedAt(d, ptr(headersOf(d))); !got.Equal(time.Unix(1700000000, 0)) {
		t.Fatalf("from the timestamp property: %v", got)
	}
	d.Headers = amqp.Table{HeaderTimestampMillis: int64(1700000000123)}
	if got := publishedAt(d, ptr(headersOf(d))); !got.Equal(time.UnixMilli(1700000000123)) {
		t.Fatalf("from the header: %v", got)
	}
	if got := publishedAt(&amqp.Delivery{}, &headers{}); !got.IsZero() {
		t.Fatalf("without either: %v", got)
	}
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }

// acquireStatus checks the record of key on queue's endpoint by acquiring it.
func acquireStatus(t *testing.T, s lock.Store, queue, key string, want lock.Status) {
	t.Helper()
	res, err := s.Acquire(context.Background(), lock.Request{Key: StoreKey(queue, key)})
	if err != nil || res.Status != want {
		t.Fatalf("record of %q: %v %v, want %v", key, res.Status, err, want)
	}
}

func TestStoredResult(t *testing.T) {
	for _, replyTo := range []string{"", "replies"} {
		if got := string(StoredResult(encodeValue(replyTo, []byte("receipt"), nil, 0))); got != "receipt" {
			t.Errorf("reply-to %q: got %q", replyTo, got)
		}
	}
	if got := string(StoredResult([]byte("raw"))); got != "raw" {
		t.Errorf("a value of another form: got %q", got)
	}
}

type panicObserver struct{ recObserver }

func (p *panicObserver) HandlerStarted(ctx context.Context, info Info) { panic("started") }

// A panicking member of Observers costs its own work, not the others': a
// later member still gets both halves of a handler's start and end.
func TestObserversContainEachPanic(t *testing.T) {
	bad, good := &panicObserver{}, &recObserver{}
	p, _ := newTestProcessor(t, Config{Observer: Observers(bad, good), Logger: discard()}, ok("r"))
	d, _ := delivery("k", "x")
	if ev := p.process(context.Background(), &fakeBroker{}, d, nil); ev.Outcome != Completed {
		t.Fatalf("got %v, want completed", ev.Outcome)
	}
	if len(good.infos) != 1 || good.running != 0 || good.observed != 1 {
		t.Fatalf("the second observer: %d starts, %d running, %d events; want 1, 0, 1", len(good.infos), good.running, good.observed)
	}
}

// A dead letter names the endpoint whose record its key has, so that a
// tool replaying it finds that record.
func TestDeadLetterNamesEndpoint(t *testing.T) {
	p, _ := newTestProcessor(t, Config{Endpoint: "ledger"}, func(context.Context, *amqp.Delivery) ([]byte, error) {
		return nil, Permanent(errors.New("no"))
	})
	b := &fakeBroker{}
	d, _ := delivery("k", "x")
	p.process(context.Background(), b, d, nil)
	if len(b.pubs) != 1 || b.pubs[0].msg.Headers[HeaderEndpoint] != "ledger" || b.pubs[0].msg.Headers[HeaderKey] != "k" {
		t.Fatalf("dead letter: %+v, want endpoint ledger and key k", b.pubs)
	}
}
