package main

import (
	"context"
	"fmt"
	"io"
	"sync"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpidem/amqpidem/amqpidem"
)

// steps times where the deliveries of an amqpidem consumer spend their
// time, through the hooks amqpidem offers any user (a Tracer, a
// HandlerObserver and a StoreObserver), for the profiled run: the CPU
// profile says what the process computes, steps what each delivery waits
// for. A delivery's points in time: the Tracer's Start (before its record
// is read), the acquire's reply, its handler's start and end, the
// complete's reply, then with staged messages the amend's start and reply,
// and the Tracer's End (after the ack). Between the complete's reply and
// the amend's start, amqpidem publishes the staged messages and waits for
// their confirms. (With a Tracer, amqpidem copies each staged message's
// headers to let it inject its trace context: a little more CPU than
// without.) Safe for concurrent use.
type steps struct {
	inner amqpidem.Observer // told every Event

	mu          sync.Mutex
	sum         [nSteps]time.Duration
	calls       [2]time.Duration // complete and amend calls proper
	n, outboxed int64            // completed deliveries, those with an amend
	first, last time.Time
}

// The steps of a delivery, in order.
const (
	stepAcquire = iota
	stepSlot
	stepHandler
	stepComplete
	stepPublish
	stepAmend
	stepAck
	nSteps
)

var stepNames = [nSteps]string{
	"acquire (Start to its reply)",
	"wait for a handler slot",
	"handler",
	"complete (handler's end to the reply)",
	"publish, confirm (to amend's start)",
	"amend",
	"ack, settle (last reply to End)",
}

// timeline is one delivery's points in time; zero: not reached.
type timeline struct {
	mu                                        sync.Mutex
	start, acquired, handlerStart, handlerEnd time.Time
	completed, amendStart, amended            time.Time
	completeCall, amendCall                   time.Duration
}

type timelineKey struct{}

func timelineOf(ctx context.Context) *timeline {
	tl, _ := ctx.Value(timelineKey{}).(*timeline)
	return tl
}

// at records, under tl's lock, what f sets.
func (tl *timeline) at(f func(tl *timeline)) {
	if tl == nil {
		return
	}
	tl.mu.Lock()
	f(tl)
	tl.mu.Unlock()
}

func (s *steps) Start(ctx context.Context, _ string, _ *amqp.Delivery) context.Context {
	return context.WithValue(ctx, timelineKey{}, &timeline{start: time.Now()})
}

func (s *steps) Inject(context.Context, amqp.Table) {}

func (s *steps) HandlerStarted(ctx context.Context, _ amqpidem.Info) {
	now := time.Now()
	timelineOf(ctx).at(func(tl *timeline) { tl.handlerStart = now })
}

func (s *steps) HandlerEnded(ctx context.Context, _ amqpidem.Info) {
	now := time.Now()
	timelineOf(ctx).at(func(tl *timeline) { tl.handlerEnd = now })
}

func (s *steps) ObserveStore(ctx context.Context, c amqpidem.StoreCall) {
	now := time.Now()
	timelineOf(ctx).at(func(tl *timeline) {
		switch c.Op {
		case "acquire":
			tl.acquired = now
		case "complete":
			tl.completed, tl.completeCall = now, c.Duration
		case "amend":
			tl.amended, tl.amendCall, tl.amendStart = now, c.Duration, now.Add(-c.Duration)
		}
	})
}

func (s *steps) Observe(ctx context.Context, e amqpidem.Event) { s.inner.Observe(ctx, e) }

func (s *steps) End(ctx context.Context, e amqpidem.Event) {
	end := time.Now()
	tl := timelineOf(ctx)
	if tl == nil || e.Outcome != amqpidem.Completed {
		return
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	points := [nSteps + 1]time.Time{tl.start, tl.acquired, tl.handlerStart, tl.handlerEnd, tl.completed,
		tl.amendStart, tl.amended, end}
	s.mu.Lock()
	defer s.mu.Unlock()
	prev := tl.start
	for i := 1; i <= nSteps; i++ {
		if points[i].IsZero() {
			continue
		}
		s.sum[i-1] += points[i].Sub(prev)
		prev = points[i]
	}
	s.calls[0] += tl.completeCall
	s.calls[1] += tl.amendCall
	s.n++
	if !tl.amended.IsZero() {
		s.outboxed++
	}
	if s.first.IsZero() || tl.start.Before(s.first) {
		s.first = tl.start
	}
	if end.After(s.last) {
		s.last = end
	}
}

var (
	_ amqpidem.Tracer          = (*steps)(nil)
	_ amqpidem.HandlerObserver = (*steps)(nil)
	_ amqpidem.StoreObserver   = (*steps)(nil)
)

// stepTimes are a run's steps, summed.
type stepTimes struct {
	Variant     variant
	QueueType   string
	Sum         [nSteps]time.Duration
	Calls       [2]time.Duration
	N, Outboxed int64
	Span        time.Duration // the first Start to the last End
}

func (s *steps) result(qt string, v variant) *stepTimes {
	s.mu.Lock()
	defer s.mu.Unlock()
	return &stepTimes{Variant: v, QueueType: qt, Sum: s.sum, Calls: s.calls, N: s.n, Outboxed: s.outboxed, Span: s.last.Sub(s.first)}
}

// print writes the mean of each step per completed delivery, and how
// many deliveries were in it on average (its summed time over the span:
// Little's law).
func (st *stepTimes) print(out io.Writer) {
	if st.N == 0 || st.Span <= 0 {
		return
	}
	fmt.Fprintf(out, "\nwall time per delivery in the profiled %s run on %s, %d completed (%d with staged messages), from amqpidem's hooks:\n",
		st.Variant, st.QueueType, st.N, st.Outboxed)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "step\tmean\tin flight\t")
	var total time.Duration
	for i, d := range st.Sum {
		total += d
		if d == 0 {
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%.1f\t\n", stepNames[i], us(d/time.Duration(st.N)), float64(d)/float64(st.Span))
	}
	fmt.Fprintf(tw, "total\t%s\t%.1f\t\n", us(total/time.Duration(st.N)), float64(total)/float64(st.Span))
	tw.Flush()
	fmt.Fprintf(out, "(the store calls proper: complete %s, amend %s per call; in flight: the step's summed time over\n"+
		" the run's %v, the deliveries in that step on average)\n",
		us(st.Calls[0]/time.Duration(st.N)), us(st.Calls[1]/time.Duration(max(st.Outboxed, 1))), st.Span.Round(time.Millisecond))
}
