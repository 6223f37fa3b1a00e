package console_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/amqpidem/amqpidem/console"
)

// TestRates: rates are the counters' differences over the time between
// samples, summed by kind; a counter that went down (a restarted
// consumer) counts from 0; the ring keeps the last samples only; the x
// axis spans the window, the y axis each chart's peak.
func TestRates(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	c := func(completed, duplicate, busy, retried, dead float64) map[string]map[string]float64 {
		return map[string]map[string]float64{"payments": {"completed": completed, "duplicate": duplicate, "busy": busy,
			"retried": retried, "dead_lettered": dead}}
	}
	at := []time.Time{t0, t0.Add(time.Second), t0.Add(2 * time.Second), t0.Add(4 * time.Second)}
	counts := []map[string]map[string]float64{c(0, 0, 0, 0, 0), c(10, 2, 1, 1, 1), c(30, 2, 1, 1, 1), c(4, 2, 1, 1, 3)}
	got := Rates(t, nil, 5, at, counts)
	want := []string{
		// processed: 15/s, 20/s, then a restart: 11 over 2 s.
		// x: 160 units over the 4 s the samples span; y: 35 (0) up to 1
		// (peak).
		"payments processed 5.50/s 20.0/s 40.0,9.5 80.0,1.0 160.0,25.6",
		"payments completed 2.00/s 20.0/s 40.0,18.0 80.0,1.0 160.0,31.6",
		"payments duplicates 0/s 2.00/s 40.0,1.0 80.0,35.0 160.0,35.0",
		"payments requeued 0/s 2.00/s 40.0,1.0 80.0,35.0 160.0,35.0",
		"payments dead-lettered 1.00/s 1.00/s 40.0,1.0 80.0,35.0 160.0,1.0",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("rates:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// A ring not yet full draws over the time it holds: the same.
	if got := Rates(t, nil, 100, at, counts); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("rates of a ring of 100:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// A ring of 3 keeps the last 3 samples: 2 rates.
	got = Rates(t, []string{"payments", "orders"}, 3, at, counts)
	if got, want := len(got), 2*5; got != want {
		t.Fatalf("charts of 2 queues: got %d, want %d", got, want)
	}
	if !strings.HasPrefix(got[0], "orders processed 0/s 0/s ") || !strings.HasPrefix(got[5], "payments processed 5.50/s 20.0/s ") {
		t.Fatalf("ring of 3: %q", got)
	}
	if n := strings.Count(got[5], ","); n != 2 {
		t.Fatalf("ring of 3: %d points, want 2: %q", n, got[5])
	}
}

// Rates is console.Rates for t.
func Rates(t *testing.T, queues []string, keep int, at []time.Time, counts []map[string]map[string]float64) []string {
	t.Helper()
	return console.Rates(queues, keep, at, counts)
}

// counting is a console.Metrics whose completed count grows by 10 each
// read; it fails while fail is set, and blocks in a read while block is.
type counting struct {
	reads atomic.Int64
	fail  atomic.Bool
	block atomic.Bool
	panic atomic.Bool
}

func (c *counting) Outcomes(ctx context.Context) (map[string]map[string]float64, error) {
	n := c.reads.Add(1)
	if c.block.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if c.fail.Load() {
		return nil, errors.New("scrape: connection refused")
	}
	if c.panic.Load() {
		panic("a broken Metrics")
	}
	return map[string]map[string]float64{"payments": {"completed": float64(10 * n)}, "other <q>": {"duplicate": 1}}, nil
}

// TestConsoleRates: with Config.Metrics the overview charts each queue's
// rates once two samples are read, says so before, shows a failed read,
// and Close stops the reading goroutine, also when a read is in flight,
// and may be called twice.
func TestConsoleRates(t *testing.T) {
	before := runtime.NumGoroutine()
	src := &counting{}
	h, err := console.New(console.Config{Metrics: src, MetricsName: "test registry", MetricsInterval: 100 * time.Millisecond,
		MetricsWindow: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveHandler(t, h)
	page := get(t, srv, "/", http.StatusOK)
	mustContain(t, "overview at start", page, "Rates from test registry")
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(page, "<svg class=\"spark\"") {
		if time.Now().After(deadline) {
			t.Fatalf("no chart in 10 s:\n%s", page)
		}
		time.Sleep(50 * time.Millisecond)
		page = get(t, srv, "/", http.StatusOK)
	}
	mustContain(t, "overview", page, "<td>payments</td>", "<td>other &lt;q&gt;</td>", `<polyline points="`,
		`<span class="rate" data-kind="completed">`, "<th>dead-lettered</th>")
	noRaw(t, "overview", page)
	src.fail.Store(true)
	n := src.reads.Load()
	for src.reads.Load() < n+2 {
		time.Sleep(20 * time.Millisecond)
	}
	mustContain(t, "overview, metrics down", get(t, srv, "/", http.StatusOK), "The last read failed", "scrape: connection refused",
		"<svg class=\"spark\"")
	// A source that panics is a failed read, not the program's end.
	src.fail.Store(false)
	src.panic.Store(true)
	n = src.reads.Load()
	for src.reads.Load() < n+2 {
		time.Sleep(20 * time.Millisecond)
	}
	mustContain(t, "overview, metrics panicking", get(t, srv, "/", http.StatusOK), "The last read failed", "panicked: a broken Metrics")
	src.panic.Store(false)
	src.block.Store(true)
	n = src.reads.Load()
	for src.reads.Load() < n+1 {
		time.Sleep(20 * time.Millisecond)
	}
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { h.Close() })
	}
	wg.Wait()
	srv.Close()
	http.DefaultClient.CloseIdleConnections()
	for i := 0; runtime.NumGoroutine() > before; i++ {
		if i > 100 {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines after Close, %d before:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := fmt.Sprint(src.reads.Load()); got == "0" {
		t.Fatal("no read")
	}
}

// serveHandler serves h for the test.
func serveHandler(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}
